"""Notebook 00: our engine against transformers' generate(), like with like."""

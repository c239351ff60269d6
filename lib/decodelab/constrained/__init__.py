"""Notebook 04: constrained decoding (constraints, mask engines, decode, jump-forward, distortion, correctors)."""

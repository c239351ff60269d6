"""Notebook 03: multi-token prediction (model, data, training, self-speculation, findings)."""

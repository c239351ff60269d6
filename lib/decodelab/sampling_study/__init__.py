"""Notebook 02: a fair comparison of samplers (grid, metrics, truncation, verdicts, widgets)."""

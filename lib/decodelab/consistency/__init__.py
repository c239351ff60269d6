"""Notebook 05: self-consistency with a shared prompt KV (votes, stopping rules, cost)."""

"""Notebook 05: self-consistency with a shared prompt KV: votes and stopping rules (votes), sampling the pools and
the notebook's goals and findings (experiment), the cost comparison (cost), attention timed alone (attention_bench)."""

"""Notebook 01: drafters, verification, the adaptive policy, the roofline, the bench."""

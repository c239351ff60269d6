"""Helpers every question uses: statistics, goals as data, plots, seeding, timing."""

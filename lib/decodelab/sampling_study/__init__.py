"""Notebook 02: a fair comparison of samplers: the grid and its runner (grid), per-setting tables and cross-fitted
tuning (tables), quality vs diversity on writing (writing), text metrics (metrics), kept-set analysis and sampler
cost (truncation), verdict rows (verdicts), the plan and goals of the notebook (experiment), the kept-set slider
(widgets)."""

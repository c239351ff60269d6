"""The suite around the notebooks: registry (one record per notebook), profiles and parameter checks,
runs (the recorder inside a kernel), runner (papermill), records (run folders), provenance, report,
findings, bench_cli, cli.

Research code never imports it; notebooks call `suite.runs` to record a run. It knows the question
subpackages only by the names in the registry."""

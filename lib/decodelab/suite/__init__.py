"""The suite around the notebooks: registry, profiles, runs, runner, provenance, report, findings, cli.

Research code never imports it; notebooks call `suite.runs` to record a run."""

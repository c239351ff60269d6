"""scripts/gpu_check.sh names real notebooks and real parameters (it can't run here: no GPU)."""
import re
import shlex
from pathlib import Path

from decodelab.suite import profiles, runs

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def script_runs() -> list[tuple[str, dict]]:
    calls = []
    for line in SCRIPT.read_text().splitlines():
        if re.match(r"^run \w", line):
            words = shlex.split(line)
            overrides = profiles.parse_overrides([w for i, w in enumerate(words) if i and words[i - 1] == "-p"])
            calls.append((words[1], overrides))
    return calls


def test_gpu_check_runs_every_registered_notebook():
    assert sorted(name for name, _ in script_runs()) == sorted(runs.NOTEBOOKS)


def test_gpu_check_overrides_are_declared_parameters():
    for name, overrides in script_runs():
        declared = runs.parameters(name)
        unknown = set(overrides) - set(declared)
        assert not unknown, f"{name}: {sorted(unknown)} not in its parameters cell"
        assert runs.params_dir(name).joinpath("gpu.yaml").exists()

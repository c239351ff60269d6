"""scripts/gpu_check.sh runs every registered notebook with real parameters (it can't run here: no GPU)."""
import shlex
from pathlib import Path

from decodelab.suite import cli, profiles, records, registry

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def listed_runs(capsys) -> list[tuple[str, dict]]:
    """What `decodelab list --gpu-check` hands the script: (notebook, its -p overrides) per line."""
    assert cli.main(["list", "--gpu-check"]) == 0
    calls = []
    for line in capsys.readouterr().out.splitlines():
        words = shlex.split(line)
        overrides = profiles.parse_overrides([w for i, w in enumerate(words) if i and words[i - 1] == "-p"])
        calls.append((words[0], overrides))
    return calls


def test_gpu_check_iterates_the_registry_listing():
    text = SCRIPT.read_text()
    assert "decodelab list --gpu-check" in text
    assert "run quickstart" not in text, "the script must not keep its own list of notebooks"


def test_gpu_check_runs_every_registered_notebook(capsys):
    assert [name for name, _ in listed_runs(capsys)] == list(registry.NOTEBOOKS)


def test_gpu_check_overrides_are_declared_parameters(capsys):
    for name, overrides in listed_runs(capsys):
        declared = records.parameters(name)
        unknown = set(overrides) - set(declared)
        assert not unknown, f"{name}: {sorted(unknown)} not in its parameters cell"
        assert overrides, f"{name}: no gpu_check overrides (the check must stay short)"
        profiles.validate(overrides, declared, source=f"{name} gpu_check")
        assert records.params_dir(name).joinpath("gpu.yaml").exists()


def test_list_names_prints_one_runner_name_per_line(capsys):
    assert cli.main(["list", "--names"]) == 0
    assert capsys.readouterr().out.splitlines() == list(registry.NOTEBOOKS)

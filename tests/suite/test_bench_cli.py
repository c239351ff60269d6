"""`decodelab bench decode`: arguments checked before the model loads, its folder, and its defaults
(notebook 00's parameters under a profile: defined once, in the notebook and its profile files)."""
import json

import pytest

from decodelab.core import models
from decodelab.core.models import tiny_model
from decodelab.quickstart import bench
from decodelab.suite import bench_cli, profiles, records

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.mark.parametrize("args, flag, value", [
    (["--repeats", "0"], "--repeats", "'0'"),
    (["--max-new-tokens", "0"], "--max-new-tokens", "'0'"),
    (["--max-new-tokens", "ten"], "--max-new-tokens", "'ten'"),
    (["--batch-sizes", "1,x"], "--batch-sizes", "'1,x'"),
    (["--batch-sizes", "4,0"], "--batch-sizes", "'4,0'"),
])
def test_bad_bench_arguments_name_flag_value_and_allowed_before_loading(monkeypatch, capsys, args, flag, value):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["decode", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and value in err and ">= 1" in err
    assert "Traceback" not in err


def test_bench_command_writes_its_folder_with_tables_and_load_record(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path))
    monkeypatch.setattr(models, "load_model", lambda name: tiny_model(seed=0))
    monkeypatch.setattr(bench, "chat_prompts", lambda tokenizer: PROMPTS)
    assert bench_cli.main(["decode", "--batch-sizes", "1,2", "--max-new-tokens", "4", "--repeats", "1"]) == 0
    (folder,) = (tmp_path / "bench").iterdir()
    assert folder.name.startswith("decode-")
    import pandas as pd

    table = pd.read_csv(folder / "decode.csv")
    assert {"batch", "impl", "tokens_per_s", "seconds", "new_tokens", "identical_rows", "rows"} <= set(table.columns)
    assert (table.identical_rows == table.rows).all() and (table.new_tokens == table.batch * 4).all()
    assert "| ours / HF |" in (folder / "decode.md").read_text()
    env = json.loads((folder / "env.json").read_text())
    assert {"packages", "cpu", "git", "params", "load"} <= set(env)
    assert {"cores", "before", "after", "peak_1min", "loaded"} <= set(env["load"])
    assert env["params"]["batch_sizes"] == [1, 2]


def test_bench_defaults_are_notebook_00s_parameters_under_the_profile():
    path = records.notebook_path("quickstart")
    defaults = profiles.evaluated_defaults(path)
    assert defaults["model"] == models.DEFAULT_MODEL  # `model = DEFAULT_MODEL` in the parameters cell
    for profile in profiles.available_profiles(records.params_dir("quickstart")):
        settings = bench_cli.notebook_settings("quickstart", profile)
        delta = profiles.load_profile(records.params_dir("quickstart"), profile)
        for key in ("model", "batch_sizes", "max_new_tokens", "repeats"):
            assert settings[key] == delta.get(key, defaults[key]), (profile, key)


def test_bench_command_without_flags_uses_the_profiles_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path))
    loaded, measured = [], []
    monkeypatch.setattr(models, "load_model", lambda name: loaded.append(name) or tiny_model(seed=0))
    monkeypatch.setattr(bench, "chat_prompts", lambda tokenizer: PROMPTS)
    real = bench.decode_throughput

    def spy(model, batch_sizes, max_new_tokens, *, repeats, **kw):
        measured.append((batch_sizes, max_new_tokens, repeats))
        return real(model, [1], 2, repeats=1, **kw)

    monkeypatch.setattr(bench, "decode_throughput", spy)
    assert bench_cli.main(["decode", "--profile", "smoke"]) == 0
    smoke = bench_cli.notebook_settings("quickstart", "smoke")
    assert loaded == [models.DEFAULT_MODEL]
    assert measured == [(smoke["batch_sizes"], smoke["max_new_tokens"], smoke["repeats"])]


def test_bench_sample_writes_sampler_and_step_times_per_filter(monkeypatch, tmp_path, capsys):
    from decodelab.quickstart import sampler_bench

    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path))
    monkeypatch.setattr(models, "load_model", lambda name: tiny_model(seed=0))
    monkeypatch.setattr(bench, "chat_prompts", lambda tokenizer: PROMPTS)
    assert bench_cli.main(["sample", "--batch-sizes", "1,2", "--repeats", "1"]) == 0
    (folder,) = (tmp_path / "bench").iterdir()
    assert folder.name.startswith("sample-")
    import pandas as pd

    table = pd.read_csv(folder / "sample.csv")
    assert {"batch", "sampler", "order", "sampler_ms", "step_ms", "ratio", "repeats"} <= set(table.columns)
    assert set(table.batch) == {1, 2}
    assert set(table.sampler) == {sampler_bench.GREEDY, *sampler_bench.SAMPLERS}
    assert (table.sampler_ms > 0).all() and (table.step_ms > 0).all()
    assert ((table.ratio - table.sampler_ms / table.step_ms).abs() < 1e-9).all()
    assert "| sampler / step |" in (folder / "sample.md").read_text()
    env = json.loads((folder / "env.json").read_text())
    assert env["params"]["what"] == "sample" and env["params"]["batch_sizes"] == [1, 2]


def test_bench_sample_defaults_to_batches_1_16_64(monkeypatch, tmp_path):
    from decodelab.quickstart import sampler_bench

    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path))
    monkeypatch.setattr(models, "load_model", lambda name: tiny_model(seed=0))
    seen = []
    monkeypatch.setattr(sampler_bench, "sampler_cost",
                        lambda model, batch_sizes, *, repeats: seen.append((batch_sizes, repeats)) or [])
    monkeypatch.setattr(sampler_bench, "markdown_table", lambda rows: "")
    assert bench_cli.main(["sample", "--profile", "smoke"]) == 0
    assert seen == [([1, 16, 64], bench_cli.notebook_settings("quickstart", "smoke")["repeats"])]


def test_bench_sample_bad_batch_sizes_fail_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["sample", "--batch-sizes", "0"])
    assert exit_info.value.code == 2 and "argument --batch-sizes" in capsys.readouterr().err

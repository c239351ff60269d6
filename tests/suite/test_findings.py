"""README blocks (bench and findings): generated from fake runs in tmp_path, checked against the runs
they name, and refused from loaded runs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_report import LOADED, PNG_MAGIC, make_fake_results, make_run

from decodelab.common.goals import Goal
from decodelab.suite import answers, findings, records, registry

README = """# decodelab

Intro kept as is.

## Decode benchmark

<!-- bench:start -->
old typed table | 1 | 0.43 |
<!-- bench:end -->

## Findings

<!-- findings:start -->
old hand-written text
<!-- findings:end -->

## After
Tail kept as is.
"""


@pytest.fixture
def generated(tmp_path):
    """A README whose both blocks were generated from make_fake_results."""
    root = tmp_path / "results"
    fake = make_fake_results(root)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert findings.update_readme(readme, root=root) is True
    return root, fake, readme


def blocks(text: str) -> tuple[str, str]:
    return (findings.block_of(text, findings.BENCH_START, findings.BENCH_END),
            findings.block_of(text, findings.START, findings.END))


# ---------------------------------------------------------------- writing
def test_both_blocks_replaced_between_markers_rest_kept(generated):
    root, fake, readme = generated
    text = readme.read_text()
    assert text.split(findings.BENCH_START)[0] == README.split(findings.BENCH_START)[0]
    assert text.split(findings.END)[1] == README.split(findings.END)[1]
    bench, block = blocks(text)
    assert "old typed" not in bench and "old hand-written" not in block
    assert f"<!-- bench run: quickstart/{fake['quickstart'].name} -->" in bench
    assert ("| batch | ours tok/s | HF generate tok/s | ours / HF | ours s (fastest-slowest) | HF s (fastest-slowest) "
            "| new tokens (ours / HF) | identical greedy rows |") in bench
    assert "| 4 | 35.4 | 35.0 | 1.01 | 10.84-11.70 | 10.98-11.85 | 384 / 384 | 4/4 |" in bench
    assert "| 16 | 101.2 | 99.5 | 1.02 |" in bench and "| 1536 / 1536 | 15/16 |" in bench
    assert "fastest of 3 interleaved calls per side" in bench
    assert "Identical greedy tokens in every row: no." in bench and "96 new tokens per row" in bench
    assert "quiet (peak load 0.77 on 2 cores)" in bench and "commit `0123456`" in bench


def test_finding_leads_with_question_answer_and_goal_table(generated):
    _, fake, readme = generated
    _, block = blocks(readme.read_text())
    entry = block[block.index("<!-- speculation run:"):block.index("<!-- sampling run:")]
    order = [registry.NOTEBOOKS["speculation"].question,
             "**Answer.** 1 of 3 goals met; not met: never slower at batch 64: 0.871x (target >= 0.97x)",
             "| goal | value | target | status | note |", "| speedup at batch 1 | 1.83x | >= 1.5x | met |",
             "![speedup vs batch](docs/findings/speculation.png)", "| number | value |",
             f"run `speculation/{fake['speculation'].name}`"]
    positions = [entry.index(text) for text in order]
    assert positions == sorted(positions)
    assert "| accuracy lower bound | not measured | >= 0.5 | not measured |" in entry
    assert (readme.parent / "docs" / "findings" / "speculation.png").read_bytes().startswith(PNG_MAGIC)
    assert "`decodelab run masking --profile cpu`" in block
    for question in registry.NOTEBOOKS.values():
        assert question.question in block


def test_regenerating_from_the_same_runs_changes_nothing(generated):
    root, _, readme = generated
    assert findings.update_readme(readme, root=root) is False
    assert findings.check_readme(readme, root=root).ok


def test_findings_use_only_the_requested_profile(tmp_path):
    root = tmp_path / "results"
    make_run(root, "mtp", "20261129-100000-cpu000", profile="cpu", started="2026-11-29T10:00:00+00:00")
    make_run(root, "mtp", "20261129-120000-smoke0", profile="smoke", started="2026-11-29T12:00:00+00:00")
    readme = tmp_path / "README.md"
    readme.write_text(README)
    findings.update_readme(readme, root=root)
    text = readme.read_text()
    assert "mtp verdict from 20261129-100000-cpu000" in text and "smoke0" not in text


@pytest.mark.parametrize("drop", [findings.START, findings.BENCH_END])
def test_missing_markers_raise_and_write_nothing(tmp_path, drop):
    root = tmp_path / "results"
    make_fake_results(root)
    readme = tmp_path / "README.md"
    readme.write_text(README.replace(drop, ""))
    with pytest.raises(ValueError, match=re.escape(drop)):
        findings.update_readme(readme, root=root)
    assert readme.read_text() == README.replace(drop, "")
    assert not (tmp_path / "docs").exists()


def test_key_numbers_quote_named_metrics_with_labels_never_lists():
    question = registry.Notebook("x", "x.ipynb", "t", "q?", ("fig",), (("greedy_match", "greedy identical"),
                                                          ("speedup.*", "speedup at batch {0}"), "absent", "ids"))
    metrics = {"verdict": "v", "prompt_tokens": 40, "speedup": {"1": 1.8, "4": 1.2}, "greedy_match": True,
               "ids": [5071, 3328], "rows": [{"a": 1}]}
    assert answers.key_numbers(question, metrics) == [
        ("greedy identical", True), ("speedup at batch 1", 1.8), ("speedup at batch 4", 1.2)]
    unnamed = registry.Notebook("x", "x.ipynb", "t", "q?", ("fig",))
    assert answers.key_numbers(unnamed, {"a": {"b": 1}, "c_d": 2, "d": [1, 2]}) == [("c d", 2)]


def test_bench_block_comes_from_the_newest_of_quickstart_and_bench_folder(tmp_path):
    root = tmp_path / "results"
    make_run(root, "quickstart", "20261129-100000-qs0000", started="2026-11-29T10:00:00+00:00")
    folder = root / "bench" / "decode-20261130-080000"
    folder.mkdir(parents=True)
    (folder / "decode.csv").write_text("batch,ours_tokens_per_s,hf_tokens_per_s,identical_rows,ratio\n"
                                       "1,11.25,11.5,1/1,0.978\n2,20.5,20.25,2/2,1.0123\n")
    (folder / "env.json").write_text(json.dumps({"cpu": {"model": "Bench CPU", "cores": 16}, "gpu": [],
                                                 "params": {"model": "smollm2-135m", "max_new_tokens": 96}}))
    bench = findings.latest_bench(root, "cpu")
    assert bench.source == "bench/decode-20261130-080000"
    text = findings.render_bench(bench, "cpu")
    assert "| 1 | 11.2 | 11.5 | 0.98 | 1/1 |" in text and "| 2 | 20.5 | 20.2 | 1.01 | 2/2 |" in text
    assert "Identical greedy tokens in every row: yes." in text and "`decodelab bench decode`" in text
    assert "**load not recorded**" in text and "2026-11-30" in text


# ---------------------------------------------------------------- the check
@pytest.mark.parametrize("where, old, new, stale", [
    ("<!-- bench run:", "| 4 | 35.4 | 35.0 | 1.01 |", "| 4 | 35.4 | 35.0 | 1.11 |", "bench block differs"),
    ("<!-- speculation run:", "| speedup at batch 1 | 1.83x |", "| speedup at batch 1 | 1.93x |",
     "findings entry speculation differs"),
    ("<!-- speculation run:", "1 of 3 goals met", "2 of 3 goals met", "findings entry speculation differs"),
])
def test_check_fails_on_a_hand_edited_number(generated, capsys, where, old, new, stale):
    root, _, readme = generated
    text = readme.read_text()
    at = text.index(where)
    assert old in text[at:]
    readme.write_text(text[:at] + text[at:].replace(old, new, 1))
    result = findings.check_readme(readme, root=root)
    assert not result.ok and any(stale in line for line in result.stale)
    assert findings.main(["--readme", str(readme), "--results", str(root), "--check"]) == 1
    assert "stale:" in capsys.readouterr().out


def test_check_fails_on_a_typed_block_that_names_no_run(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    result = findings.check_readme(readme, root=tmp_path / "results")
    assert not result.ok and any("names no run" in line for line in result.stale)


def test_check_fails_when_the_published_figure_is_not_the_runs(generated):
    root, _, readme = generated
    (readme.parent / "docs" / "findings" / "speculation.png").write_bytes(PNG_MAGIC + b"other")
    assert any("speculation.png" in line for line in findings.check_readme(readme, root=root).stale)


def test_check_on_a_clean_clone_regenerates_from_the_published_records(generated, tmp_path):
    _, fake, readme = generated
    empty = tmp_path / "clean-clone-results"
    empty.mkdir()
    published = readme.parent / "docs" / "findings" / findings.PUBLISHED
    assert (published / "speculation" / fake["speculation"].name / "metrics.json").is_file()
    result = findings.check_readme(readme, root=empty)
    assert result.ok and result.missing == []
    text = readme.read_text()
    at = text.index("<!-- speculation run:")
    readme.write_text(text[:at] + text[at:].replace("1 of 3 goals met", "2 of 3 goals met", 1))
    assert any("findings entry speculation differs" in line for line in findings.check_readme(readme, root=empty).stale)


def test_check_without_runs_or_records_names_the_missing_runs_and_passes(generated, tmp_path, capsys):
    import shutil

    _, fake, readme = generated
    shutil.rmtree(readme.parent / "docs" / "findings" / findings.PUBLISHED)
    empty = tmp_path / "clean-clone-results"
    empty.mkdir()
    result = findings.check_readme(readme, root=empty)
    assert result.ok
    assert f"speculation: speculation/{fake['speculation'].name}" in result.missing
    assert f"bench: quickstart/{fake['quickstart'].name}" in result.missing
    assert findings.main(["--readme", str(readme), "--results", str(empty), "--check"]) == 0
    assert "not checked" in capsys.readouterr().out


def test_publishing_keeps_only_the_records_the_readme_names(generated):
    root, fake, readme = generated
    published = readme.parent / "docs" / "findings" / findings.PUBLISHED
    (published / "mtp" / "an-old-run").mkdir(parents=True)
    findings.update_readme(readme, root=root)
    assert not (published / "mtp" / "an-old-run").exists()
    assert sorted(p.name for p in published.iterdir()) == ["quickstart", "sampling", "speculation"]
    assert not (published / "speculation" / fake["speculation_failed"].name).exists()


def test_check_names_newer_runs_without_failing(generated):
    root, _, readme = generated
    make_run(root, "mtp", "20261130-100000-newer0", started="2026-11-30T10:00:00+00:00")
    result = findings.check_readme(readme, root=root)
    assert result.ok and any("mtp: mtp/20261130-100000-newer0" in line for line in result.newer)


NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")


def file_numbers(run_dir: Path) -> list[float]:
    """Every number written in the run's files (JSON, CSV) and its directory name."""
    text = run_dir.name + "".join(p.read_text(errors="replace") for p in run_dir.rglob("*")
                                  if p.suffix in (".json", ".csv"))
    values = [float(t) for t in re.findall(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)]
    metrics = records.read_json(run_dir / "metrics.json", {}) or {}
    if isinstance(metrics.get("goals"), list):  # "1 of 3 goals met": counts of the run's goal rows
        statuses = [row.get("status") for row in metrics["goals"]]
        values += [len(statuses)] + [statuses.count(s) for s in ("met", "not met", "not measured")]
    return values


def explained(token: str, values: list[float]) -> bool:
    """Is `token` a rounding of some value (or of 100x it, for percentages)?"""
    text = token.replace(",", "").lstrip("+")
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    tolerance = 0.5 * 10 ** (int(exponent or 0) - decimals) * (1 + 1e-9)
    target = float(text)
    return any(abs(abs(v) - abs(target)) <= tolerance or abs(abs(v) * 100 - abs(target)) <= tolerance
               for v in values)


def unexplained_numbers(entry: str, run_dir: Path) -> list[str]:
    """Number tokens of a generated entry that no number of its run explains. Code spans (commit, run ids,
    commands), comments (the run line), headings and the question (fixed text of decodelab.suite.registry)
    and the figure link are not data."""
    fixed = [q.title for q in registry.NOTEBOOKS.values()] + [q.question for q in registry.NOTEBOOKS.values()]
    for text in fixed:
        entry = entry.replace(text, "")
    entry = re.sub(r"<!--.*?-->|`[^`]*`|!\[[^\]]*\]\([^)]*\)", "", entry, flags=re.S)
    values = file_numbers(run_dir)
    return [t for t in NUMBER.findall(entry) if not explained(t, values)]


def test_every_number_in_the_blocks_comes_from_the_run_it_names(generated):
    root, _, readme = generated
    bench, block = blocks(readme.read_text())
    entries = [bench] + [entry for _, entry in findings._sections(block)[1].values()]
    checked = 0
    for entry in entries:
        source = findings.RUN_LINE.search(entry).group(2)
        if source == findings.NO_RUN:
            assert not NUMBER.findall(re.sub(r"<!--.*?-->|`[^`]*`", "", entry).split("*", 3)[-1])
            continue
        assert (root / source).is_dir(), f"{source} named but not a run"
        assert unexplained_numbers(entry, root / source) == [], source
        checked += 1
    assert checked == 4  # the bench block and three notebooks
    # the check itself can fail: a number no run wrote is caught
    assert unexplained_numbers(bench.replace("35.4", "37.7"), root / findings.RUN_LINE.search(bench).group(2))


# ---------------------------------------------------------------- loaded runs
@pytest.mark.parametrize("load, shown", [(LOADED, "loaded: timings not comparable (peak load 7.25 on 2 cores)"),
                                         (None, "load not recorded")])
def test_timings_from_a_loaded_run_are_refused_unless_allowed(tmp_path, load, shown):
    root = tmp_path / "results"
    make_run(root, "speculation", "20261129-100000-spec00", load=load)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    with pytest.raises(findings.LoadedRuns) as refused:
        findings.update_readme(readme, root=root)
    message = str(refused.value)
    assert "speculation, run 20261129-100000-spec00" in message and shown in message
    assert "goal speedup_b1" in message and "figure speedup_vs_batch" in message and "--allow-loaded" in message
    assert readme.read_text() == README and not (tmp_path / "docs").exists()

    assert findings.update_readme(readme, root=root, allow_loaded=True) is True
    assert f"**{shown}**" in readme.read_text()


def test_quality_numbers_from_a_loaded_run_are_published(tmp_path):
    root = tmp_path / "results"
    metrics = {"goals": [Goal.check("head_2_accuracy", 0.41, ">=", 0.3, label="head 2 accuracy").to_row()],
               "head_accuracy": {"head_2": 0.41}}
    make_run(root, "mtp", "20261129-100000-mtp000", load=LOADED, metrics=metrics)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert findings.update_readme(readme, root=root) is True
    assert "_(loaded: timings not comparable (peak load 7.25 on 2 cores).)_" in readme.read_text()


def test_main_refuses_loaded_runs_with_exit_code_2(tmp_path, capsys):
    root = tmp_path / "results"
    make_run(root, "quickstart", "20261129-100000-qs0000", load=LOADED)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    with pytest.raises(SystemExit) as exit_info:
        findings.main(["--readme", str(readme), "--results", str(root)])
    assert exit_info.value.code == 2
    assert "bench block, run quickstart/20261129-100000-qs0000" in capsys.readouterr().err
    assert findings.main(["--readme", str(readme), "--results", str(root), "--allow-loaded"]) == 0


# ---------------------------------------------------------------- the repository's README
def test_repository_readme_blocks_match_the_runs_they_name():
    """README.md's generated blocks name their runs and regenerate exactly from them: from results/ where the
    runs are here, else from the records `make findings` committed under docs/findings/runs/."""
    result = findings.check_readme(records.repo_root() / "README.md", root=records.results_root())  # writes nothing
    assert result.stale == [], "README.md is not what its runs give; run `make findings`:\n" + "\n".join(result.stale)
    assert result.missing == [], f"runs named by README.md are neither in results/ nor published: {result.missing}"


def test_verdict_lines_carry_the_interval_and_the_mdd_of_an_inconclusive_row():
    row = {"claim": "min-p beats top-p at T=1", "finding": "inconclusive", "estimate": 0.0, "lo": -0.125,
           "hi": 0.125, "mdd": 0.178, "unit": "points", "n_units": 32, "main": False}
    line = answers.verdict_line(row)
    assert line.startswith("min-p beats top-p at T=1: inconclusive")
    assert "95% CI [-12.5 points, +12.5 points], 32 paired units; minimum detectable difference 17.8 points" in line
    held = answers.verdict_line({**row, "finding": "a > b", "estimate": 0.133, "lo": 0.062, "hi": 0.211, "main": True})
    assert held.startswith("**main** · ") and "minimum detectable" not in held
    assert answers.verdict_line({"claim": "c", "finding": "inconclusive"}) == "c: inconclusive"


def test_publishing_from_a_fresh_results_folder_keeps_the_other_notebooks_published_entries(generated, tmp_path):
    _, fake, readme = generated
    fresh = tmp_path / "fresh-machine-results"  # a clean clone that ran one notebook anew
    newer = make_run(fresh, "speculation", "20261130-100000-eeeeee", figures=["speedup_vs_batch"],
                     started="2026-11-30T10:00:00+00:00")
    findings.update_readme(readme, root=fresh)
    text = readme.read_text()
    assert f"<!-- speculation run: speculation/{newer.name} -->" in text
    assert f"<!-- quickstart run: quickstart/{fake['quickstart'].name} -->" in text  # restored, not dropped
    assert f"<!-- sampling run: sampling/{fake['sampling'].name} -->" in text
    published = readme.parent / "docs" / "findings" / findings.PUBLISHED
    assert (published / "quickstart" / fake["quickstart"].name / "metrics.json").is_file()
    assert not (published / "speculation" / fake["speculation"].name).exists()  # superseded by the newer run
    assert findings.check_readme(readme, root=fresh).ok

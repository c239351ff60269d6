"""The report page and the README findings, built from fake runs in tmp_path (no notebook executed)."""
from __future__ import annotations

import base64
import html
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from decodelab.common.goals import Goal
from decodelab.suite import notebook_export, registry, report, report_html

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- fake runs
def make_png(path: Path, title: str = "figure") -> Path:
    """A real (tiny) matplotlib PNG, drawn without pyplot so no global backend state changes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2.4, 1.6))
    ax = fig.subplots()
    ax.plot([1, 2, 4, 8], [1.8, 1.5, 1.1, 0.8], marker="o")
    ax.set(title=title, xlabel="batch size", ylabel="speedup (x)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=40)
    return path


def make_notebook(path: Path, png: Path) -> Path:
    """An 'executed' notebook: markdown with maths, a stream output and an image output."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    image = base64.b64encode(png.read_bytes()).decode("ascii")
    nb = new_notebook(cells=[
        new_markdown_cell("# Fake notebook\n\nThe acceptance rule $\\min(1, p/q)$. [paper](https://arxiv.org/abs/2211.17192)"),
        new_code_cell("x = 41 + 1\nprint('answer', x)", execution_count=1,
                      outputs=[new_output("stream", name="stdout", text="answer 42\n")]),
        new_code_cell("for _ in tqdm(range(3)): pass", execution_count=3, outputs=[new_output(
            "display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2,
                                                                               "version_minor": 0},
                                  "text/plain": "progress:   0%|          | 0/3"})]),
        new_code_cell("fig", execution_count=2,
                      outputs=[new_output("display_data", data={"image/png": image, "text/plain": "<Figure>"})]),
    ])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2,
                                                                             "version_minor": 0}}
    nb.metadata["kernelspec"] = {"name": "decodelab", "display_name": "decodelab (Python 3)", "language": "python"}
    nbformat.write(nb, str(path))
    return path


QUIET = {"cores": 2, "before": [0.42, 0.3, 0.2], "after": [0.61, 0.4, 0.3], "peak_1min": 0.77, "loaded": False}
LOADED = {"cores": 2, "before": [5.25, 4.0, 3.0], "after": [6.5, 5.0, 4.0], "peak_1min": 7.25, "loaded": True}


def fake_goal_rows(run_id: str) -> list[dict]:
    """One met, one not met, one not measured goal, as decodelab.common.goals writes them."""
    return [
        Goal.check("speedup_b1", 1.8312345, ">=", 1.5, label="speedup at batch 1", unit="x").to_row(),
        Goal.check("never_slower_b64", 0.8712, ">=", 0.97, label="never slower at batch 64", unit="x",
                   note=f"from {run_id}").to_row(),
        Goal.check("accuracy_lower_bound", None, ">=", 0.5, label="accuracy lower bound").to_row(),
    ]


def make_run(root: Path, name: str, run_id: str, *, status: str = "ok", profile: str = "cpu",
             started: str = "2026-11-29T10:00:00+00:00", figures=None, metrics=None,
             captions=None, load=QUIET) -> Path:
    """results/<name>/<run_id>/ the way decodelab.suite.runs lays it out."""
    run_dir = root / name / run_id
    (run_dir / "figures").mkdir(parents=True)
    figures = list(figures if figures is not None else registry.NOTEBOOKS[name].headline)
    for stem in figures:
        make_png(run_dir / "figures" / f"{stem}.png", title=f"{name}: {stem}")
    caps = captions if captions is not None else {stem: f"caption of {stem}" for stem in figures}
    (run_dir / "figures" / "captions.json").write_text(json.dumps(caps))
    env = {
        "name": name, "notebook": f"{name}.ipynb", "profile": profile, "overrides": {}, "status": status,
        "started": started, "finished": started, "wall_s": 12.5, "python": "3.11.2", "platform": "Linux",
        "packages": {"torch": "2.13.0", "decodelab": "0.1.0"},
        "cpu": {"model": "Fake CPU @ 2.0GHz", "cores": 2, "usable_cores": 2}, "memory_gib": 8.0, "gpu": [],
        "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False},
    }
    if load is not None:
        env["load"] = load
    (run_dir / "env.json").write_text(json.dumps(env))
    (run_dir / "params.json").write_text(json.dumps({"model": "smollm2-135m", "seed": 0, "max_new_tokens": 96,
                                                     "output_dir": str(run_dir)}))
    metrics = metrics if metrics is not None else {
        "verdict": f"{name} verdict from {run_id}",
        "speedup_at_b1": 1.8312345,
        "greedy_match": True,
        "per_batch": [{"batch": b, "speedup": 2.0 / b} for b in (1, 2, 4)],
        "sampler_token_ids": {"greedy": [5071, 3328, 2201, 9001]},
        "goals": fake_goal_rows(run_id),
    }
    if name == "quickstart" and "throughput" not in metrics:
        metrics = {**metrics, **write_throughput(run_dir)}
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    if figures:
        make_notebook(run_dir / "notebook.ipynb", run_dir / "figures" / f"{figures[0]}.png")
    return run_dir


THROUGHPUT = [  # batch, ours tok/s, hf tok/s, identical rows
    (1, 9.8765, 10.0123, 1), (4, 35.4321, 34.9876, 4), (16, 101.2345, 99.5432, 15),
]


def write_throughput(run_dir: Path) -> dict:
    """tables/throughput.csv (bench.decode_throughput's rows) and tables/speedup.csv as notebook 00 writes
    them; returns its metrics."""
    import pandas as pd

    rows = []
    for batch, ours, hf, same in THROUGHPUT:
        for impl, tps in (("ours", ours), ("hf", hf)):
            seconds = batch * 96 / tps
            rows.append(dict(batch=batch, impl=impl, tokens_per_s=tps, seconds=seconds, seconds_max=seconds * 1.08,
                             spread=0.08, repeats=3, new_tokens=batch * 96, identical_rows=same, rows=batch))
    (run_dir / "tables").mkdir(exist_ok=True)
    pd.DataFrame(rows).to_csv(run_dir / "tables" / "throughput.csv", index=False)
    ratio = {b: o / h for b, o, h, _ in THROUGHPUT}
    pd.DataFrame({"batch": list(ratio), "ours_over_hf": list(ratio.values())}).to_csv(
        run_dir / "tables" / "speedup.csv", index=False)
    return {"throughput": rows, "ours_over_hf": ratio,
            "identical_greedy_rows": {b: f"{s}/{b}" for b, _, _, s in THROUGHPUT},
            "greedy_match": all(s == b for b, _, _, s in THROUGHPUT)}


def make_fake_results(root: Path) -> dict[str, Path]:
    """Runs for three notebooks (one of them behind a newer failed run); the other three are missing."""
    return {
        "quickstart": make_run(root, "quickstart", "20261129-100000-aaaaaa"),
        "speculation": make_run(root, "speculation", "20261129-100000-bbbbbb",
                                figures=["speedup_vs_batch", "acceptance_vs_k"]),
        "speculation_failed": make_run(root, "speculation", "20261129-110000-cccccc", status="failed",
                                       started="2026-11-29T11:00:00+00:00"),
        "sampling": make_run(root, "sampling", "20261129-100000-dddddd", figures=["zz_first", "other"],
                             captions={"zz_first": "saved first", "other": "saved second"}),
    }


class TagCollector(HTMLParser):
    """(tag, attribute, value) for the resource-loading attributes of script/link/img/iframe."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        for attr in ("src", "href"):
            if tag in ("script", "link", "img", "iframe", "source") and attrs.get(attr):
                self.refs.append((tag, attr, attrs[attr]))


def parse(page: str) -> TagCollector:
    collector = TagCollector()
    collector.feed(page)
    return collector


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One report over make_fake_results, shared by the read-only tests below."""
    root = tmp_path_factory.mktemp("built") / "results"
    fake = make_fake_results(root)
    index = report.build_report(root=root)
    return root, fake, index, index.read_text(encoding="utf-8")


# ---------------------------------------------------------------- the page
def test_page_states_every_question(built):
    _, _, _, page = built
    for question in registry.NOTEBOOKS.values():
        assert html.escape(question.question) in page
        assert html.escape(question.title) in page


def test_missing_notebooks_show_the_command_that_produces_them(built):
    _, _, _, page = built
    for name in ("mtp", "masking", "consistency"):
        assert f"<code>decodelab run {name} --profile cpu</code>" in page
    for name in ("quickstart", "speculation", "sampling"):
        assert f"decodelab run {name} --profile cpu" not in page


def test_failed_run_is_skipped_in_favour_of_latest_ok(built):
    _, fake, _, page = built
    assert fake["speculation"].name in page
    assert fake["speculation_failed"].name not in page
    assert "speculation verdict from 20261129-100000-bbbbbb" in page


def test_latest_of_several_ok_runs_is_shown(tmp_path):
    root = tmp_path / "results"
    make_run(root, "mtp", "20261129-090000-old000", started="2026-11-29T09:00:00+00:00")
    make_run(root, "mtp", "20261129-093000-new000", started="2026-11-29T09:30:00+00:00")
    page = report.build_report(root=root, export=False).read_text()
    assert "mtp verdict from 20261129-093000-new000" in page
    assert "20261129-090000-old000" not in page


def test_notebook_with_only_failed_runs_is_missing_not_an_error(tmp_path):
    root = tmp_path / "results"
    failed = make_run(root, "masking", "20261129-100000-ffffff", status="failed")
    page = report.build_report(root=root, export=False).read_text()
    assert "decodelab run masking --profile cpu" in page
    assert "<b>failed</b>" in page and str(failed) in page


def test_named_run_replaces_latest_for_its_notebook(tmp_path):
    root = tmp_path / "results"
    old = make_run(root, "quickstart", "20261129-080000-named0", started="2026-11-29T08:00:00+00:00")
    make_run(root, "quickstart", "20261129-100000-newer0")
    page = report.build_report([old], root=root, export=False).read_text()
    assert "quickstart verdict from 20261129-080000-named0" in page
    assert "20261129-100000-newer0" not in page


def test_unknown_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="run_dir="):
        report.build_report([tmp_path / "nope"], root=tmp_path, export=False)
    (tmp_path / "other" / "x").mkdir(parents=True)
    with pytest.raises(ValueError, match="not one of"):
        report.build_report([tmp_path / "other" / "x"], root=tmp_path, export=False)


def test_headline_figure_first_and_fallback_to_first_saved(built):
    _, _, _, page = built
    spec = page[page.index('id="speculation"'):]
    assert spec.index('id="fig-speedup_vs_batch"') < spec.index("Other figures")
    samp = page[page.index('id="sampling"'):]
    # no accuracy_vs_temperature: the figure saved first (captions order) is the headline
    assert samp.index('id="fig-zz_first"') < samp.index("Other figures") < samp.index('id="fig-other"')


def test_images_are_embedded_pngs(built):
    _, _, _, page = built
    images = [attrs["src"] for tag, attrs in parse(page).tags if tag == "img"]
    assert len(images) == 5  # quickstart 1, speculation 2, sampling 2
    for src in images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)


def test_no_remote_scripts_styles_or_images(built):
    _, _, index, page = built
    exported = sorted((index.parent / "notebooks").glob("*.html"))
    assert [p.stem for p in exported] == ["quickstart", "sampling", "speculation"]
    for text in [page] + [p.read_text(encoding="utf-8") for p in exported]:
        refs = parse(text).refs
        remote = [r for r in refs if r[2].startswith(("http:", "https:", "//"))]
        assert remote == []
        assert "cdnjs" not in text and "require.min.js" not in text and "cdn.jsdelivr" not in text


def test_executed_notebook_exported_and_linked(built):
    _, _, index, page = built
    assert '<a href="notebooks/speculation.html">executed notebook</a>' in page
    exported = (index.parent / "notebooks" / "speculation.html").read_text(encoding="utf-8")
    assert "answer 42" in exported and ">print<" in exported
    # widget outputs (tqdm bars, sliders) cannot render offline: dropped, with their saved state
    assert "widget-view" not in exported and "widget-state" not in exported and "progress:" not in exported
    assert any(tag == "img" and attrs.get("src", "").startswith("data:image/png")
               for tag, attrs in parse(exported).tags)


def test_hide_code_drops_inputs_but_keeps_outputs(tmp_path):
    root = tmp_path / "results"
    make_run(root, "quickstart", "20261129-100000-aaaaaa")
    index = report.build_report(root=root, hide_code=True)
    exported = (index.parent / "notebooks" / "quickstart.html").read_text(encoding="utf-8")
    assert "answer 42" in exported and ">print<" not in exported


def test_metrics_become_tables_with_capped_rows(tmp_path):
    root = tmp_path / "results"
    metrics = {
        "verdict": ["min-p wins at T>=1.5", "no difference at T=1"],
        "accuracy": {"min_p": {"T=1": 0.4, "T=2": 0.2}, "top_p": {"T=1": 0.41, "T=2": 0.05}},
        "rows": [{"i": i, "x": i * 0.5} for i in range(report_html.MAX_TABLE_ROWS + 7)],
        "nested": {"a": {"b": 3}, "c": 1},
        "curve": list(range(40)),
    }
    make_run(root, "sampling", "20261129-100000-dddddd", metrics=metrics)
    page = report.build_report(root=root, export=False).read_text()
    assert "<li>min-p wins at T&gt;=1.5</li>" in page
    assert "<th>key</th><th>T=1</th><th>T=2</th>" in page and "<td>top_p</td><td>0.41</td>" in page
    assert "… 7 more rows" in page
    assert f"<td>{report_html.MAX_TABLE_ROWS - 1}</td>" in page and f"<td>{report_html.MAX_TABLE_ROWS}</td>" not in page
    assert "<th>nested.a.b</th><td>3</td>" in page
    assert "(40 items)" in page


def section(page: str, name: str) -> str:
    start = page.index(f'<section id="{name}"')
    return page[start:page.index("</section>", start)]


def test_goal_rows_show_met_not_met_and_not_measured(built):
    _, _, _, page = built
    spec = section(page, "speculation")
    assert ('<tr class="met"><td>speedup at batch 1</td><td>1.83x</td><td>&gt;= 1.5x</td><td>met</td>'
            in spec)
    assert '<tr class="not-met"><td>never slower at batch 64</td><td>0.871x</td>' in spec
    assert '<tr class="not-measured"><td>accuracy lower bound</td><td>not measured</td>' in spec


def test_section_answers_first_then_figure_numbers_and_collapsed_metrics(built):
    _, _, _, page = built
    spec = section(page, "speculation")
    order = ['class="question"', '<p class="answer"><b>Answer.</b> 1 of 3 goals met; not met: never slower',
             '<table class="goals">', 'id="fig-speedup_vs_batch"', "Numbers behind the answer",
             "<details><summary>All metrics (metrics.json)</summary>"]
    positions = [spec.index(text) for text in order]
    assert positions == sorted(positions)
    # raw metrics only inside the collapsed block
    raw = spec.index("<details><summary>All metrics")
    assert spec.index("<th>speedup_at_b1</th>") > raw and spec.index("<code>per_batch</code>") > raw


def test_key_numbers_have_readable_labels_and_no_token_id_lists(built):
    _, _, _, page = built
    quick = section(page, "quickstart")
    numbers = quick[quick.index("Numbers behind the answer"):quick.index("<details>")]
    assert "<th>ours / HF tokens/s at batch 4</th><td>1.013</td>" in numbers
    assert "<th>greedy tokens identical to HF generate() in every row</th><td>no</td>" in numbers
    assert "ours_over_hf" not in numbers and "5071" not in numbers


@pytest.mark.parametrize("goals, shown", [
    ({"speedup >= 1.5 at batch 1": True}, "bare value without target (old format)"),
    ([{"name": "speedup", "value": 1.2}], "lacks one of"),
    ([{**Goal.check("speedup", 1.2, ">=", 1.5).to_row(), "met": True}], "recorded met=True"),
    ("all good", "not a list of goal rows"),
])
def test_malformed_goal_rows_are_never_shown_as_met(tmp_path, goals, shown):
    root = tmp_path / "results"
    make_run(root, "mtp", "20261129-100000-mtp000", metrics={"goals": goals, "x": 1})
    page = section(report.build_report(root=root, export=False).read_text(), "mtp")
    assert '<tr class="malformed">' in page and html.escape(shown) in page
    assert '<tr class="met">' not in page and "goals met" not in page


def test_goal_row_without_a_value_is_not_measured_even_if_marked_met(tmp_path):
    root = tmp_path / "results"
    row = {**Goal.check("speedup", None, ">=", 1.5).to_row(), "met": True}
    make_run(root, "mtp", "20261129-100000-mtp000", metrics={"goals": [row]})
    page = section(report.build_report(root=root, export=False).read_text(), "mtp")
    assert '<tr class="not-measured">' in page and "0 of 1 goals met" in page


def test_loaded_run_and_unrecorded_load_are_marked(tmp_path):
    root = tmp_path / "results"
    make_run(root, "mtp", "20261129-100000-mtp000", load=LOADED)
    make_run(root, "masking", "20261129-100000-msk000", load=None)
    make_run(root, "quickstart", "20261129-100000-qs0000")
    page = report.build_report(root=root, export=False).read_text()
    assert '<span class="badge loaded">loaded: timings not comparable (peak load 7.25 on 2 cores)</span>' in page
    assert "(loaded: timings not comparable (peak load 7.25 on 2 cores).)" in section(page, "mtp")
    assert '<span class="badge unknown">load not recorded</span>' in section(page, "masking")
    assert '<span class="badge quiet">quiet (peak load 0.77 on 2 cores)</span>' in section(page, "quickstart")


def test_load_above_core_count_is_loaded_even_without_the_flag():
    from decodelab.suite import answers

    assert answers.load_state({"load": {"cores": 2, "before": 1.0, "after": 2.6}})[0] == answers.LOADED
    assert answers.load_state({"load": {"cores": 2, "peak_1min": 1.9}})[0] == answers.QUIET
    assert answers.load_state({"load": {"cores": 2}})[0] == answers.UNKNOWN
    assert answers.load_state({})[0] == answers.UNKNOWN


def test_provenance_lists_profile_model_commit_versions_hardware(built):
    _, fake, _, page = built
    spec = section(page, "speculation")
    for text in ("<th>profile</th><td>cpu</td>", "<th>machine load</th><td>quiet (peak load 0.77 on 2 cores)</td>",
                 "<th>model</th><td>smollm2-135m</td>", "0123456789ab",
                 "<th>torch</th><td>2.13.0</td>", "Fake CPU @ 2.0GHz (2 cores)", "<th>wall time (s)</th><td>12.5</td>",
                 str(fake["speculation"])):
        assert text in spec


def test_strip_remote_assets_keeps_local_and_inline():
    page = ('<script src="https://cdn.example/x.js"></script><script>var a = 1;</script>'
            '<link rel="stylesheet" href="//cdn.example/s.css"><link rel="stylesheet" href="local.css">'
            '<script src="local.js"></script>')
    assert notebook_export.strip_remote_assets(page) == (
        '<script>var a = 1;</script><link rel="stylesheet" href="local.css"><script src="local.js"></script>'
    )


def test_main_writes_index_into_out_dir(tmp_path, capsys):
    root = tmp_path / "results"
    make_run(root, "consistency", "20261129-100000-eeeeee")
    assert report.main(["--results", str(root), "--out", str(tmp_path / "site"), "--no-notebooks"]) == 0
    assert (tmp_path / "site" / "index.html").is_file()
    assert "site" in capsys.readouterr().out


def test_profile_option_restricts_the_automatic_choice(tmp_path):
    root = tmp_path / "results"
    make_run(root, "mtp", "20261129-100000-cpu000", profile="cpu", started="2026-11-29T10:00:00+00:00")
    make_run(root, "mtp", "20261129-120000-smoke0", profile="smoke", started="2026-11-29T12:00:00+00:00")
    assert "smoke0" in report.build_report(root=root, export=False).read_text()
    page = report.build_report(root=root, export=False, profile="cpu").read_text()
    assert "mtp verdict from 20261129-100000-cpu000" in page and "smoke0" not in page


def test_verdict_records_render_as_a_table_not_json(tmp_path):
    root = tmp_path / "results"
    verdict = [{"claim": "tuned min-p beats tuned top-p at T=2", "key": {"a": "min_p"}, "estimate": 0.125,
                "finding": "inconclusive"}]
    make_run(root, "sampling", "20261129-100000-dddddd", metrics={"verdict": verdict, "goals": []})
    page = section(report.build_report(root=root, export=False).read_text(), "sampling")
    assert "<th>claim</th><th>estimate</th><th>finding</th>" in page and "<td>inconclusive</td>" in page
    assert "{&quot;claim&quot;" not in page
    from decodelab.suite import findings

    assert findings.verdict_md(verdict) == "> **Verdict.**\n> - tuned min-p beats tuned top-p at T=2: inconclusive\n"

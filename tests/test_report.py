"""The report page and the README findings, built from fake runs in tmp_path (no notebook executed)."""
from __future__ import annotations

import base64
import html
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from decodelab import findings, report

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


def make_run(root: Path, name: str, run_id: str, *, status: str = "ok", profile: str = "cpu",
             started: str = "2026-11-29T10:00:00+00:00", figures=None, metrics=None,
             captions=None) -> Path:
    """results/<name>/<run_id>/ the way decodelab.runs lays it out."""
    run_dir = root / name / run_id
    (run_dir / "figures").mkdir(parents=True)
    figures = list(figures if figures is not None else report.QUESTIONS[name].headline)
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
    (run_dir / "env.json").write_text(json.dumps(env))
    (run_dir / "params.json").write_text(json.dumps({"model": "smollm2-135m", "seed": 0, "output_dir": str(run_dir)}))
    metrics = metrics if metrics is not None else {
        "verdict": f"{name} verdict from {run_id}",
        "speedup_at_b1": 1.8312345,
        "greedy_match": True,
        "per_batch": [{"batch": b, "speedup": 2.0 / b} for b in (1, 2, 4)],
        "goals": {"speedup >= 1.5 at batch 1": True, "never slower at batch 64": False},
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    if figures:
        make_notebook(run_dir / "notebook.ipynb", run_dir / "figures" / f"{figures[0]}.png")
    return run_dir


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
    for question in report.QUESTIONS.values():
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
    assert any(tag == "img" and attrs.get("src", "").startswith("data:image/png") for tag, attrs in parse(exported).tags)


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
        "rows": [{"i": i, "x": i * 0.5} for i in range(report.MAX_TABLE_ROWS + 7)],
        "nested": {"a": {"b": 3}, "c": 1},
        "curve": list(range(40)),
    }
    make_run(root, "sampling", "20261129-100000-dddddd", metrics=metrics)
    page = report.build_report(root=root, export=False).read_text()
    assert "<li>min-p wins at T&gt;=1.5</li>" in page
    assert "<th>key</th><th>T=1</th><th>T=2</th>" in page and "<td>top_p</td><td>0.41</td>" in page
    assert "… 7 more rows" in page
    assert f"<td>{report.MAX_TABLE_ROWS - 1}</td>" in page and f"<td>{report.MAX_TABLE_ROWS}</td>" not in page
    assert "<th>nested.a.b</th><td>3</td>" in page
    assert "(40 items)" in page


def test_goals_are_a_checklist_not_numbers(built):
    _, _, _, page = built
    spec = page[page.index('id="speculation"'):page.index('id="sampling"')]
    assert '<li class="met">✓ speedup &gt;= 1.5 at batch 1</li>' in spec
    assert '<li class="unmet">✗ never slower at batch 64</li>' in spec
    assert "goals." not in spec


def test_provenance_lists_profile_model_commit_versions_hardware(built):
    _, fake, _, page = built
    spec = page[page.index('id="speculation"'):page.index('id="sampling"')]
    for text in ("<th>profile</th><td>cpu</td>", "<th>model</th><td>smollm2-135m</td>", "0123456789ab",
                 "<th>torch</th><td>2.13.0</td>", "Fake CPU @ 2.0GHz (2 cores)", "<th>wall time (s)</th><td>12.5</td>",
                 str(fake["speculation"])):
        assert text in spec


def test_strip_remote_assets_keeps_local_and_inline():
    page = ('<script src="https://cdn.example/x.js"></script><script>var a = 1;</script>'
            '<link rel="stylesheet" href="//cdn.example/s.css"><link rel="stylesheet" href="local.css">'
            '<script src="local.js"></script>')
    assert report.strip_remote_assets(page) == (
        '<script>var a = 1;</script><link rel="stylesheet" href="local.css"><script src="local.js"></script>'
    )


def test_main_writes_index_into_out_dir(tmp_path, capsys):
    root = tmp_path / "results"
    make_run(root, "consistency", "20261129-100000-eeeeee")
    assert report.main(["--results", str(root), "--out", str(tmp_path / "site"), "--no-notebooks"]) == 0
    assert (tmp_path / "site" / "index.html").is_file()
    assert "site" in capsys.readouterr().out


# ---------------------------------------------------------------- README findings
README = """# decodelab

Intro kept as is.

## Findings

<!-- findings:start -->
old hand-written text
<!-- findings:end -->

## After
Tail kept as is.
"""


def test_findings_block_replaced_between_markers(tmp_path):
    root = tmp_path / "results"
    make_fake_results(root)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert findings.update_readme(readme, root=root) is True
    text = readme.read_text()
    before, rest = text.split(findings.START)
    block, after = rest.split(findings.END)
    assert before == README.split(findings.START)[0] and after == README.split(findings.END)[1]
    assert "old hand-written" not in block
    assert "![speedup vs batch](docs/findings/speculation.png)\n\n*caption of speedup_vs_batch*" in block
    assert (tmp_path / "docs" / "findings" / "speculation.png").read_bytes().startswith(PNG_MAGIC)
    assert "> **Verdict.** speculation verdict from 20261129-100000-bbbbbb" in block
    assert "| `speedup_at_b1` | 1.831 |" in block
    assert "- ✓ speedup >= 1.5 at batch 1\n- ✗ never slower at batch 64\n" in block
    assert "Fake CPU @ 2.0GHz (2 cores)" in block and "commit `0123456`" in block and "2026-11-29" in block
    assert "`decodelab run masking --profile cpu`" in block
    for question in report.QUESTIONS.values():
        assert question.question in block
    # regenerating from the same runs changes nothing
    assert findings.update_readme(readme, root=root) is False
    assert findings.update_readme(readme, root=root, check=True) is False


def test_findings_use_only_the_requested_profile(tmp_path):
    root = tmp_path / "results"
    make_run(root, "mtp", "20261129-100000-cpu000", profile="cpu", started="2026-11-29T10:00:00+00:00")
    make_run(root, "mtp", "20261129-120000-smoke0", profile="smoke", started="2026-11-29T12:00:00+00:00")
    readme = tmp_path / "README.md"
    readme.write_text(README)
    findings.update_readme(readme, root=root)
    text = readme.read_text()
    assert "mtp verdict from 20261129-100000-cpu000" in text and "smoke0" not in text


def test_findings_without_markers_raise_and_write_nothing(tmp_path):
    root = tmp_path / "results"
    make_fake_results(root)
    readme = tmp_path / "README.md"
    readme.write_text("# decodelab\n\nno markers here\n")
    with pytest.raises(ValueError, match="findings:start"):
        findings.update_readme(readme, root=root)
    assert readme.read_text() == "# decodelab\n\nno markers here\n"
    assert not (tmp_path / "docs").exists()


def test_findings_main_exit_codes(tmp_path, capsys):
    root = tmp_path / "results"
    make_fake_results(root)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    args = ["--readme", str(readme), "--results", str(root)]
    assert report.findings_main(args + ["--check"]) == 1
    assert report.findings_main(args) == 0
    assert report.findings_main(args + ["--check"]) == 0
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit) as exit_info:
        report.findings_main(args)
    assert exit_info.value.code == 2
    assert "findings:start" in capsys.readouterr().err


def test_findings_quote_named_key_metrics_by_pattern():
    question = report.Question("x", "t", "q?", ("fig",), ("greedy_match", "speedup.*", "absent"))
    metrics = {"verdict": "v", "prompt_tokens": 40, "speedup": {"1": 1.8, "4": 1.2}, "greedy_match": True,
               "rows": [{"a": 1}]}
    assert findings.key_numbers(question, metrics) == [("greedy_match", True), ("speedup.1", 1.8), ("speedup.4", 1.2)]
    unnamed = report.Question("x", "t", "q?", ("fig",))
    assert findings.key_numbers(unnamed, {"a": {"b": 1}, "c": 2, "d": [1, 2]}) == [("c", 2), ("a.b", 1)]


def test_profile_option_restricts_the_automatic_choice(tmp_path):
    root = tmp_path / "results"
    make_run(root, "mtp", "20261129-100000-cpu000", profile="cpu", started="2026-11-29T10:00:00+00:00")
    make_run(root, "mtp", "20261129-120000-smoke0", profile="smoke", started="2026-11-29T12:00:00+00:00")
    assert "smoke0" in report.build_report(root=root, export=False).read_text()
    page = report.build_report(root=root, export=False, profile="cpu").read_text()
    assert "mtp verdict from 20261129-100000-cpu000" in page and "smoke0" not in page

"""Offline HTML exports of executed notebooks, for the report: nothing on the page reaches the network.

The lab template is used minus everything it fetches from CDNs (require.js, MathJax, mermaid, the
widget manager); figures are embedded; any remaining remote <script src>/<link href> is removed.
"""
from __future__ import annotations

import os
import re
from pathlib import Path


def strip_remote_assets(page: str) -> str:
    """Remove <script src="http..."> and <link href="http..."> so a page never reaches the network."""
    page = re.sub(r"<script\b[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//[^>]*>.*?</script\s*>", "", page,
                  flags=re.I | re.S)
    return re.sub(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>", "", page, flags=re.I)


# ---------------------------------------------------------------- notebook export
# The lab template minus everything it fetches from CDNs (require.js, MathJax, mermaid, widget
# manager). Math stays as TeX source; widget outputs are dropped (`drop_widgets`).
OFFLINE_TEMPLATE_NAME = "decodelab_offline.html.j2"
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def drop_widgets(nb) -> None:
    """Remove widget outputs (tqdm bars, sliders) and saved widget state, in place: without a live
    kernel and the widget manager (a CDN script) they render as nothing or as a stale "0%" bar."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.get("outputs"):
            cell.outputs = [o for o in cell.outputs if WIDGET_VIEW not in o.get("data", {})]


def export_notebook(notebook: str | Path, out_path: str | Path, *, hide_code: bool = False) -> Path:
    """Executed notebook -> standalone offline HTML (images inline; code cells dropped when hide_code)."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(
        template_name="lab",
        template_file=OFFLINE_TEMPLATE_NAME,
        extra_loaders=[DictLoader({OFFLINE_TEMPLATE_NAME: OFFLINE_TEMPLATE})],
        embed_images=True,
        exclude_input=hide_code,
        exclude_input_prompt=hide_code,
    )
    nb = nbformat.read(str(notebook), as_version=4)
    drop_widgets(nb)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": Path(notebook).parent.name}})
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(out_path, strip_remote_assets(body))
    return out_path


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

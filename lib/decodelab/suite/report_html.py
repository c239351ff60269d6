"""The report's HTML pieces: metrics split into scalars and tables, tables, the verdict block,
embedded figures and the page's inline CSS (offline: figures are data: URIs, no CDN)."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from decodelab.suite.answers import STATEMENT_KEYS, esc, fmt, is_scalar

MAX_TABLE_ROWS = 20


def is_flat(value: Any) -> bool:
    """A scalar or a list of scalars."""
    return is_scalar(value) or (isinstance(value, list) and all(is_scalar(v) for v in value))


def split_metrics(metrics: dict) -> tuple[list[tuple[str, Any]], list[tuple[str, list[dict]]]]:
    """metrics.json -> (scalars as (dotted key, value), tables as (dotted key, rows)), for display.

    A list of dicts is a table; a dict whose values are all dicts of scalars is a table with one row
    per key (column "key"); a dict of 3+ scalars (or lists of them) is a key/value table; other dicts
    are flattened into dotted keys. STATEMENT_KEYS ("verdict", "goals") are left out.
    """
    scalars: list[tuple[str, Any]] = []
    tables: list[tuple[str, list[dict]]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            inner = list(value.values())
            if all(isinstance(v, dict) and v and all(is_scalar(x) for x in v.values()) for v in inner):
                tables.append((prefix, [{"key": k, **v} for k, v in value.items()]))
            elif prefix and len(value) >= 3 and all(is_flat(v) for v in inner):
                tables.append((prefix, [{"key": k, "value": v} for k, v in value.items()]))
            else:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((prefix, value))
        else:
            scalars.append((prefix, value))

    for key, value in metrics.items():
        if key not in STATEMENT_KEYS:
            walk(str(key), value)
    return scalars, tables


# ---------------------------------------------------------------- HTML pieces
def html_table(rows: list[dict], max_rows: int = MAX_TABLE_ROWS) -> str:
    """Rows (dicts) -> <table> with the union of keys as columns; at most `max_rows` rows shown."""
    columns: list[str] = []
    for row in rows:
        columns += [str(k) for k in row if str(k) not in columns]
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(fmt(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows[:max_rows]
    )
    more = (f'<tr class="more"><td colspan="{len(columns)}">… {len(rows) - max_rows} more rows '
            f'(see metrics.json)</td></tr>') if len(rows) > max_rows else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}{more}</tbody></table>"


def kv_table(items, max_rows: int = 60) -> str:
    """(key, value) pairs -> a two-column <table>."""
    items = list(items)
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(fmt(v))}</td></tr>" for k, v in items[:max_rows])
    if len(items) > max_rows:
        rows += f'<tr class="more"><td colspan="2">… {len(items) - max_rows} more</td></tr>'
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def verdict_html(verdict: Any) -> str:
    if verdict is None or verdict == "" or verdict == [] or verdict == {}:
        return ""
    if isinstance(verdict, dict):
        inner = "".join(f"<li><b>{esc(k)}</b>: {esc(fmt(v) if not isinstance(v, str) else v)}</li>"
                        for k, v in verdict.items())
        body = f"<ul>{inner}</ul>"
    elif isinstance(verdict, list) and all(isinstance(v, dict) for v in verdict):  # verdict records: a table
        body = html_table([{k: x for k, x in v.items() if is_scalar(x)} for v in verdict])
    elif isinstance(verdict, list):
        body = "<ul>" + "".join(f"<li>{esc(v if isinstance(v, str) else fmt(v))}</li>" for v in verdict) + "</ul>"
    else:
        body = f"<p>{esc(verdict)}</p>"
    return f'<div class="verdict"><h3>Verdict</h3>{body}</div>'


def data_uri(path: Path) -> str:
    mime = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
    kind = mime.get(path.suffix.lower(), "application/octet-stream")
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def figure_html(stem: str, path: Path, caption: str) -> str:
    text = caption or stem
    return (f'<figure id="fig-{esc(stem)}"><img src="{data_uri(path)}" alt="{esc(text)}">'
            f"<figcaption><code>{esc(stem)}</code> — {esc(caption or 'no caption recorded')}</figcaption></figure>")


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; margin: 0; color: #1d1d1f;
       background: #fafafa; line-height: 1.45; }
main { max-width: 1100px; margin: 0 auto; padding: 1.5rem 2rem 4rem; }
header p { color: #555; margin: .2rem 0; }
nav ul { columns: 2; padding-left: 1.2rem; }
section { background: #fff; border: 1px solid #e3e3e3; border-radius: 8px; padding: 1rem 1.5rem; margin: 1.5rem 0; }
section.missing { background: #fbfbf8; border-style: dashed; }
h2 { margin-top: .3rem; } h3 { margin-bottom: .3rem; font-size: 1.02rem; }
.question { font-size: 1.15rem; font-weight: 600; }
.answer { border-left: 4px solid #4e79a7; background: #f3f6fa; padding: .4rem 1rem; margin: .8rem 0; }
.verdict { border-left: 4px solid #bbb; padding: .1rem 1rem; margin: .6rem 0; }
.verdict td:first-child { min-width: 18rem; }
table.goals tr.met td:nth-child(4) { color: #1e6b34; font-weight: 600; }
table.goals tr.not-met td:nth-child(4) { color: #a12a2a; font-weight: 600; }
table.goals tr.not-measured td:nth-child(4), table.goals tr.malformed td:nth-child(4) { color: #8a6d00; }
.badge { display: inline-block; padding: 0 .5rem; border-radius: 4px; font-size: .85rem; background: #eee; }
.badge.failed, .badge.loaded { background: #f8d7da; } .badge.ok, .badge.quiet { background: #d4edda; }
.badge.unknown { background: #fff3cd; }
figure { margin: 1rem 0; } figure img { max-width: min(100%, 760px); height: auto; border: 1px solid #eee; }
figcaption { color: #444; font-size: .92rem; }
table { border-collapse: collapse; margin: .4rem 0 1rem; font-size: .88rem; display: block; overflow-x: auto; }
th, td { border: 1px solid #ddd; padding: .2rem .5rem; text-align: left; vertical-align: top; }
thead th { background: #f2f2f2; } table.kv th { background: #f7f7f7; font-weight: 600; white-space: nowrap; }
tr.more td { color: #777; font-style: italic; }
code { background: #f2f2f2; padding: 0 .25rem; border-radius: 3px; }
details { margin: .6rem 0; } summary { cursor: pointer; font-weight: 600; }
"""


def metrics_html(metrics: dict) -> str:
    """Every metric of metrics.json (goal rows and verdict aside) as tables, for the collapsed block."""
    scalars, tables = split_metrics(metrics)
    parts = [kv_table(scalars)] if scalars else []
    parts += [f"<h3><code>{esc(key)}</code></h3>{html_table(rows)}" for key, rows in tables]
    return "".join(parts) or "<p><i>No metrics recorded.</i></p>"

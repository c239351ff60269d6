"""Notebook 04's experiments over a schema suite: validity, mask cost and overhead next to a decode step,
field distributions."""
from __future__ import annotations

import json
import time

import torch

from decodelab.constrained.decode import generate, sample_free
from decodelab.constrained.masks import (
    Constraint,
    ConstraintError,
    MaskEngine,
    UnsupportedConstraint,
    allocate_bitmask,
    apply_bitmask,
    replay_mask_times,
)


def default_schemas_file():
    from decodelab.workloads.paths import data_file

    return data_file("schemas.json")


def load_schemas(path=None, names: list[str] | None = None) -> list[dict]:
    """Entries {name, prompt, fixed_keys, schema} from a JSON list; bare schemas get a name and a prompt.

    names: the schemas to keep, in that order; None = every schema of the file (a user's schemas_file is
    used whole unless names are given). Every error names the value and what the file holds, and comes
    before any model work: a missing file, an empty list, an unknown or duplicated name, a malformed schema.
    """
    from pathlib import Path

    from decodelab.workloads.paths import resolve_path

    path = resolve_path(path, name="schemas_file") if path else default_schemas_file()
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"schemas_file={str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"schemas_file={str(path)!r} must hold a non-empty JSON list of schemas")
    entries = []
    for index, item in enumerate(raw):
        if isinstance(item, dict) and "schema" in item:
            entry = dict(item)
        else:
            entry = {"name": (item.get("title") if isinstance(item, dict) else None) or f"schema_{index}",
                     "schema": item}
        try:
            Constraint.json(entry["schema"], name=str(entry["name"]))
        except ConstraintError as error:
            raise ValueError(f"schemas_file={str(path)!r}, entry {index} ({entry['name']!r}): {error}") from None
        entry.setdefault("prompt",
                         "Reply with a JSON object that matches this JSON schema: " + json.dumps(entry["schema"]))
        entry.setdefault("fixed_keys", _has_fixed_keys(entry["schema"]))
        entries.append(entry)
    by_name = {e["name"]: e for e in entries}
    if len(by_name) != len(entries):
        repeated = sorted({e["name"] for e in entries if sum(f["name"] == e["name"] for f in entries) > 1})
        raise ValueError(f"schemas_file={str(path)!r} names several schemas {repeated!r}; names must be unique")
    if names is None:
        return entries
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"schemas={names!r} must be None (every schema of the file) or a non-empty list of "
                         f"schema names from {str(path)!r}: {list(by_name)}")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"schemas={unknown!r} are not in schemas_file={str(path)!r}; its schemas: {list(by_name)}")
    return [by_name[n] for n in names]


def _has_fixed_keys(schema) -> bool:
    """All properties required and no others allowed (recursively for nested objects)."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return True
    props = schema.get("properties", {})
    return (set(schema.get("required", [])) == set(props) and schema.get("additionalProperties") is False
            and all(_has_fixed_keys(p) for p in props.values()))


def schema_items(entries: list[dict], tokenizer, whitespace: str = "compact") -> list[dict]:
    """Entries -> {name, prompt (token ids), constraint, fixed_keys}; a malformed schema raises here."""
    from decodelab.constrained.distortion import chat_prompt

    return [{"name": e["name"], "prompt": chat_prompt(tokenizer, e["prompt"]), "fixed_keys": e["fixed_keys"],
             "constraint": Constraint.json(e["schema"], name=e["name"], whitespace=whitespace)} for e in entries]


def extract_json(text: str):
    """The first JSON value starting at a '{' in free text (models wrap JSON in prose or fences), or None."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            return decoder.raw_decode(text, start)[0]
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return None


def row_seed(seed: int, unit: str, sample: int) -> int:
    """Generator seed of sample `sample` of `unit` (a schema name): the same under every engine and batch
    layout, so masked and unconstrained samples are paired and independent of which rows share a batch."""
    import hashlib

    digest = hashlib.sha256(f"decodelab-constrained-{seed}-{unit}-{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_schema(model, tokenizer, item: dict, engine: MaskEngine | None, *, n_samples: int, sampler,
                  seed: int, max_new_tokens: int = 96, batch_size: int = 64) -> dict:
    """n samples for one schema, masked by `engine` or unconstrained (engine None); see `sample_schemas`."""
    return sample_schemas(model, tokenizer, [item], engine, n_samples=n_samples, sampler=sampler, seed=seed,
                          max_new_tokens=max_new_tokens, batch_size=batch_size)[0]


def sample_schemas(model, tokenizer, items: list[dict], engine: MaskEngine | None, *, n_samples: int, sampler,
                   seed: int, max_new_tokens: int = 96, batch_size: int = 64) -> list[dict]:
    """n samples for each schema, masked by `engine` or unconstrained (engine None), as rows of shared batches.

    -> per item {objects: parsed outputs that validate, valid, truncated, n, unsupported, texts}. An output
    is `truncated` when it ran out of max_new_tokens before it ended (masked: the grammar had not terminated;
    unconstrained: no EOS and no complete JSON object yet) and does not validate: its validity is unknown, so
    it is counted apart from the invalid ones. An engine that cannot compile a schema yields unsupported=True
    and no outputs (never unconstrained text). Row (schema, sample) draws from its own generator
    (`row_seed`), so results do not depend on batch_size or on which schemas share a batch (up to float
    rounding of batched matmuls).
    """
    import jsonschema

    outs = [{"objects": [], "valid": 0, "truncated": 0, "n": 0, "unsupported": False, "texts": []} for _ in items]
    jobs = []  # (item index, sample)
    for index, item in enumerate(items):
        if engine is not None:
            try:
                engine.compile(item["constraint"])
            except UnsupportedConstraint:
                outs[index]["unsupported"] = True
                continue
        jobs += [(index, k) for k in range(n_samples)]
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start: start + batch_size]
        prompts = [items[i]["prompt"] for i, _ in chunk]
        generators = [torch.Generator().manual_seed(row_seed(seed, items[i]["name"], k)) for i, k in chunk]
        if engine is None:
            texts, ended = sample_free(model, tokenizer, prompts, max_new_tokens=max_new_tokens, sampler=sampler,
                                       generator=generators)
        else:
            res = generate(model, prompts, [items[i]["constraint"] for i, _ in chunk], engine,
                           max_new_tokens=max_new_tokens, sampler=sampler, generator=generators, tokenizer=tokenizer)
            texts, ended = res.texts, res.finished
        for (i, _), text, end in zip(chunk, texts, ended):
            value = extract_json(text) if engine is None else _loads(text)
            ok = value is not None
            if ok:
                try:
                    jsonschema.validate(value, items[i]["constraint"].spec)
                except jsonschema.ValidationError:
                    ok = False
            out = outs[i]
            out["n"] += 1
            out["texts"].append(text)
            out["truncated"] += not ok and not end
            if ok:
                out["valid"] += 1
                out["objects"].append(value)
    return outs


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def field_two_sample(schema: dict, masked: list[dict], free: list[dict], *, permutations: int = 500,
                     seed: int = 0) -> list[dict]:
    """Compare masked outputs with unconstrained outputs that happen to be valid, field by field.

    Categorical fields (enum, boolean, integer) -> TV distance between the two empirical distributions and
    a permutation-test p-value of that TV; string fields compare their lengths the same way.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for key, prop in schema.get("properties", {}).items():
        kind = "category" if ("enum" in prop or prop.get("type") in ("boolean", "integer")) else (
            "length" if prop.get("type") == "string" else None)
        if kind is None:
            continue
        value = (lambda o: json.dumps(o.get(key))) if kind == "category" else (lambda o: len(o.get(key, "")))
        a = [value(o) for o in masked if key in o]
        b = [value(o) for o in free if key in o]
        if not a or not b:
            rows.append({"field": key, "kind": kind, "n_masked": len(a), "n_free_valid": len(b),
                         "tv": float("nan"), "p_value": float("nan")})
            continue
        observed = _tv_samples(a, b)
        pooled = a + b
        hits = 0
        for _ in range(permutations):
            perm = rng.permutation(len(pooled))
            permuted = _tv_samples([pooled[i] for i in perm[: len(a)]], [pooled[i] for i in perm[len(a):]])
            hits += permuted >= observed - 1e-12
        rows.append({"field": key, "kind": kind, "n_masked": len(a), "n_free_valid": len(b), "tv": observed,
                     "p_value": (hits + 1) / (permutations + 1)})
    return rows


def _tv_samples(a: list, b: list) -> float:
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in set(ca) | set(cb))


def decode_step_seconds(model, prompt: list[int], batch_size: int, *, steps: int = 8) -> list[float]:
    """Wall seconds of `steps` decode steps at `batch_size` rows of `prompt` (the reference for mask cost)."""
    from decodelab.core.engine import decode_step, prefill, synchronize

    tr = model.transformer if hasattr(model, "transformer") else model
    cache, logits = prefill(tr, [prompt] * batch_size, max_new_tokens=steps + 1)
    tokens = logits.argmax(-1)
    out = []
    for _ in range(steps):
        synchronize(tr.device)
        start = time.perf_counter()
        tokens = decode_step(tr, cache, tokens).argmax(-1)
        synchronize(tr.device)
        out.append(time.perf_counter() - start)
    return out


def validity_study(model, tokenizer, items: list[dict], engines: dict[str, MaskEngine], *, n_samples: int, sampler,
                   seed: int, max_new_tokens: int = 96, batch_size: int = 64) -> dict:
    """Experiment 3: per schema, n samples masked by each engine and n unconstrained samples.

    -> {validity: rows {schema, engine, n, valid, truncated, unsupported}, fields: two-sample rows (first
    engine vs unconstrained-but-valid), samples: {(schema, engine): outputs}, unsupported: {engine: count},
    truncated: {engine: count}}. Sample k of a schema uses the same generator seed under every engine, so
    the comparisons are paired where the paths agree. Rows of all schemas share batches (`sample_schemas`).
    """
    runs = {"unconstrained": sample_schemas(model, tokenizer, items, None, n_samples=n_samples, sampler=sampler,
                                            seed=seed, max_new_tokens=max_new_tokens, batch_size=batch_size)}
    for name, engine in engines.items():
        runs[name] = sample_schemas(model, tokenizer, items, engine, n_samples=n_samples, sampler=sampler, seed=seed,
                                    max_new_tokens=max_new_tokens, batch_size=batch_size)
    validity, fields, samples = [], [], {}
    unsupported = {name: sum(out["unsupported"] for out in runs[name]) for name in engines}
    truncated = {name: sum(out["truncated"] for out in outs) for name, outs in runs.items()}
    for index, item in enumerate(items):
        for name, outs in runs.items():
            out = outs[index]
            validity.append({"schema": item["name"], "engine": name, "n": out["n"], "valid": out["valid"],
                             "truncated": out["truncated"], "unsupported": out["unsupported"]})
            samples[(item["name"], name)] = out
        reference = next((n for n in engines if not runs[n][index]["unsupported"]), None)
        if reference is not None:
            for row in field_two_sample(item["constraint"].spec, runs[reference][index]["objects"],
                                        runs["unconstrained"][index]["objects"], seed=seed):
                fields.append({"schema": item["name"], "engine": reference, **row})
    return {"validity": validity, "fields": fields, "samples": samples, "unsupported": unsupported,
            "truncated": truncated}


def validity_summary(rows: list[dict]) -> list[dict]:
    """Per engine ('unconstrained' for no mask), over the schemas it supports: one rule for every engine.

    -> rows {engine, n, finished, valid, truncated, validity_rate, truncated_rate} (a rate over no outputs is
    None: not measured). An output cut off by
    max_new_tokens before it ended (masked: the grammar had not terminated; unconstrained: no EOS and no
    complete JSON object yet) is neither valid nor invalid: the budget stopped it, not the sampler. So it
    leaves the denominator of validity_rate = valid / finished, for masked and unconstrained sampling
    alike, and is reported as truncated_rate = truncated / n. Counting cut-offs as invalid on one side only
    would charge that side for the budget; counting them as invalid on both would make masked validity a
    measure of the budget instead of the mask (whose invariant is: every output it finishes is valid).
    """
    totals: dict[str, dict] = {}
    for r in rows:
        if r["unsupported"]:
            continue
        t = totals.setdefault(r["engine"], {"engine": r["engine"], "n": 0, "valid": 0, "truncated": 0})
        t["n"] += r["n"]
        t["valid"] += r["valid"]
        t["truncated"] += r.get("truncated", 0)
    out = []
    for t in totals.values():
        finished = t["n"] - t["truncated"]
        out.append({**t, "finished": finished, "validity_rate": t["valid"] / finished if finished else None,
                    "truncated_rate": t["truncated"] / t["n"] if t["n"] else None})
    return out


def validity_rates(rows: list[dict]) -> dict[str, float]:
    """{engine: valid / finished outputs, None if none finished} over the schemas it supports (the rule:
    `validity_summary`)."""
    return {r["engine"]: r["validity_rate"] for r in validity_summary(rows)}


def mask_cost_study(engines: dict[str, MaskEngine], items: list[dict], outputs: dict[str, str], tokenizer, *,
                    naive_steps: int = 3) -> list[dict]:
    """Experiment 4: replay each schema's recorded output through every engine, timing each mask fill.

    outputs: schema name -> one valid output text. Two trajectories per schema: that output tokenized
    (compact) and the same object re-serialized with indent=2 (whitespace-heavy; the constraint is
    recompiled with flexible whitespace), each ending in EOS. -> rows {engine, schema, trajectory, step, us}.
    """
    rows = []
    eos = next(iter(engines.values())).stop_token_ids[0]
    for item in items:
        text = outputs.get(item["name"])
        value = _loads(text) if text else None
        if value is None:
            continue
        tokens = tokenizer(text, add_special_tokens=False).input_ids + [eos]
        indented = tokenizer(json.dumps(value, indent=2), add_special_tokens=False).input_ids + [eos]
        flexible = Constraint.json(item["constraint"].spec, name=item["name"], whitespace="flexible")
        for trajectory, constraint, seq in (("compact", item["constraint"], tokens), ("indented", flexible, indented)):
            for name, engine in engines.items():
                try:
                    compiled = engine.compile(constraint)
                except UnsupportedConstraint:
                    continue
                times = replay_mask_times(engine, compiled, seq, max_steps=naive_steps if name == "naive" else None)
                rows += [{"engine": name, "schema": item["name"], "trajectory": trajectory, "step": i, "us": t * 1e6}
                         for i, t in enumerate(times)]
    return rows


def mask_apply_seconds(vocab_size: int, batch_size: int, *, device="cpu", repeats: int = 20) -> float:
    """Fastest of `repeats` wall-second timings of applying a (B, W) bitmask to (B, V) float32 logits.

    The minimum, like the decode step it is added to in `mask_overhead_summary`: both are costs, and the
    fastest repeat is the one least disturbed by whatever else the machine runs.
    """
    from decodelab.core.engine import synchronize

    device = torch.device(device)
    logits = torch.randn(batch_size, vocab_size, device=device)
    bitmask = allocate_bitmask(batch_size, vocab_size)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        apply_bitmask(logits, bitmask)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def mask_overhead_summary(cost_rows: list[dict], step_seconds: dict[int, list[float]],
                          apply_seconds: dict[int, float]) -> list[dict]:
    """Mask fill time per token and its overhead on a decode step, per (engine, trajectory).

    cost_rows: `mask_cost_study` rows {engine, trajectory, us}; step_seconds: batch size B -> timed decode
    steps at B rows (`decode_step_seconds`); apply_seconds: B -> seconds to apply a (B, V) bitmask.
    -> rows {engine, trajectory, fills, p50_us, p99_us, mean_us, and for each B: overhead_b{B}_mean,
    overhead_b{B}_p50, overhead_b{B}_p99, step_b{B}_ms}, with

        overhead_b{B}_{stat} = (B * fill_{stat} + apply(B)) / step(B)

    B rows' masks are filled one after another on the CPU, one bitmask application covers the batch, and
    step(B) is the fastest timed decode step (the least disturbed measure of the model's cost, so the
    ratio errs high). Judge a goal on the mean: it is what a generation pays per token on average, while
    p50 hides the slow fills (a grammar state's first visit, free-text fields) that make up much of the total.
    """
    import numpy as np

    steps = {b: min(times) for b, times in step_seconds.items()}
    groups: dict[tuple[str, str], list[float]] = {}
    for r in cost_rows:
        groups.setdefault((r["engine"], r["trajectory"]), []).append(float(r["us"]))
    out = []
    for (engine, trajectory), us in groups.items():
        stats = {"mean": float(np.mean(us)), "p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99))}
        row = {"engine": engine, "trajectory": trajectory, "fills": len(us),
               **{f"{k}_us": v for k, v in stats.items()}}
        for b, step in steps.items():
            for k, v in stats.items():
                row[f"overhead_b{b}_{k}"] = (b * v * 1e-6 + apply_seconds[b]) / step
            row[f"step_b{b}_ms"] = step * 1e3
        out.append(row)
    return out


def naive_slowdown(cost_rows: list[dict], reference: str = "xgrammar", naive: str = "naive") -> float | None:
    """Mean naive fill time / mean `reference` fill time over the grammar states both engines timed.

    The naive engine times only the first `naive_steps` fills of each trajectory, so the reference is
    averaged over the same (schema, trajectory, step) states, never over all of its own fills.
    -> None when the two engines share no timed state (e.g. one of them was not run).
    """
    times: dict[str, dict[tuple, float]] = {naive: {}, reference: {}}
    for r in cost_rows:
        if r["engine"] in times:
            times[r["engine"]][(r["schema"], r["trajectory"], r["step"])] = float(r["us"])
    shared = sorted(set(times[naive]) & set(times[reference]))
    if not shared:
        return None
    ref = sum(times[reference][k] for k in shared)
    return sum(times[naive][k] for k in shared) / ref if ref > 0 else None


def overhead_of(summary_rows: list[dict], engine: str, batch_size: int, stat: str = "mean",
                trajectory: str = "compact") -> float | None:
    """One engine's mask overhead at `batch_size` from `mask_overhead_summary` rows (None: not measured)."""
    for row in summary_rows:
        if row["engine"] == engine and row["trajectory"] == trajectory:
            return row.get(f"overhead_b{batch_size}_{stat}")
    return None


def overhead_goal(summary_rows: list[dict], engine: str, batch_size: int, *, target: float,
                  trajectory: str = "compact"):
    """The goal "mask overhead <= target of a decode step", judged on the mean fill; p50 and p99 in the note."""
    from decodelab.common.goals import Goal, format_value

    spread = {s: overhead_of(summary_rows, engine, batch_size, s, trajectory) for s in ("p50", "p99")}
    note = ", ".join(f"{s} fill: {format_value(v, '%')}" for s, v in spread.items() if v is not None)
    label = f"{engine} mask overhead per decode step at batch {batch_size} (mean fill, {trajectory} JSON)"
    value = overhead_of(summary_rows, engine, batch_size, "mean", trajectory)
    return Goal.check(f"mask_overhead_{engine}_b{batch_size}", value, "<=", target, unit="%", note=note, label=label)

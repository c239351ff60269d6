"""Notebook 04's experiment 3 over a schema suite: masked and unconstrained samples, their validity under
one rule, and masked against unconstrained-but-valid samples field by field.

The suite is read by `workloads.constrained.load_schemas`; mask cost is `constrained.mask_cost`, jump-forward
`constrained.jump_forward_study`.
"""
from __future__ import annotations

import json

import torch

from decodelab.common.goals import Goal
from decodelab.common.seeding import row_seed
from decodelab.constrained.constraint import Constraint, UnsupportedConstraint
from decodelab.constrained.decode import generate, sample_free
from decodelab.constrained.engines import MaskEngine
from decodelab.workloads.prompts import user_prompt_ids

SEED_STREAM = "constrained"  # the row-seed stream of this notebook's samples (`common.seeding.row_seed`)


def schema_items(entries: list[dict], tokenizer, whitespace: str = "compact") -> list[dict]:
    """Entries -> {name, prompt (token ids), constraint, fixed_keys}; a malformed schema raises here."""
    return [{"name": e["name"], "prompt": user_prompt_ids(tokenizer, e["prompt"]), "fixed_keys": e["fixed_keys"],
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
    (`common.seeding.row_seed`, stream "constrained"), so results do not depend on batch_size or on which
    schemas share a batch (up to float rounding of batched matmuls).
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
        generators = [torch.Generator().manual_seed(row_seed(seed, items[i]["name"], k, stream=SEED_STREAM))
                      for i, k in chunk]
        if engine is None:
            texts, ended = sample_free(model, tokenizer, prompts, max_new_tokens=max_new_tokens, sampler=sampler,
                                       generator=generators)
        else:
            res = generate(model, prompts, [items[i]["constraint"] for i, _ in chunk], engine,
                           max_new_tokens=max_new_tokens, sampler=sampler, generator=generators, tokenizer=tokenizer)
            texts, ended = res.texts, res.finished
        for (i, _), text, end in zip(chunk, texts, ended):
            value = extract_json(text) if engine is None else parse_json(text)
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


def parse_json(text: str):
    """json.loads(text), or None when it is not JSON (a masked output cut off mid-object)."""
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
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in dict.fromkeys([*ca, *cb]))  # fixed order


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


def validity_metrics(study: dict, summary_rows: list[dict]) -> dict:
    """The run's validity metrics: {validity_rate, truncated, unsupported, truncated_rate, finished}, each keyed by
    engine, from a `validity_study` result and its `validity_summary` rows."""
    return {"validity_rate": {r["engine"]: r["validity_rate"] for r in summary_rows},
            "truncated": study["truncated"], "unsupported": study["unsupported"],
            "truncated_rate": {r["engine"]: r["truncated_rate"] for r in summary_rows},
            "finished": {r["engine"]: r["finished"] for r in summary_rows}}


def validity_goals(summary_rows: list[dict], engines) -> list:
    """One goal per engine: every finished masked output validates (the mask's invariant)."""
    rates = {r["engine"]: r["validity_rate"] for r in summary_rows}
    return [Goal.check(f"masked_validity_{e}", rates.get(e), "==", 1.0, unit="%",
                       label=f"{e}: share of finished masked outputs that validate") for e in engines]

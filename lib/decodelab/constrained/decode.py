"""Constrained decoding on the decode engine: per-step masks, batched rows, jump-forward, validation.

The loop (per step, B rows):  logits (B, V) -> fill each row's mask (engine) -> disallowed at -inf ->
sampler picks (B,) -> matchers accept -> [jump-forward appends forced tokens] -> one forward of every
row's pending tokens (ragged, `n_new` per row) -> logits of each row's last token.

Jump-forward modes:
- "off": one token per forward pass.
- "tokens": while the mask allows exactly one token, append it without asking the model. Greedy output
  is token-for-token the same as "off" (a one-token mask leaves argmax no choice); those tokens then ride
  in the next forward together, so the forward passes for them are saved.
- "retokenize": SGLang-style. Append the whole string the grammar forces (`forced_string`), re-tokenizing
  the last sampled token + that string canonically, since the boundary token may merge with it. Saves more
  passes but picks the tokenization itself, so outputs can differ from "off" (the notebook measures how often).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from decodelab.constrained.jump_forward import forced_tokens, retokenize_forward
from decodelab.constrained.masks import (
    BatchMasker,
    Constraint,
    ConstraintError,
    MaskEngine,
    UnsupportedConstraint,
    allocate_bitmask,
    apply_bitmask,
    make_engine,
    replay_mask_times,
)

JUMP_FORWARD = ("off", "tokens", "retokenize")
__all__ = ["Constraint", "ConstraintError", "UnsupportedConstraint", "make_engine", "generate", "validate_output",
           "ConstrainedResult", "JUMP_FORWARD", "load_schemas", "sample_schemas", "sample_free", "validity_study",
           "validity_summary", "validity_rates", "mask_cost_study", "mask_overhead_summary", "naive_slowdown"]


@dataclass
class ConstrainedResult:
    tokens: list[list[int]]          # new tokens per row, EOS included when the grammar ended
    texts: list[str]                 # decoded outputs (EOS dropped)
    finished: list[bool]             # whether each row's grammar terminated (False: ran out of max_new_tokens)
    valid: list[bool]                # parses and validates (jsonschema / regex full match)
    forward_passes: int              # model calls after the prefill
    jumped_tokens: int               # tokens appended by jump-forward without a model call of their own
    mask_s: list[float] = field(default_factory=list)   # wall seconds filling all rows' masks, per step
    step_s: list[float] = field(default_factory=list)   # wall seconds of the model forward, per step
    prefill_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def validate_output(constraint: Constraint, text: str) -> bool:
    """Does `text` satisfy the constraint? JSON: parses and validates (jsonschema); regex: full match."""
    if constraint.kind == "json":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), constraint.spec)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    import regex

    return regex.fullmatch(constraint.pattern, text) is not None


def compile_all(engine: MaskEngine, constraints: list[Constraint]) -> list:
    """Compile each distinct constraint once (errors raise here, before any generation)."""
    cache: dict[int, object] = {}
    out = []
    for c in constraints:
        key = id(c)
        if key not in cache:
            cache[key] = engine.compile(c)
        out.append(cache[key])
    return out


@torch.inference_mode()
def generate(model, prompts: list[list[int]], constraint: Constraint | list[Constraint], engine: MaskEngine, *,
             max_new_tokens: int = 128, sampler=None, generator=None, jump_forward: str = "off",
             tokenizer=None) -> ConstrainedResult:
    """Constrained batched decoding. constraint: one for all rows or one per row.

    sampler: decodelab.core.sampling.Sampler (None = greedy); generator: torch.Generator (or a list, one per row:
    then each row's draws do not depend on the other rows). Rows leave the batch once they finish.
    tokenizer: needed to decode texts and for jump_forward="retokenize" (default: engine.tokenizer).
    Raises ConstraintError / UnsupportedConstraint before generation if a constraint does not compile.
    """
    from decodelab.core.engine import as_transformer, pick_tokens, prefill, synchronize

    if jump_forward not in JUMP_FORWARD:
        raise ValueError(f"jump_forward={jump_forward!r} must be one of {list(JUMP_FORWARD)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    constraints = constraint if isinstance(constraint, list) else [constraint] * len(prompts)
    if len(constraints) != len(prompts):
        raise ValueError(f"got {len(constraints)} constraints for {len(prompts)} prompts; give one or one per row")
    tokenizer = tokenizer or engine.tokenizer
    masker = BatchMasker(engine, compile_all(engine, constraints))
    tr = as_transformer(model)
    batch = len(prompts)

    synchronize(tr.device)
    start = time.perf_counter()
    # slack for jump-forward: a row may append up to max_new_tokens in one forward
    extra = max_new_tokens + 1 if jump_forward != "off" else 0
    cache, logits = prefill(tr, prompts, max_new_tokens=max_new_tokens, extra=extra)
    synchronize(tr.device)
    result = ConstrainedResult([[] for _ in prompts], [], [False] * batch, [], 0, 0,
                               prefill_s=time.perf_counter() - start)
    done = [False] * batch
    rows = list(range(batch))  # original row of each cache / logits row (finished rows are dropped)
    while True:
        alive = [r for r in rows if not done[r]]
        start = time.perf_counter()
        bitmask = masker.fill(alive)
        if len(rows) < batch:
            bitmask = bitmask[torch.tensor(rows)]
        masked = apply_bitmask(logits.float(), bitmask.to(logits.device))
        result.mask_s.append(time.perf_counter() - start)
        picked = dict(zip(rows, pick_tokens(masked, sampler, _rows_of(generator, rows, batch)).tolist()))
        pending: dict[int, list[int]] = {r: [] for r in rows}
        for r in alive:
            matcher = masker.matchers[r]
            if not matcher.accept(picked[r]):
                raise RuntimeError(f"engine {engine.name!r} rejected token {picked[r]} it allowed (row {r})")
            pending[r].append(picked[r])
            budget = max_new_tokens - len(result.tokens[r]) - 1
            if jump_forward == "tokens":
                pending[r] += forced_tokens(matcher, engine.vocab_size, budget)
            elif jump_forward == "retokenize" and not matcher.is_terminated():
                pending[r] = retokenize_forward(matcher, pending[r], tokenizer, budget)
            result.jumped_tokens += len(pending[r]) - 1
            result.tokens[r] += pending[r]
            if matcher.is_terminated():
                done[r], result.finished[r] = True, True
            elif len(result.tokens[r]) >= max_new_tokens:
                done[r] = True
        if all(done):
            break
        cache, rows = _drop_finished(cache, rows, done)
        width = max(len(pending[r]) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(pending[r])] = torch.tensor(pending[r], dtype=torch.long)
        n_new = torch.tensor([len(pending[r]) for r in rows], dtype=torch.long)
        start = time.perf_counter()
        logits = _forward_last(tr, cache, tokens.to(tr.device), n_new.to(tr.device))
        synchronize(tr.device)
        result.step_s.append(time.perf_counter() - start)
        result.forward_passes += 1
    stops = set(engine.stop_token_ids)
    result.texts = [tokenizer.decode([t for t in row if t not in stops]) if tokenizer is not None else ""
                    for row in result.tokens]
    result.valid = [f and validate_output(c, text) for f, c, text in zip(result.finished, constraints, result.texts)]
    return result


def _rows_of(generator, rows: list[int], batch: int):
    """The generators of the batch's current rows: a per-row list follows its rows; a shared one is shared."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise ValueError(f"generator: got a list of {len(generator)} generators, need one per row ({batch})")
        return [generator[r] for r in rows]
    return generator


def _drop_finished(cache, rows: list[int], done: list[bool]):
    """Drop finished rows from the batch once they are a quarter of it (-> cache, rows).

    Finished rows would otherwise ride along in every forward until the slowest row ends (on CPU a forward
    costs about linearly in the rows once the batch is a few dozen). `select` copies the kept rows' cache,
    so it runs only when a quarter has finished: O(log B) copies per generation.
    """
    keep = [i for i, r in enumerate(rows) if not done[r]]
    if len(rows) - len(keep) < max(1, len(rows) // 4):
        return cache, rows
    return cache.select(keep), [rows[i] for i in keep]


def _forward_last(tr, cache, tokens: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """Append each row's n_new tokens (right-padded) -> logits after each row's last new token (B, V).

    Finished rows pass n_new = 0: nothing is appended for them and their logits are ignored.
    """
    if tokens.shape[1] == 1 and bool((n_new == 1).all()):
        return tr.forward(tokens, cache, logits_at="all")[:, 0]
    safe = torch.clamp(n_new, min=1)
    logits = tr.forward(tokens, cache, n_new=safe, logits_at="last")
    cache.crop(cache.lengths - (safe - n_new))
    return logits


# ---------------------------------------------------------------- schema suite (experiments 3-5)

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


@torch.inference_mode()
def sample_free(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, sampler, generator,
                eos_token_ids: list[int] | None = None) -> tuple[list[str], list[bool]]:
    """Unconstrained sampling that ends a row at EOS or once its reply holds a complete JSON object.

    -> (texts without special tokens, ended). A row ends early when the object opened at the reply's first
    '{' is closed: `extract_json` reads that object first, so later tokens could not change what is
    validated, and sampling them (models add prose after the JSON) would only cost forward passes.
    generator: one torch.Generator or one per row. Finished rows leave the batch (see `_drop_finished`).
    """
    from decodelab.core.engine import as_transformer, pick_tokens, prefill

    tr = as_transformer(model)
    eos = set(eos_token_ids or getattr(model, "eos_token_ids", None) or [tokenizer.eos_token_id])
    batch = len(prompts)
    cache, logits = prefill(tr, prompts, max_new_tokens=max_new_tokens)
    tokens: list[list[int]] = [[] for _ in prompts]
    ended, done = [False] * batch, [False] * batch
    rows = list(range(batch))
    while True:
        picked = pick_tokens(logits, sampler, _rows_of(generator, rows, batch)).tolist()
        for r, token in zip(rows, picked):
            if done[r]:
                continue
            tokens[r].append(token)
            if token in eos or _first_object_closed(tokenizer.decode(tokens[r], skip_special_tokens=True)):
                done[r] = ended[r] = True
            elif len(tokens[r]) >= max_new_tokens:
                done[r] = True
        if all(done):
            break
        cache, rows = _drop_finished(cache, rows, done)
        step = torch.tensor([tokens[r][-1] if not done[r] else 0 for r in rows], dtype=torch.long, device=tr.device)
        logits = tr.forward(step[:, None], cache, logits_at="all")[:, 0]
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens], ended


def _first_object_closed(text: str) -> bool:
    """Does the JSON value starting at the first '{' of text end within it?"""
    start = text.find("{")
    if start == -1 or "}" not in text[start:]:
        return False
    try:
        json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return False
    return True


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

"""The compiled static-shape decode step against the eager step: same prompts, tokens, one outer clock.

`engine.generate(compile=True)` decodes one-token steps through `core.static_step` compiled by torch.compile;
compile=False is the eager engine. Both sides: greedy, EOS off (every row decodes max_new_tokens), the same
prompt batch. The first compiled call pays the compilation: it is timed on its own (`compile_s`) and kept out
of the step comparison; then the two sides alternate `repeats` rounds and the fastest call of each counts.
On a GPU the same step is the path for CUDA graphs (mode="reduce-overhead"); this module measures CPU only.
"""
from __future__ import annotations

from decodelab.common.timing import alternating_times, timed
from decodelab.core import engine


def check_compile_args(batch_sizes, max_new_tokens: int, repeats: int) -> None:
    bad = [b for b in batch_sizes if not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"compile_batch_sizes contains {bad[0]!r}; every batch size must be an integer >= 1")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")


def compiled_vs_eager(model, prompts: list[list[int]], batch_sizes, *, max_new_tokens: int, repeats: int) -> dict:
    """-> {"rows": [{batch, eager_s, compiled_s, speedup, compile_s, identical_rows, rows, new_tokens}],
    "status": the static step's status (compiled or why not), for env.json}.

    prompts: the pool each batch cycles through. speedup = eager_s / compiled_s (fastest calls; > 1: compiled
    is faster). identical_rows: rows whose tokens are equal on both sides in every call.
    """
    from decodelab.quickstart.bench import identical_rows, prompt_batch

    check_compile_args(batch_sizes, max_new_tokens, repeats)
    rows, status = [], None
    for batch in batch_sizes:
        batch_prompts = prompt_batch(prompts, batch)
        outputs = {"eager": [], "compiled": []}

        def run(compile: bool, name: str):
            result = engine.generate(model, batch_prompts, max_new_tokens=max_new_tokens, eos_token_ids=[],
                                     compile=compile)
            outputs[name].append(result.tokens)
            return result

        first, compile_s = timed(lambda: run(True, "compiled"), model.device)
        status = first.compile
        run(False, "eager")  # warm-up of the eager side, so neither side's first call is timed below
        times = alternating_times({"eager": lambda: run(False, "eager"), "compiled": lambda: run(True, "compiled")},
                                  repeats, model.device, warmup=False)
        same = min(identical_rows(e, c) for e in outputs["eager"] for c in outputs["compiled"])
        eager_s, compiled_s = min(times["eager"]), min(times["compiled"])
        rows.append(dict(batch=batch, eager_s=eager_s, compiled_s=compiled_s, speedup=eager_s / compiled_s,
                         compile_s=compile_s, identical_rows=same, rows=batch,
                         new_tokens=sum(map(len, outputs["compiled"][0]))))
    return {"rows": rows, "status": status}

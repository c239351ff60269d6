"""Notebook 06: reasoning-trace reuse. Can answered problems make the next similar one cheaper?

- `retrieval`  the trace cache of a query stream: n-gram and embedding similarity, thresholds
- `align`      word alignment of two questions, substitution of a trace, splitting a trace into steps
- `drafting`   `TraceDrafter`: the n-gram drafter copying from retrieved traces as well as the prompt (lossless)
- `step_reuse` SpecReason-style step reuse as a policy of the engine's token loop (lossy, threshold-gated)
- `shared`     shared-prefix KV reuse: suffix prefill onto the prefix, plain's output checked in one forward
- `methods`    every method run over the stream, one row per query
- `summary`    per-method tables, paired accuracy, the amortization curve, goal rows and generated findings
"""

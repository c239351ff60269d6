"""Self-distillation data for a retrofit MTP module: the frozen model's own text and its own next-token beliefs.

The module is trained to predict what the *target* would say one token later, so its teacher is the
target itself (FastMTP's self-distillation). Three kinds of sequence, all from shipped text:

- code editing: a function (or, with `code_pool="functions+methods"`, a class's method) from the stdlib's
  *training* split (`decodelab.mtp.data` splits by file), a
  "rename it and output the updated code" request, and the expected edited code as the answer (teacher-forced:
  one trunk prefill per block, no generation); the first `code_gen_prompts` requests are instead answered by
  the model's own greedy continuation, which is the text the module drafts on when the model edits code;
- extraction: "copy the first sentences of this docstring exactly", with the copied sentences as the answer;
- chat: writing prompts (data/writing_prompts.jsonl) with the model's own greedy continuation, generated in
  batches through the engine's token loop (`decodelab.core.engine.generate`).

The frozen trunk runs once over every block: its final-normed hidden states (N, T, D) and the top-k of its
next-token distribution at each position (ids (N, T, K), log-probs (N, T, K)) are cached together with the
tokens, keyed by a content hash of (model, data config, corpus hash, tokenizer), so training only runs the
module and the frozen LM head (a fused module's extra inputs, the residual streams after a few trunk layers,
are cached beside the set per layer choice: `with_features`). The teacher of the module at position i (it
predicts t_{i+2}) is the target's distribution at position i + 1.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import itertools
import json
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

TASK_KINDS = ("code_edit", "code_edit_own", "extraction", "chat")  # code_edit_own: the model's own greedy answer
FROZEN_DTYPES = ("float32", "bfloat16")  # "float32": the model as loaded; "bfloat16": a bf16 copy of it
CODE_POOLS = ("functions", "functions+methods")  # which definitions the code-edit requests rename
# DistillData fields added after sets were cached and shipped, with the value every set had before them
ADDED_FIELDS = {"trunk_dtype": "float32", "answer_dtype": "float32", "code_pool": "functions"}


@dataclass(frozen=True)
class DistillData:
    """What the distillation set is made of (part of the checkpoint's content hash)."""

    seq_len: int = 512  # tokens per training block (a code edit's request + answer fits whole)
    n_blocks: int = 3584  # blocks the frozen trunk runs over at most (the cost: one trunk forward per token)
    chat_prompts: int = 32  # writing prompts answered by the model itself (greedy, through the engine)
    chat_new_tokens: int = 48  # tokens generated per chat prompt
    code_gen_prompts: int = 2048  # code-edit requests answered by the model itself (greedy) instead of the reference
    code_gen_tokens: int = 96  # tokens generated per such request
    gen_batch_size: int = 32  # rows per engine.generate call (float32: 0.63 s an answer on 2 cores, 0.85 s at 8)
    top_k: int = 16  # teacher log-probs kept per position (the KL is over these, renormalized)
    min_code_lines: int = 4  # functions shorter than this teach little copying
    max_code_chars: int = 700  # and longer ones do not fit a block twice (prompt + answer)
    # dtype of the frozen model's pass over the blocks (its states and teacher top-k). "bfloat16" takes 0.26 s a
    # block instead of 0.64 on 2 cores; its teacher top-1 matches float32's at 98.0% of positions, and a module
    # trained 1536 steps on either set drafts alike (24 code-edit prompts, k = 1: 47.3% vs 46.9%)
    trunk_dtype: str = "bfloat16"
    # dtype the model writes its own answers in: "bfloat16" takes 0.33 s an answer instead of 0.63 (batch 32, 2
    # cores); the text is still the model's (the teacher is the trunk pass above either way), though 41 of 64
    # greedy code-edit answers part from float32's somewhere
    answer_dtype: str = "bfloat16"
    # "functions+methods" also renames the methods of top-level classes: 7041 requests instead of 1626
    code_pool: str = "functions+methods"

    def __post_init__(self):
        for name in ("seq_len", "n_blocks", "gen_batch_size", "top_k", "min_code_lines", "max_code_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        for name in ("chat_prompts", "chat_new_tokens", "code_gen_prompts", "code_gen_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        for name in ("trunk_dtype", "answer_dtype"):
            if getattr(self, name) not in FROZEN_DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {FROZEN_DTYPES}")
        if self.code_pool not in CODE_POOLS:
            raise ValueError(f"code_pool={self.code_pool!r} must be one of {CODE_POOLS}")

    def as_dict(self) -> dict:
        out = asdict(self)
        for name, before in ADDED_FIELDS.items():  # a set hashed before the field keeps its hash
            if out[name] == before:
                del out[name]
        return out


def functions_of(source: str, *, min_lines: int, max_chars: int, methods: bool = False) -> list[tuple[str, str]]:
    """(name, source) of the top-level functions of a module's source that fit the size limits, in source order;
    with methods, also the methods of its top-level classes (dedented, as a request would quote one alone)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    nodes = []  # (definition, whether it is a method)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            nodes.append((node, False))
        elif methods and isinstance(node, ast.ClassDef):
            nodes += [(m, True) for m in node.body if isinstance(m, ast.FunctionDef)]
    out = []
    for node, is_method in nodes:
        code = "\n".join(lines[node.lineno - 1:node.end_lineno])
        code = textwrap.dedent(code) if is_method else code  # dedent also blanks whitespace-only lines
        if node.end_lineno - node.lineno + 1 >= min_lines and len(code) <= max_chars:
            out.append((node.name, code))
    return out


def code_edit_pair(name: str, code: str) -> tuple[str, str]:
    """(request, expected answer) for one function: the workload's rename edit (data/spec_workloads.jsonl)."""
    new = f"{name}_v2"
    request = (f"Rename the function `{name}` to `{new}` and output the complete updated code.\n\n"
               f"```python\n{code}\n```")
    return request, f"```python\n{code.replace(f'def {name}(', f'def {new}(', 1)}\n```"


def extraction_pair(docstring: str) -> tuple[str, str] | None:
    """(request, answer) copying a docstring's first two sentences, or None for a docstring too short."""
    sentences = [s.strip() for s in docstring.replace("\n", " ").split(". ") if s.strip()]
    if len(sentences) < 3:
        return None
    passage = docstring.strip()
    request = f"Extract the first two sentences of the following passage exactly as written.\n\nPassage:\n{passage}"
    return request, ". ".join(sentences[:2]) + "."


def evaluation_files(path=None) -> set[str]:
    """Stdlib files (relative paths) the drafting workloads (data/spec_workloads.jsonl) take prompts from: the
    file split puts most of them in the training split, so the distillation set must skip them by name."""
    from decodelab.workloads.spec import load_workloads

    return {row["source"].split(":")[0].split(" ")[0] for row in load_workloads(path)
            if row["source"] != "hand-written"}


def training_texts(corpus) -> list[str]:
    """The training split's file contents in hash order, without the evaluation workloads' files."""
    from decodelab.mtp.data import shuffle_key

    skip = evaluation_files()
    names = sorted((rel for rel in corpus.train_files if rel not in skip), key=shuffle_key)
    return [(corpus.root / rel).read_text(encoding="utf-8", errors="replace") for rel in names]


def task_pairs(corpus, data: DistillData) -> list[tuple[str, str, str]]:
    """(kind, request, answer) from the corpus's training split (less the evaluation workloads' files), code
    edits and extractions interleaved."""
    code, extract = [], []
    for text in training_texts(corpus):
        for name, fn in functions_of(text, min_lines=data.min_code_lines, max_chars=data.max_code_chars,
                                     methods=data.code_pool == "functions+methods"):
            code.append(("code_edit", *code_edit_pair(name, fn)))
        try:
            doc = ast.get_docstring(ast.parse(text))
        except SyntaxError:
            doc = None
        pair = extraction_pair(doc) if doc and len(doc) < 2000 else None
        if pair:
            extract.append(("extraction", *pair))
    out = []
    for i, item in enumerate(code):  # one extraction after every three code edits while they last
        out.append(item)
        if i % 3 == 2 and extract:
            out.append(extract.pop(0))
    return out


def answered_ids(tokenizer, request: str, answer: str) -> list[int]:
    """Chat prompt + answer + end of turn, as the model's own chat template writes it."""
    from decodelab.workloads.prompts import user_prompt_ids

    end = tokenizer.eos_token_id
    return user_prompt_ids(tokenizer, request) + tokenizer(answer, add_special_tokens=False).input_ids + [end]


def greedy_sequences(loaded, prompts: list[list[int]], new_tokens: int, batch_size: int, *,
                     progress: bool = False) -> list[list[int]]:
    """prompt + the model's own greedy continuation (up to new_tokens, ending at its EOS), through the engine."""
    from decodelab.core import engine

    if not prompts or not new_tokens:
        return []
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        result = engine.generate(loaded.transformer, batch, max_new_tokens=new_tokens, progress=progress)
        out += [p + list(t) for p, t in zip(batch, result.tokens)]
    return out


def chat_sequences(loaded, data: DistillData, *, progress: bool = False) -> list[list[int]]:
    """The model's own greedy answers to `chat_prompts` writing prompts: prompt + continuation ids."""
    from decodelab.workloads.tasks import load_writing_prompts, writing_prompt

    if not data.chat_prompts or not data.chat_new_tokens:
        return []
    prompts = [writing_prompt(p, loaded.tokenizer) for p in load_writing_prompts(n=data.chat_prompts)]
    return greedy_sequences(loaded, prompts, data.chat_new_tokens, data.gen_batch_size, progress=progress)


def split_own_code(pairs: list[tuple[str, str, str]], n: int):
    """The first n code-edit requests (answered by the model itself) and the remaining pairs (teacher-forced)."""
    own = [p for p in pairs if p[0] == "code_edit"][:n]
    taken = {id(p) for p in own}
    return own, [p for p in pairs if id(p) not in taken]


def own_code_sequences(loaded, own: list[tuple[str, str, str]], data: DistillData, *,
                       progress: bool = False) -> list[list[int]]:
    """The model's own greedy answers to code-edit requests: prompt + continuation ids."""
    from decodelab.workloads.prompts import user_prompt_ids

    prompts = [user_prompt_ids(loaded.tokenizer, request) for _, request, _ in own]
    return greedy_sequences(loaded, prompts, data.code_gen_tokens, data.gen_batch_size, progress=progress)


def pack(sequences: list[list[int]], seq_len: int, n_blocks: int, pad_id: int) -> torch.Tensor:
    """Whole sequences packed greedily into (n, seq_len) blocks (a sequence never straddles two blocks, so
    an answer always sees the text it copies; over-long ones are cut), pad_id filling each block's end."""
    return pack_counted(sequences, seq_len, n_blocks, pad_id)[0]


def pack_counted(sequences: list[list[int]], seq_len: int, n_blocks: int, pad_id: int) -> tuple[torch.Tensor, int]:
    """`pack`, and how many of the leading sequences the blocks hold."""
    blocks, current, used = [], [], 0
    for seq in sequences:
        seq = seq[:seq_len]
        if len(current) + len(seq) > seq_len:
            blocks.append(current + [pad_id] * (seq_len - len(current)))
            current = []
            if len(blocks) == n_blocks:
                break
        current = current + seq
        used += 1
    if current and len(blocks) < n_blocks:
        blocks.append(current + [pad_id] * (seq_len - len(current)))
    return torch.tensor(blocks, dtype=torch.long), used


def mixed_sequences(tokenizer, pairs: list[tuple[str, str, str]], chats: list[list[int]],
                    own_code: list[list[int]] = ()):
    """Task answers with a chat answer after every fourth task, as long as chats last, and the model's own
    code-edit answers before every task while they last: one each, or ceil(own / tasks) each when there are
    more own answers than tasks (the text it drafts on comes first, so packing keeps it). -> (token lists, kinds)."""
    sequences, kinds = [], []
    own_per_task = max(1, -(-len(own_code) // len(pairs))) if pairs else 0
    chat_iter, own_iter = iter(chats), iter(own_code)
    for i, (kind, request, answer) in enumerate(pairs):
        for own in itertools.islice(own_iter, own_per_task):
            sequences.append(own)
            kinds.append("code_edit_own")
        sequences.append(answered_ids(tokenizer, request, answer))
        kinds.append(kind)
        if i % 4 == 3:
            chat = next(chat_iter, None)
            if chat is not None:
                sequences.append(chat)
                kinds.append("chat")
    return sequences, kinds


def content_hash(model_name: str, data: DistillData, corpus_hash: str, tokenizer) -> str:
    """16 hex digits over everything the cached set depends on."""
    from decodelab.mtp.data import tokenizer_fingerprint

    key = {"model": model_name, "data": data.as_dict(), "corpus": corpus_hash,
           "tokenizer": tokenizer_fingerprint(tokenizer), "format": 2}  # 2: evaluation files skipped
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def trunk_targets(hf_model, blocks: torch.Tensor, top_k: int, *, batch_size: int = 4,
                  progress: bool = False) -> dict[str, torch.Tensor]:
    """The frozen model over blocks (N, T): {"hidden" (N, T, D) bf16, "top_ids" (N, T, K) int32,
    "top_logp" (N, T, K) float32: the log-softmax of its next-token logits at each position, top k}."""
    device = next(hf_model.parameters()).device
    chunks = range(0, len(blocks), batch_size)
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc="frozen model states", leave=False)
    hidden, ids, logp = [], [], []
    for i in chunks:
        h = hf_model.model(input_ids=blocks[i:i + batch_size].to(device)).last_hidden_state
        top = torch.log_softmax(hf_model.lm_head(h).float(), -1).topk(top_k, dim=-1)
        hidden.append(h.to(torch.bfloat16).cpu())
        ids.append(top.indices.to(torch.int32).cpu())
        logp.append(top.values.cpu())
    return {"hidden": torch.cat(hidden), "top_ids": torch.cat(ids), "top_logp": torch.cat(logp)}


@torch.no_grad()
def trunk_features(hf_model, blocks: torch.Tensor, layers: tuple[int, ...], *, batch_size: int = 4,
                   progress: bool = False) -> torch.Tensor:
    """The frozen model's residual stream after each of `layers` (0-based decoder layers, before any norm):
    blocks (N, T) -> (N, T, len(layers) D) bf16, the layers side by side (a fused module's extra input)."""
    device = next(hf_model.parameters()).device
    chunks = range(0, len(blocks), batch_size)
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc="frozen model features", leave=False)
    out = []
    for i in chunks:
        states = hf_model.model(input_ids=blocks[i:i + batch_size].to(device), output_hidden_states=True).hidden_states
        out.append(torch.cat([states[j + 1].to(torch.bfloat16) for j in layers], dim=-1).cpu())  # [0] = embeddings
    return torch.cat(out)


def with_features(dataset: dict, loaded, layers: tuple[int, ...], root: Path, *, progress: bool = False) -> dict:
    """dataset plus "features" (N, T, len(layers) D), cached beside the set as <hash>.features_<layers>.safetensors."""
    from safetensors.torch import load_file, save_file

    if not layers:
        return dataset
    path = root / f"{dataset['hash']}.features_{'_'.join(map(str, layers))}.safetensors"
    if path.exists():
        return {**dataset, "features": load_file(str(path))["features"]}
    features = trunk_features(loaded.hf_model, dataset["tokens"], tuple(layers), progress=progress)
    tmp = path.with_suffix(".tmp")
    save_file({"features": features}, str(tmp))
    tmp.replace(path)
    return {**dataset, "features": features}


def build_distill_set(loaded, corpus, data: DistillData, *, cache_dir: str | Path | None = None,
                      progress: bool = False, feature_layers: tuple[int, ...] = ()) -> dict:
    """Tokens, cached trunk states and teacher top-k for the retrofit (loaded from the cache when present).

    loaded: the frozen `decodelab.core.models.LoadedModel`; corpus: `decodelab.mtp.data.load_corpus()`.
    feature_layers: also the trunk's states after these layers ("features", see `trunk_features`).
    -> {"tokens" (N, T), "mask" (N, T) bool (real tokens, not padding), "hidden", "top_ids", "top_logp",
        "hash", "kinds": sequences per kind, "build_s": seconds the core set took to build (on a cache hit, the
        recorded build's; None for a set cached before builds were timed), "cached": whether it came from the cache}.
    """
    root = Path(cache_dir) if cache_dir is not None else None
    dataset = build_core_set(loaded, corpus, data, cache_dir=root, progress=progress)
    if not feature_layers:
        return dataset
    from decodelab.mtp.data import cache_root

    return with_features(dataset, loaded, tuple(feature_layers), root or cache_root() / "distill", progress=progress)


def build_core_set(loaded, corpus, data: DistillData, *, cache_dir: str | Path | None = None,
                   progress: bool = False) -> dict:
    """`build_distill_set` without features."""
    from safetensors.torch import load_file, save_file

    from decodelab.mtp.data import cache_root

    key = content_hash(loaded.name, data, corpus.corpus_hash, loaded.tokenizer)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "distill"
    path = root / f"{key}.safetensors"
    if path.exists():
        tensors = load_file(str(path))
        meta = json.loads((root / f"{key}.json").read_text())
        return {**tensors, "mask": tensors["mask"].bool(), "hash": key, "kinds": meta["kinds"],
                "build_s": meta.get("build_s"), "cached": True}
    began = time.perf_counter()
    own, pairs = split_own_code(task_pairs(corpus, data), data.code_gen_prompts)
    answers_in_half = data.answer_dtype == "bfloat16" and bool(data.chat_prompts or data.code_gen_prompts)
    half = None  # one bfloat16 copy serves both the answers and the trunk pass
    if answers_in_half or data.trunk_dtype == "bfloat16":
        half = copy.deepcopy(loaded.hf_model).to(torch.bfloat16)
    answerer = loaded
    if answers_in_half:
        from decodelab.core.transformer import Transformer

        answerer = replace(loaded, hf_model=half, transformer=Transformer.from_hf(half))
    chats = chat_sequences(answerer, data, progress=progress)
    own_code = own_code_sequences(answerer, own, data, progress=progress)
    sequences, seq_kinds = mixed_sequences(loaded.tokenizer, pairs, chats, own_code)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    tokens, used = pack_counted(sequences, data.seq_len, data.n_blocks, pad)
    kinds = {kind: seq_kinds[:used].count(kind) for kind in TASK_KINDS}  # what the blocks hold
    mask = torch.ones_like(tokens, dtype=torch.bool)
    for row, block in enumerate(tokens.tolist()):  # trailing padding only
        n = len(block)
        while n and block[n - 1] == pad:
            n -= 1
        mask[row, n:] = False
    targets = trunk_targets(loaded.hf_model if data.trunk_dtype == "float32" else half, tokens, data.top_k,
                            progress=progress)
    out = {"tokens": tokens, "mask": mask, **targets}
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({**out, "mask": mask.to(torch.uint8)}, str(tmp))
    build_s = time.perf_counter() - began
    (root / f"{key}.json").write_text(json.dumps({"kinds": kinds, "data": data.as_dict(), "model": loaded.name,
                                                 "build_s": build_s}))
    tmp.replace(path)  # a half-written file never carries the final name
    return {**out, "hash": key, "kinds": kinds, "build_s": build_s, "cached": False}

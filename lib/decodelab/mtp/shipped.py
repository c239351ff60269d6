"""The shipped retrofit checkpoint: train it (`decodelab train-mtp`), record it, check the record, load it.

A checkpoint directory (checkpoints/mtp/<name>/) holds `save_checkpoint`'s heads.safetensors + mtp_config.json
and record.json: the command, seed, spec, corpus hash, model id, content hash, the heads file's sha256,
train time, load average and the module's measured agreement. `check_record` says whether a directory
matches a spec (the notebook retrains only when asked or when it does not); `load_shipped` refuses a
directory whose weights do not match their record.

Training runs live under ~/.cache/decodelab/mtp/retrofit/<content hash>/ (resumable state.pt and the
finished checkpoint), so a second request for the same spec costs nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from decodelab.mtp.distill import CODE_POOLS, FROZEN_DTYPES, DistillData
from decodelab.mtp.retrofit_train import RetrofitSpec, spec_hash

SHIPPED_DIR = Path(__file__).resolve().parents[3] / "checkpoints" / "mtp"
DEFAULT_NAME = "smollm2-135m-deepseek-kl"
WEIGHTS = "heads.safetensors"
AGREEMENT_BLOCKS = 8  # blocks of each part (trained on / held out) the record's teacher-forced agreement reads


def shipped_path(name: str = DEFAULT_NAME) -> Path:
    return SHIPPED_DIR / name


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_record(directory: str | Path) -> dict:
    path = Path(directory) / "record.json"
    if not path.exists():
        raise ValueError(f"checkpoint_dir={str(directory)!r} has no record.json (not a recorded retrofit checkpoint)")
    return json.loads(path.read_text())


def check_record(directory: str | Path, *, spec: RetrofitSpec | None = None, model_name: str | None = None,
                 corpus_hash: str | None = None) -> list[str]:
    """Why `directory` cannot stand for the requested checkpoint ([] = it can): missing files, a weights file
    whose sha256 differs from its record, or a record made for another spec / model / corpus."""
    directory = Path(directory)
    try:
        record = read_record(directory)
    except ValueError as error:
        return [str(error)]
    problems = []
    weights = directory / WEIGHTS
    if not weights.exists():
        problems.append(f"{weights} is missing")
    elif sha256_of(weights) != record.get("sha256"):
        problems.append(f"{weights} has sha256 {sha256_of(weights)[:12]}..., its record says "
                        f"{str(record.get('sha256'))[:12]}... (changed or half-written)")
    if spec is not None and record.get("spec") != spec.as_dict():
        problems.append(f"{directory}/record.json was trained with another spec: {record.get('spec')}")
    if model_name is not None and record.get("model") != model_name:
        problems.append(f"{directory}/record.json holds a module for model {record.get('model')!r}, "
                        f"not {model_name!r}")
    if corpus_hash is not None and record.get("corpus_hash") != corpus_hash:
        problems.append(f"{directory}/record.json was trained on corpus {record.get('corpus_hash')!r}, this "
                        f"interpreter's stdlib hashes to {corpus_hash!r}")
    return problems


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def train_checkpoint(spec: RetrofitSpec, *, model_name: str = "smollm2-135m", out: str | Path | None = None,
                     loaded=None, corpus=None, cache_dir: str | Path | None = None, save_every: int = 20,
                     stop_after: int | None = None, progress: bool = True, command: str | None = None) -> Path:
    """Train (or resume, or reuse) the module of `spec` on the frozen `model_name`; write the checkpoint and its
    record into out (default: the cache's run directory). -> the checkpoint directory.

    stop_after: stop after this many steps in all, leaving a resumable state (the record is not written).
    """
    from decodelab.core.models import load_model
    from decodelab.mtp import data as mtp_data
    from decodelab.mtp.checkpoint import save_checkpoint
    from decodelab.mtp.distill import build_distill_set
    from decodelab.mtp.retrofit_train import module_agreement, new_module_model, split_blocks, train_retrofit

    corpus = corpus or mtp_data.load_corpus()
    key = spec_hash(spec, model_name, corpus.corpus_hash)
    root = Path(cache_dir) if cache_dir is not None else mtp_data.cache_root() / "retrofit"
    run_dir = root / key
    out = Path(out) if out is not None else run_dir / "checkpoint"
    if not check_record(out, spec=spec, model_name=model_name, corpus_hash=corpus.corpus_hash):
        return out  # cached: trained before, record intact
    cached = run_dir / "checkpoint"
    if out != cached and not check_record(cached, spec=spec, model_name=model_name, corpus_hash=corpus.corpus_hash):
        return _copy_checkpoint(cached, out)
    loaded = loaded or load_model(model_name, dtype=torch.float32)
    began = time.perf_counter()
    dataset = build_distill_set(loaded, corpus, spec.data, cache_dir=root / "data", progress=progress,
                                feature_layers=spec.feature_layers)
    data_s = time.perf_counter() - began
    # a set from the cache: the record states what building it cost (a set cached before builds were timed
    # has no such figure; then the seconds above, loading it, are all there is, and data_from_cache stays False)
    data_from_cache = bool(dataset.get("cached")) and dataset.get("build_s") is not None
    if data_from_cache:
        data_s = dataset["build_s"]
    model = new_module_model(loaded.hf_model, spec.seed, spec.init_layer, spec.feature_layers)
    result = train_retrofit(model, dataset, spec, run_dir=run_dir, save_every=save_every, stop_after=stop_after,
                            progress=progress)
    if result["steps_done"] < spec.steps:
        return run_dir
    train_part, held_part = split_blocks(dataset, spec, max_blocks=AGREEMENT_BLOCKS)
    agreement = module_agreement(model, train_part)
    model.heads.to(torch.bfloat16)  # shipped in bf16: half the bytes (the record's agreement is re-measured)
    model.heads.to(torch.float32)
    agreement_bf16 = module_agreement(model, train_part)
    heldout_bf16 = module_agreement(model, held_part) if spec.val_blocks else None
    model.heads.to(torch.bfloat16)
    save_checkpoint(model, cached, retrofit_model=model_name, extra={"name": DEFAULT_NAME, "seed": spec.seed,
                                                                    "content_hash": key})
    model.heads.to(torch.float32)
    record = {"name": out.name, "model": model_name, "content_hash": key, "spec": spec.as_dict(),
              "seed": spec.seed, "corpus_hash": corpus.corpus_hash, "corpus": corpus.provenance(),
              "distill_set": {"hash": dataset["hash"], "kinds": dataset["kinds"], "blocks": len(dataset["tokens"]),
                              "tokens": int(dataset["mask"].sum())},
              "command": command or "decodelab train-mtp", "train_s": result["elapsed_s"], "data_s": data_s,
              "data_from_cache": data_from_cache,
              "load_average": load_average(), "cpu_threads": torch.get_num_threads(),
              "python": platform.python_version(), "torch": torch.__version__, "dtype": "bfloat16",
              "train_agreement_fp32": agreement, "train_agreement_bf16": agreement_bf16,
              "heldout_agreement_bf16": heldout_bf16, "agreement_blocks": AGREEMENT_BLOCKS,
              "final_loss": result["losses"][-1], "loss_curve": result["losses"],
              "sha256": sha256_of(cached / WEIGHTS)}
    (cached / "record.json").write_text(json.dumps(record, indent=2))
    return cached if out == cached else _copy_checkpoint(cached, out)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for name in (WEIGHTS, "mtp_config.json"):
        shutil.copyfile(src / name, dst / name)
    record = read_record(src)  # the record names the directory it lies in (a cached run serves several)
    (dst / "record.json").write_text(json.dumps({**record, "name": dst.name}, indent=2))
    return dst


def load_shipped(directory: str | Path | None = None, *, trunk=None, model_name: str | None = None,
                 tokenizer=None):
    """The recorded retrofit checkpoint in `directory` (default: the shipped one) as an MTPModel on `trunk`.

    Refuses, naming the file: weights that differ from their record (sha256), a module recorded for another
    model than `model_name`, or one whose vocabulary / width differ from the trunk's (another tokenizer).
    """
    from decodelab.mtp.checkpoint import load_checkpoint

    directory = Path(directory) if directory is not None else shipped_path()
    problems = check_record(directory, model_name=model_name)
    if problems:
        raise ValueError("; ".join(problems))
    return load_checkpoint(directory, trunk=trunk)


def parse_args(argv: list[str]):
    import argparse

    defaults, data = RetrofitSpec(), DistillData()
    p = argparse.ArgumentParser(prog="decodelab train-mtp", description=(
        "Train a DeepSeek-style MTP module on the frozen embedded model by self-distillation (resumable; "
        "cached by content hash). Writes heads.safetensors, mtp_config.json and record.json into --out."))
    p.add_argument("--model", default="smollm2-135m", help="frozen model (embedded name, local dir or hub id)")
    p.add_argument("--out", default=str(shipped_path()), help="checkpoint directory (default: the shipped one)")
    p.add_argument("--loss", default=defaults.loss, choices=("kl", "ce"))
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--loss-fraction", type=float, default=defaults.loss_fraction)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--n-blocks", type=int, default=data.n_blocks)
    p.add_argument("--seq-len", type=int, default=data.seq_len)
    p.add_argument("--chat-prompts", type=int, default=data.chat_prompts)
    p.add_argument("--code-gen-prompts", type=int, default=data.code_gen_prompts,
                   help="code-edit requests answered by the model's own greedy continuation")
    p.add_argument("--gen-batch-size", type=int, default=data.gen_batch_size,
                   help="rows per generation call when the model answers (changes the set's hash, not its kind)")
    p.add_argument("--trunk-dtype", default=data.trunk_dtype, choices=FROZEN_DTYPES,
                   help="dtype of the frozen model's pass over the blocks (its states and the teacher)")
    p.add_argument("--answer-dtype", default=data.answer_dtype, choices=FROZEN_DTYPES,
                   help="dtype the model writes its own answers in")
    p.add_argument("--code-pool", default=data.code_pool, choices=CODE_POOLS,
                   help="definitions the code-edit requests rename (top-level functions, or methods too)")
    p.add_argument("--init-layer", type=lambda v: None if v == "none" else int(v), default=defaults.init_layer,
                   help="trunk layer the module's block starts as a copy of (-1: the last; 'none': identity init)")
    p.add_argument("--feature-layers", type=lambda v: tuple(int(x) for x in v.split(",") if x),
                   default=defaults.feature_layers,
                   help="comma-separated trunk layers fused into the module's input (EAGLE-3); '' = final state only")
    p.add_argument("--feature-weight", type=float, default=defaults.feature_weight,
                   help="weight of the smooth-L1 regression of the trunk's next state (0 = none)")
    p.add_argument("--save-every", type=int, default=20, help="steps between resumable checkpoints")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resume later)")
    p.add_argument("--cache-dir", default=None, help="where runs and distillation sets are cached")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    data = DistillData(seq_len=args.seq_len, n_blocks=args.n_blocks, chat_prompts=args.chat_prompts,
                       code_gen_prompts=args.code_gen_prompts, gen_batch_size=args.gen_batch_size,
                       trunk_dtype=args.trunk_dtype, answer_dtype=args.answer_dtype, code_pool=args.code_pool)
    spec = RetrofitSpec(data=data, loss=args.loss, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                        warmup=max(1, min(RetrofitSpec.warmup, args.steps // 10)), loss_fraction=args.loss_fraction,
                        seed=args.seed, init_layer=args.init_layer, feature_layers=args.feature_layers,
                        feature_weight=args.feature_weight)
    command = "decodelab train-mtp " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    out = train_checkpoint(spec, model_name=args.model, out=args.out, cache_dir=args.cache_dir,
                           save_every=args.save_every, stop_after=args.stop_after, command=command.strip())
    print(f"train-mtp: {out}")
    return 0


def obtain_module(choice: str, *, loaded, corpus, spec: RetrofitSpec | None = None, progress: bool = True) -> dict:
    """The retrofit module for notebook 03. choice: "shipped" (the checkpoint in the repository; retrained
    into the cache when its record does not match `spec`, the model or the corpus), "train" (train `spec` now,
    or reuse the cached run of the same content hash), or a checkpoint directory.
    -> {"model" (MTPModel on loaded.hf_model), "directory", "source" ("shipped" | "trained" | "directory"),
        "problems" (why the shipped one was not used), "record"}."""
    spec = spec or RetrofitSpec()
    problems: list[str] = []
    if choice == "shipped":
        directory = shipped_path()
        problems = check_record(directory, spec=spec, model_name=loaded.name, corpus_hash=corpus.corpus_hash)
        source = "shipped"
        if problems:
            directory, source = train_checkpoint(spec, model_name=loaded.name, loaded=loaded, corpus=corpus,
                                                 progress=progress), "trained"
    elif choice == "train":
        directory, source = train_checkpoint(spec, model_name=loaded.name, loaded=loaded, corpus=corpus,
                                             progress=progress), "trained"
    else:
        directory, source = Path(choice), "directory"
        if not directory.is_dir():
            raise ValueError(f"retrofit_checkpoint={choice!r} is not a directory (allowed: 'shipped', 'train' or a "
                             "checkpoint directory)")
    model = load_shipped(directory, trunk=loaded.hf_model, model_name=loaded.name)
    return {"model": model, "directory": str(directory), "source": source, "problems": problems,
            "record": read_record(directory)}


def shipped_drafter(target, *, checkpoint: str | Path | None = None, model_name: str | None = None):
    """The shipped (or `checkpoint`'s) module as a reusing `MTPDrafter` for `target` (a `Transformer`,
    `LoadedModel` or LlamaForCausalLM: the frozen model the module was trained on), for
    `decodelab.speculation.drafters.make_drafter("mtp", target)`."""
    from decodelab.mtp.drafter import MTPDrafter

    hf_model = getattr(target, "hf_model", target)
    return MTPDrafter(load_shipped(checkpoint, trunk=hf_model, model_name=model_name), reuse=True)

"""MTP checkpoints: safetensors weights + mtp_config.json in a run directory, and loading them back.

A from-scratch checkpoint holds the whole model (trunk + heads; the tied embedding stored once) and the
trunk's LlamaConfig. A retrofit checkpoint holds only the heads and names the frozen model they sit on
(`retrofit_model`), which `load_checkpoint` loads again unless it is handed the trunk.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from decodelab.mtp.model import MTPConfig, MTPModel


def save_checkpoint(model: MTPModel, directory: str | Path, *, retrofit_model: str | None = None,
                    extra: dict | None = None) -> Path:
    """Write model.safetensors or heads.safetensors (+ mtp_config.json) into directory.

    retrofit_model: the name `decodelab.core.models.load_model` loads the frozen trunk by (embedded name,
    local dir or hub id); required for a frozen-trunk model, refused for a from-scratch one.
    extra: further JSON-able fields for mtp_config.json (run name, seed).
    """
    from safetensors.torch import save_model

    if model.frozen_trunk and not retrofit_model:
        raise ValueError(f"retrofit_model={retrofit_model!r}: a frozen-trunk (retrofit) checkpoint must name the "
                         "model its heads sit on (allowed: an embedded name, local dir or hub id)")
    if not model.frozen_trunk and retrofit_model is not None:
        raise ValueError(f"retrofit_model={retrofit_model!r} given for a from-scratch model (allowed: None; its "
                         "checkpoint carries its own trunk)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"mtp": model.config.as_dict(), "frozen_trunk": model.frozen_trunk, **(extra or {})}
    if model.frozen_trunk:
        meta["retrofit_model"] = retrofit_model
        save_model(model.heads, str(directory / "heads.safetensors"))
    else:
        save_model(model, str(directory / "model.safetensors"))
    meta["trunk_config"] = model.trunk.config.to_dict()
    (directory / "mtp_config.json").write_text(json.dumps(meta, indent=2, default=str))
    return directory


def check_trunk_matches(directory: Path, meta: dict, trunk) -> None:
    """Refuse a trunk other than the one the heads were trained on: vocabulary (tokenizer) and width must match."""
    saved = meta.get("trunk_config") or {}
    have = trunk.config
    for key in ("vocab_size", "hidden_size", "num_key_value_heads", "num_attention_heads"):
        if key in saved and saved[key] != getattr(have, key):
            raise ValueError(
                f"{directory / 'heads.safetensors'} holds heads for {meta.get('retrofit_model')!r} "
                f"({key}={saved[key]}), but the trunk given has {key}={getattr(have, key)}: another model or "
                "tokenizer (allowed: the model the checkpoint names)")


def load_weights(module, path: Path, meta: dict) -> None:
    """safetensors weights into module, with a clear error for a missing, corrupted or half-written file."""
    from safetensors.torch import load_model as load_safetensors

    if not path.exists():
        raise ValueError(f"{path} is missing (the checkpoint directory has mtp_config.json but no weights)")
    try:
        load_safetensors(module, str(path))
    except Exception as error:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"{path} could not be read as the weights of {meta.get('mtp')} "
                         f"({type(error).__name__}: {error}); it is corrupted or half-written: retrain it") from error


def load_checkpoint(directory: str | Path, *, device: str | torch.device | None = None, trunk=None,
                    n_heads: int | None = None) -> MTPModel:
    """Rebuild an MTPModel from `save_checkpoint`'s directory.

    A retrofit checkpoint needs its frozen trunk: pass `trunk` (a LlamaForCausalLM), else the model
    named in the checkpoint (`retrofit_model`) is loaded with `decodelab.core.models.load_model`.
    n_heads: the heads the caller needs (None = what the file holds); more than it holds is an error naming
    the file. A trunk of another vocabulary or width, or an unreadable weights file, is refused the same way.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    meta_path = directory / "mtp_config.json"
    if not meta_path.exists():
        raise ValueError(f"checkpoint_dir={str(directory)!r} has no mtp_config.json (not an MTP checkpoint)")
    try:
        meta = json.loads(meta_path.read_text())
        config = MTPConfig(**meta["mtp"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{meta_path} is not a readable MTP config ({error}): corrupted or half-written") from error
    if n_heads is not None and n_heads > config.n_heads:
        raise ValueError(f"n_heads={n_heads} asked of {meta_path}, which holds n_heads={config.n_heads} "
                         f"({config.n_heads - 1} {config.style} head(s) besides the LM head); "
                         f"allowed: <= {config.n_heads}")
    if meta["frozen_trunk"]:
        if trunk is None:
            from decodelab.core.models import load_model

            if not meta.get("retrofit_model"):
                raise ValueError(f"checkpoint_dir={str(directory)!r} is a retrofit checkpoint that names no "
                                 "retrofit_model: pass trunk= (the frozen LlamaForCausalLM its heads sit on)")
            trunk = load_model(meta["retrofit_model"], device=device, dtype=torch.float32).hf_model
        check_trunk_matches(directory, meta, trunk)
        model = MTPModel(trunk, config, frozen_trunk=True)
        load_weights(model.heads, directory / "heads.safetensors", meta)
    else:
        trunk_config = {k: v for k, v in meta["trunk_config"].items()
                        if k not in ("architectures", "transformers_version")}
        trunk = LlamaForCausalLM(LlamaConfig(**trunk_config))
        model = MTPModel(trunk, config)
        load_weights(model, directory / "model.safetensors", meta)
    if device is not None:
        model.to(device)
    return model.eval()

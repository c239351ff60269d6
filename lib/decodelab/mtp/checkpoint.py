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


def load_checkpoint(directory: str | Path, *, device: str | torch.device | None = None, trunk=None) -> MTPModel:
    """Rebuild an MTPModel from `save_checkpoint`'s directory.

    A retrofit checkpoint needs its frozen trunk: pass `trunk` (a LlamaForCausalLM), else the model
    named in the checkpoint (`retrofit_model`) is loaded with `decodelab.core.models.load_model`.
    """
    from safetensors.torch import load_model as load_safetensors
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    meta_path = directory / "mtp_config.json"
    if not meta_path.exists():
        raise ValueError(f"checkpoint_dir={str(directory)!r} has no mtp_config.json (not an MTP checkpoint)")
    meta = json.loads(meta_path.read_text())
    config = MTPConfig(**meta["mtp"])
    if meta["frozen_trunk"]:
        if trunk is None:
            from decodelab.core.models import load_model

            if not meta.get("retrofit_model"):
                raise ValueError(f"checkpoint_dir={str(directory)!r} is a retrofit checkpoint that names no "
                                 "retrofit_model: pass trunk= (the frozen LlamaForCausalLM its heads sit on)")
            trunk = load_model(meta["retrofit_model"], device=device, dtype=torch.float32).hf_model
        model = MTPModel(trunk, config, frozen_trunk=True)
        load_safetensors(model.heads, str(directory / "heads.safetensors"))
    else:
        trunk_config = {k: v for k, v in meta["trunk_config"].items()
                        if k not in ("architectures", "transformers_version")}
        trunk = LlamaForCausalLM(LlamaConfig(**trunk_config))
        model = MTPModel(trunk, config)
        load_safetensors(model, str(directory / "model.safetensors"))
    if device is not None:
        model.to(device)
    return model.eval()

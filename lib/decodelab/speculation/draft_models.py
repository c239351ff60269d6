"""Where a draft model comes from: a model sharing the target's tokenizer, loaded by name, or a truncated
copy of the target (its first layers, sharing the weights) when no smaller sibling is at hand.

The drafters that run a draft (`decodelab.speculation.drafters.ModelDrafter`) take the result; this module
only builds and checks it.
"""
from __future__ import annotations

import copy

import torch

from decodelab.core.models import LoadedModel, load_model
from decodelab.core.transformer import Transformer


def default_draft_layers(n_layers: int) -> int:
    """Depth of the truncated draft when none is given: a third of the target's layers (at least one)."""
    return max(1, n_layers // 3)


def draft_model_for(target, *, name: str | None = None, n_layers: int | None = None, dtype=None) -> LoadedModel:
    """The draft model of the "draft_model" drafter: `name` (a hub id or path sharing the target's tokenizer)
    loaded on the target's device in `dtype` (None: the device's default), else the target's first
    `n_layers` layers (None: `default_draft_layers`), which share the target's weights and so its dtype."""
    if name:
        return load_model(name, device=target.device, dtype=dtype)
    return truncated_model(target, n_layers or default_draft_layers(target.transformer.n_layers))


def check_same_tokenizer(target, draft) -> None:
    """Raise ValueError unless `draft` (LoadedModel) tokenizes exactly like `target`: speculative
    decoding compares token ids, so a draft with another vocabulary would propose nonsense."""
    t_tok, d_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    t_name, d_name = getattr(target, "name", "target"), getattr(draft, "name", "draft")
    if t_tok is not None and d_tok is not None:
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        if t_vocab != d_vocab:
            differ = len(set(t_vocab.items()) ^ set(d_vocab.items()))
            raise ValueError(
                f"draft={d_name!r} has a different tokenizer from target={t_name!r} "
                f"({len(d_vocab)} vs {len(t_vocab)} tokens, {differ} (token, id) pairs differ); "
                "a draft model must share the target's tokenizer"
            )
        return
    if (t_tok is None) != (d_tok is None):
        raise ValueError(f"draft={d_name!r} and target={t_name!r}: one has a tokenizer and the other not; "
                         "a draft model must share the target's tokenizer")
    t_v, d_v = target.transformer.vocab_size, draft.transformer.vocab_size
    if t_v != d_v:
        raise ValueError(f"draft={d_name!r} vocab_size={d_v} differs from target={t_name!r} vocab_size={t_v}; "
                         "a draft model must share the target's tokenizer")


def truncated_model(model, n_layers: int) -> LoadedModel:
    """A LoadedModel made of `model`'s first n_layers decoder layers + its final norm and head, sharing
    the weight tensors (no copy). A stand-in draft model of the same family when no smaller sibling is
    at hand (the embedded target); transformers' `generate(assistant_model=...)` accepts its hf_model."""
    hf = model.hf_model
    total = hf.config.num_hidden_layers
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers={n_layers!r} must be in [1, {total}]")
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    with torch.device("meta"):
        small = type(hf)(config)
    small.model.embed_tokens = hf.model.embed_tokens
    small.model.layers = torch.nn.ModuleList(hf.model.layers[:n_layers])
    small.model.norm = hf.model.norm
    small.model.rotary_emb = hf.model.rotary_emb
    small.lm_head = hf.lm_head
    small.generation_config = copy.deepcopy(hf.generation_config)
    small.eval()
    return LoadedModel(name=f"{model.name}-first{n_layers}", hf_model=small, tokenizer=model.tokenizer,
                       transformer=Transformer.from_hf(small))

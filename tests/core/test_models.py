"""Model loading: bad dtype/device answered before anything loads, the embedded cache repairs itself,
sliding-window models are refused instead of decoded with full attention. No hub access needed."""
import json

import pytest
import torch

from decodelab.core import models
from decodelab.core.engine import generate
from decodelab.core.transformer import Transformer, check_supported, sliding_window_layers


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if load_model gets as far as finding weights."""
    monkeypatch.setattr(models, "resolve_model_path", lambda name: pytest.fail("weights must not be looked up"))


@pytest.mark.parametrize("dtype", ["float33", "int8", "", torch.int64])
def test_bad_dtype_names_the_value_and_the_allowed_names_before_loading(no_loading, dtype):
    with pytest.raises(ValueError) as error:
        models.load_model("smollm2-135m", device="cpu", dtype=dtype)
    message = str(error.value)
    assert f"dtype={dtype!r}" in message and "bfloat16" in message and "float32" in message


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("float16", torch.float16),
                                         ("torch.float32", torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_dtype_names_and_floating_dtypes_resolve(name, dtype):
    cpu = torch.device("cpu")
    if models.dtype_supported(dtype, cpu):
        assert models.resolve_dtype(name, cpu) is dtype
    else:  # a CPU without bf16 units (AVX2-only hosts): the name still resolves, to a clear error naming what runs
        with pytest.raises(ValueError, match=r"is not supported on device cpu of this machine; available there: "
                                             r"\['float32'"):
            models.resolve_dtype(name, cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_clear_error_before_loading(no_loading, device):
    with pytest.raises(ValueError, match=rf"device='{device}' but CUDA is not available.*allowed here: \['cpu'"):
        models.load_model("smollm2-135m", device=device)


@pytest.mark.parametrize("device", ["gpu", "mps"])
def test_unknown_or_unsupported_device_is_rejected_before_loading(no_loading, device):
    with pytest.raises(ValueError, match=rf"device='{device}'.*allowed here"):
        models.load_model("smollm2-135m", device=device)


# --- the embedded-model cache --------------------------------------------------------------------

@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """DECODELAB_CACHE in tmp_path and a conversion that saves a tiny model (no GGUF): -> list of calls."""
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(name, out_dir, *, progress=True):
        calls.append(out_dir)
        models.tiny_model(seed=0, num_layers=1).hf_model.save_pretrained(out_dir)
        (out_dir / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(models, "convert_embedded", convert)
    return calls


def test_embedded_cache_is_converted_once_then_reused(fake_conversion):
    first = models.embedded_model_dir("smollm2-135m")
    assert models.cache_problem(first) is None and (first / models.CACHE_MARKER).is_file()
    assert models.embedded_model_dir("smollm2-135m") == first
    assert len(fake_conversion) == 1
    assert [p.name for p in first.parent.iterdir()] == ["smollm2-135m"]  # no partial folders left


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_config", "delete_weights", "garble_config"])
def test_half_written_embedded_cache_is_detected_and_rebuilt(fake_conversion, damage):
    target = models.embedded_model_dir("smollm2-135m")
    weights = target / "model.safetensors"
    if damage == "truncate_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "delete_weights":
        weights.unlink()
    elif damage == "delete_config":
        (target / "config.json").unlink()
    else:
        (target / "config.json").write_text('{"model_type": "lla')
    assert models.cache_problem(target) is not None
    assert models.embedded_model_dir("smollm2-135m") == target
    assert len(fake_conversion) == 2
    assert models.cache_problem(target) is None


def test_truncated_weights_without_a_marker_are_rebuilt(fake_conversion):
    """A cache from before markers is checked from its own files: the safetensors header gives the length."""
    target = models.embedded_model_dir("smollm2-135m")
    (target / models.CACHE_MARKER).unlink()
    assert models.cache_problem(target) is None  # intact: adopted, not rebuilt
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    assert "truncated" in models.cache_problem(target)
    models.embedded_model_dir("smollm2-135m")
    assert len(fake_conversion) == 2 and models.cache_problem(target) is None


def test_interrupted_conversion_leaves_nothing_that_looks_complete(fake_conversion, monkeypatch):
    def interrupted(name, out_dir, *, progress=True):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_embedded", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.embedded_model_dir("smollm2-135m")
    cache = models.cache_dir()
    assert not cache.exists() or list(cache.iterdir()) == []


def test_cache_marker_records_every_file_size(fake_conversion):
    target = models.embedded_model_dir("smollm2-135m")
    sizes = json.loads((target / models.CACHE_MARKER).read_text())["files"]
    assert set(models.CACHE_FILES) <= set(sizes)
    assert all((target / name).stat().st_size == size for name, size in sizes.items())


# --- sliding windows -----------------------------------------------------------------------------

def tiny_mistral_config(**overrides):
    from transformers import MistralConfig

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, sliding_window=8)
    return MistralConfig(**{**fields, **overrides})


def tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, max_window_layers=1)
    return Qwen2Config(**{**fields, **overrides})


@pytest.mark.parametrize("config", [tiny_mistral_config(), tiny_qwen2_config(use_sliding_window=True)],
                         ids=["mistral", "qwen2-use_sliding_window"])
def test_sliding_window_models_are_refused(config):
    assert sliding_window_layers(config)
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=8 .*would decode it wrongly"):
        check_supported(config)


@pytest.mark.parametrize("config", [
    tiny_mistral_config(sliding_window=None), tiny_mistral_config(sliding_window=64),
    tiny_qwen2_config(use_sliding_window=False), tiny_qwen2_config(use_sliding_window=True, max_window_layers=2),
], ids=["mistral-no-window", "mistral-window-covers-context", "qwen2-default", "qwen2-no-layer-slides"])
def test_models_whose_attention_is_full_are_accepted(config):
    assert sliding_window_layers(config) == []
    check_supported(config)


def test_load_model_refuses_a_sliding_window_before_loading_weights(tmp_path):
    tiny_mistral_config().save_pretrained(tmp_path)  # config only: loading weights would fail differently
    with pytest.raises(ValueError, match="sliding-window attention") as error:
        models.load_model(str(tmp_path), device="cpu")
    assert not isinstance(error.value, models.ModelNotFoundError)


def test_transformer_refuses_a_sliding_window_model():
    from transformers import MistralForCausalLM

    with pytest.raises(ValueError, match="sliding-window attention"):
        Transformer.from_hf(MistralForCausalLM(tiny_mistral_config()))


def test_mistral_whose_window_covers_the_context_decodes_like_transformers():
    from transformers import MistralForCausalLM

    torch.manual_seed(0)
    hf_model = MistralForCausalLM(tiny_mistral_config(sliding_window=64, initializer_range=0.2)).eval()
    model = models.LoadedModel(name="tiny-mistral", hf_model=hf_model, tokenizer=None,
                               transformer=Transformer.from_hf(hf_model))
    prompt = [3, 4, 5, 6, 7]
    ours = generate(model, [prompt], max_new_tokens=20, eos_token_ids=[]).tokens[0]
    reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=0, do_sample=False,
                                  eos_token_id=[], pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == reference and len(ours) == 20


def test_bf16_where_the_cpu_lacks_it_names_what_is_available(no_loading, monkeypatch):
    monkeypatch.setattr(models, "dtype_supported", lambda dtype, device: dtype != torch.bfloat16)
    with pytest.raises(ValueError) as error:
        models.load_model("smollm2-135m", device="cpu", dtype="bf16")
    message = str(error.value)
    assert "dtype='bf16'" in message and "device cpu" in message and "['float32', 'float16']" in message


def test_available_dtypes_always_offers_float32():
    assert models.available_dtypes(torch.device("cpu"))[0] == "float32"


def tiny_qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_forward_equals_transformers_on_each_supported_family(family):
    # Our forward over the family's own modules (Qwen2's q/k/v biases, Qwen3's per-head q/k norms, each
    # RMSNorm class) gives transformers' logits, prompt and decode steps alike.
    import transformers

    from decodelab.core import engine

    config = {"mistral": lambda: tiny_mistral_config(sliding_window=None), "qwen2": tiny_qwen2_config,
              "qwen3": tiny_qwen3_config}[family]()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():  # random norm weights too, so a norm computed wrongly shows
            p.add_(torch.randn(p.shape) * 0.05)
    tr = Transformer.from_hf(hf)
    ids = [[3, 9, 4, 17, 22, 5], [8, 1, 30, 2, 2, 7]]
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits
        cache, _ = engine.prefill(tr, [row[:4] for row in ids], max_new_tokens=2)
        whole = tr.forward(torch.tensor([row[:4] for row in ids]), tr.new_cache(2, 6))
        steps = [engine.decode_step(tr, cache, torch.tensor([row[t] for row in ids])) for t in (4, 5)]
    torch.testing.assert_close(whole, want[:, :4], rtol=1e-4, atol=1e-4)
    for t, step in zip((4, 5), steps):
        torch.testing.assert_close(step, want[:, t], rtol=1e-4, atol=1e-4)

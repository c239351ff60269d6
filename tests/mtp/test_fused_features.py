"""The EAGLE-3-style fused module (trunk layers fused into its input) and the feature-regression loss term."""
import pytest
import torch

from decodelab.core import engine
from decodelab.core.models import tiny_model
from decodelab.core.transformer import Transformer
from decodelab.mtp import distill
from decodelab.mtp import drafter as mtp_drafter
from decodelab.mtp import retrofit_train as rt
from decodelab.mtp.checkpoint import load_checkpoint, save_checkpoint

VOCAB = 97
LAYERS = (0, 2)


def frozen(seed=0):
    return tiny_model(seed=seed, vocab_size=VOCAB).hf_model


def perturbed(model):
    with torch.no_grad():  # a non-identity module, so the fused features change its drafts
        for p in model.heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model


def fake_dataset(trunk, n=4, length=12):
    tokens = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))
    targets = distill.trunk_targets(trunk, tokens, 5)
    return {"tokens": tokens, "mask": torch.ones_like(tokens, dtype=torch.bool), **targets,
            "features": distill.trunk_features(trunk, tokens, LAYERS), "hash": "test", "kinds": {}}


def test_fused_module_starts_as_the_unfused_one():
    trunk = frozen()
    data = fake_dataset(trunk)
    plain, fused = rt.new_module_model(trunk, 0), rt.new_module_model(trunk, 0, feature_layers=LAYERS)
    with torch.no_grad():
        a = plain.head_state(2, data["hidden"].float(), data["tokens"])
        b = fused.head_state(2, data["hidden"].float(), data["tokens"], data["features"].float())
    torch.testing.assert_close(a, b)


def test_fused_drafter_states_equal_the_training_path():
    trunk = frozen()
    model = perturbed(rt.new_module_model(trunk, 0, feature_layers=LAYERS))
    drafter = mtp_drafter.MTPDrafter(model, reuse=True)
    target = drafter.target()
    tokens = torch.tensor([[5, 7, 9, 3, 11, 4, 8]])
    _, wide = target.forward(tokens, target.new_cache(1, 16), return_hidden=True)
    drafter.begin(tokens.tolist(), max_len=16)
    drafter.observe(wide[:, :-1], torch.tensor([6]), tokens[:, 1:])
    d = trunk.config.hidden_size
    cached = distill.trunk_features(trunk, tokens, LAYERS)  # what training reads: the same states, in bf16
    torch.testing.assert_close(cached, wide[..., d:].to(torch.bfloat16), atol=0.02, rtol=0.02)
    with torch.no_grad():
        want = model.head_state(2, model.hidden(tokens), tokens, wide[..., d:])[0, -1]
    torch.testing.assert_close(drafter._last[0, 0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_fused_module_drafts_keep_greedy_output(k):
    from decodelab.speculation import decode as speculative

    trunk = frozen()
    model = perturbed(rt.new_module_model(trunk, 0, feature_layers=LAYERS))
    prompts = [[5, 7, 9, 3, 11], [4, 4, 2], [8] * 9]
    plain = engine.generate(Transformer.from_hf(trunk), prompts, max_new_tokens=12, eos_token_ids=[])
    drafter = mtp_drafter.MTPDrafter(model, reuse=True)
    out = speculative.generate(drafter.target(), prompts, drafter, k=k, max_new_tokens=12, eos_token_ids=[])
    assert out.tokens == plain.tokens


def test_fused_drafter_on_a_plain_target_says_what_to_verify_with():
    from decodelab.speculation import decode as speculative

    trunk = frozen()
    drafter = mtp_drafter.MTPDrafter(rt.new_module_model(trunk, 0, feature_layers=LAYERS), reuse=True)
    with pytest.raises(ValueError, match="drafter.target"):
        speculative.generate(Transformer.from_hf(trunk), [[5, 7, 9]], drafter, k=2, max_new_tokens=4,
                             eos_token_ids=[])


def test_fused_checkpoint_round_trip(tmp_path):
    trunk = frozen()
    model = perturbed(rt.new_module_model(trunk, 0, feature_layers=LAYERS))
    save_checkpoint(model, tmp_path, retrofit_model="tiny")
    back = load_checkpoint(tmp_path, trunk=trunk)
    assert back.config.feature_layers == LAYERS
    for (name, a), b in zip(model.heads.state_dict().items(), back.heads.state_dict().values()):
        assert torch.equal(a, b), name


def test_feature_regression_adds_the_smooth_l1_to_the_next_state():
    trunk = frozen()
    model = perturbed(rt.new_module_model(trunk, 0))
    data = fake_dataset(trunk)
    scored = torch.zeros(4, 11, dtype=torch.bool)
    scored[1, 4] = True
    args = (model, data["tokens"], data["hidden"].float(), data["top_ids"], data["top_logp"], scored)
    kl = rt.distill_loss(*args)
    both = rt.distill_loss(*args, feature_weight=0.5)
    with torch.no_grad():
        state = model.trunk.model.norm(model.head_state(2, data["hidden"].float(), data["tokens"])[1, 4])
    want = torch.nn.functional.smooth_l1_loss(state, data["hidden"][1, 5].float())
    torch.testing.assert_close(both - kl, 0.5 * want, atol=1e-5, rtol=1e-4)


def test_old_records_keep_their_spec_and_hash():
    old = rt.RetrofitSpec(**rt.ADDED_FIELDS)  # a spec as written before the fields existed
    assert not set(rt.ADDED_FIELDS) & set(old.as_dict())
    assert rt.RetrofitSpec.from_dict(old.as_dict()) == old  # a record without the fields reads back as it was
    fused = rt.RetrofitSpec(feature_layers=[2, 14], feature_weight=1.0)
    assert rt.RetrofitSpec.from_dict(fused.as_dict()) == fused
    assert rt.spec_hash(fused, "m", "c") != rt.spec_hash(old, "m", "c")

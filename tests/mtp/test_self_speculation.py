"""MTP self-speculative decoding runs on the engine's one token loop: same tokens as plain greedy decoding of
the trunk's next-token head, and the same tau as the generic speculative path with the MTP drafter.

Before the dedicated loop was deleted, its tokens were compared with the generic path's on these models and
prompts (with and without an EOS): equal everywhere, and so were tau and the per-position acceptance on
them (every draft accepted). The dedicated loop emitted the prefill's token only in its first verify step,
so a row could run one verify forward more at its end (tokens unchanged); where drafts are rejected that
extra step moves its tau (e.g. 13/9 -> 10/7 on the smoke run), the generic loop's counts only the forwards
the row needed."""
import pytest
import torch

from decodelab.core import engine
from decodelab.core.transformer import Transformer
from decodelab.mtp import drafter as mtp_drafter
from decodelab.mtp import model as mtp
from decodelab.mtp import self_speculation
from decodelab.speculation import decode as speculative

VOCAB = 97
PROMPTS = [[1, 5, 7, 9, 3], [4, 4, 2], [8] * 9, [11], [3, 1, 4, 1, 5, 9, 2, 6]]


def peaked_model(style: str, n_heads: int, seed: int = 0):
    model = mtp.build_model(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=n_heads, style=style,
                            match_params=False, seed=seed)
    with torch.no_grad():  # sharper distributions so greedy decoding is not one repeated token
        model.trunk.model.embed_tokens.weight.mul_(20.0)
    return model


@pytest.mark.parametrize("style,n_heads,seed", [("gloeckle", 4, 0), ("gloeckle", 3, 1), ("deepseek", 2, 2)])
def test_generic_loop_with_mtp_drafter_equals_plain_greedy_of_the_trunk(style, n_heads, seed):
    model = peaked_model(style, n_heads, seed)
    tr = Transformer.from_hf(model.trunk)
    plain = engine.generate(tr, PROMPTS, max_new_tokens=25, eos_token_ids=[])
    spec = self_speculation.self_speculative_generate(model, PROMPTS, max_new_tokens=25)
    generic = speculative.generate(tr, PROMPTS, mtp_drafter.MTPDrafter(model), k=n_heads - 1, max_new_tokens=25,
                                   eos_token_ids=[])
    assert spec.tokens == plain.tokens == generic.tokens
    assert spec.stats.tau == generic.stats.tau >= 1.0
    torch.testing.assert_close(torch.tensor(spec.stats.acceptance_per_position),
                               torch.tensor(generic.stats.acceptance_per_position), equal_nan=True)
    assert spec.stats.drafter == f"mtp-{style}"


def test_self_speculative_k_is_validated():
    model = peaked_model("gloeckle", 3)
    with pytest.raises(ValueError, match="k="):
        self_speculation.self_speculative_generate(model, PROMPTS, k=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        self_speculation.self_speculative_generate(model, PROMPTS, max_new_tokens=0)

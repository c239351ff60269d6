"""Exact enumeration: tree-attention scores, normalization, agreement with the real masked decode loop."""
import math

import pytest
import torch

from decodelab.constrained import decode as C
from decodelab.constrained import distortion as D
from decodelab.constrained.bitmask import allocate_bitmask, bitmask_to_bool
from decodelab.constrained.constraint import Constraint
from decodelab.constrained.engines import XGrammarEngine
from decodelab.core.engine import prefill
from decodelab.core.models import resolve_model_path, tiny_model
from decodelab.core.sampling import Sampler, SamplerConfig
from decodelab.workloads.constrained import load_tasks
from decodelab.workloads.prompts import user_prompt_ids

STRINGS = ["yes", "no", "unsure", "maybe"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def tiny49k():
    return tiny_model(seed=5, vocab_size=49152, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, init_std=0.05)


@pytest.fixture(scope="module")
def scored(tok, tiny49k):
    prompt = user_prompt_ids(tok, "Answer yes, no, unsure or maybe.")
    trie = D.build_trie(STRINGS, D.token_bytes_table(tok), [tok.eos_token_id])
    D.score_trie(tiny49k, prompt, trie, chunk_size=7)  # small chunks: ancestors span several forwards
    canonical = {s: tok(s, add_special_tokens=False).input_ids for s in STRINGS}
    return prompt, trie, D.exact_distributions(trie, canonical)


def test_tree_attention_scores_match_sequential_scoring(tiny49k, scored):
    prompt, trie, _ = scored
    for node in range(0, len(trie), max(1, len(trie) // 12)):
        _, logits = prefill(tiny49k, [prompt + trie.path(node)], max_new_tokens=1)
        logp = torch.log_softmax(logits[0].float(), -1)
        for token, value in trie.child_logp[node].items():
            assert math.isclose(value, logp[token].item(), abs_tol=1e-4)
        assert math.isclose(trie.eos_logp[node], logp[2].item(), abs_tol=1e-4)


def test_trie_holds_every_tokenization(tok, scored):
    _, trie, exact = scored
    # every complete path decodes to its string, and the canonical tokenization is among them
    for node, string in enumerate(trie.complete):
        if string is not None:
            assert tok.decode(trie.path(node)) == string
    assert all(exact.n_tokenizations[s] >= 1 for s in STRINGS)
    assert exact.n_tokenizations["unsure"] > 1


def test_exact_distributions_sum_to_one(scored):
    _, _, exact = scored
    for dist in (exact.target, exact.target_canonical, exact.masked, exact.masked_canonical):
        assert abs(sum(dist.values()) - 1.0) < 1e-6


def test_trie_children_are_exactly_the_xgrammar_mask(tok, scored):
    _, trie, _ = scored
    engine = XGrammarEngine(tok)
    compiled = engine.compile(Constraint.choices(STRINGS))
    for node in range(len(trie)):
        matcher = engine.matcher(compiled)
        for token in trie.path(node):
            assert matcher.accept(token)
        bitmask = allocate_bitmask(1, engine.vocab_size)
        matcher.fill(bitmask, 0)
        allowed = set(bitmask_to_bool(bitmask, engine.vocab_size)[0].nonzero().flatten().tolist())
        expected = set(trie.children[node]) | ({tok.eos_token_id} if trie.complete[node] else set())
        assert allowed == expected, f"node {node} path {trie.path(node)}"


def test_masked_sampling_frequencies_match_exact_masked_distribution(tok, tiny49k, scored):
    prompt, _, exact = scored
    n = 600
    res = C.generate(tiny49k, [prompt] * n, Constraint.choices(STRINGS), XGrammarEngine(tok),
                     max_new_tokens=8, sampler=Sampler(SamplerConfig(temperature=1.0)),
                     generator=torch.Generator().manual_seed(0), tokenizer=tok)
    assert all(res.valid)
    for s in STRINGS:
        freq = res.texts.count(s) / n
        q = exact.masked[s]
        sigma = math.sqrt(q * (1 - q) / n)
        assert abs(freq - q) <= 4.5 * sigma + 1e-3, (s, freq, q)


def test_kl_and_tv_vanish_only_on_equal_distributions():
    p = {"a": 0.5, "b": 0.5}
    assert D.kl(p, p) == 0 and D.tv(p, p) == 0
    assert D.kl(p, {"a": 0.9, "b": 0.1}) > 0 and D.tv(p, {"a": 0.9, "b": 0.1}) == pytest.approx(0.4)
    assert D.kl(p, {"a": 1.0}) == math.inf


def test_kl_of_an_unnormalized_distribution_is_not_clamped_to_zero():
    # Gibbs' inequality holds for normalized p and q only; a negative KL must stay visible to the checks on it.
    assert D.kl({"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 1.0}) < 0
    assert D.kl({"a": 1 / 3, "b": 2 / 3}, {"a": 1 / 3, "b": 2 / 3}) == 0.0


def test_unknown_task_name_error_names_the_value_and_the_files_tasks(tmp_path):
    import json

    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([{"name": "t", "question": "?", "strings": ["a"]}]), encoding="utf-8")
    assert [t["name"] for t in load_tasks(path)] == ["t"]  # a user file is used whole
    with pytest.raises(ValueError) as error:
        load_tasks(path, ["yes_no"])
    assert "yes_no" in str(error.value) and "['t']" in str(error.value) and "tasks.json" in str(error.value)
    with pytest.raises(ValueError, match="tasks="):
        load_tasks(path, [])


def test_too_many_tokenizations_raise_clear_error(tok):
    with pytest.raises(ValueError, match="max_nodes"):
        D.build_trie(["Liechtenstein"], D.token_bytes_table(tok), [2], max_nodes=50)

"""Retrofit by self-distillation: the loss, resumable training, the reused-module drafter, checkpoint checks."""
import json

import pytest
import torch

from decodelab.core import engine
from decodelab.core.models import tiny_model
from decodelab.core.transformer import Transformer
from decodelab.mtp import checkpoint as mtp_checkpoint
from decodelab.mtp import distill, shipped
from decodelab.mtp import drafter as mtp_drafter
from decodelab.mtp import retrofit_train as rt

VOCAB = 97


def frozen(seed=0):
    return tiny_model(seed=seed, vocab_size=VOCAB).hf_model


def fake_dataset(trunk, n=6, length=12, top_k=5, seed=0):
    """What `build_distill_set` returns, from the tiny trunk itself (a padded tail in row 0)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (n, length), generator=g)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[0, -3:] = False
    targets = distill.trunk_targets(trunk, tokens, top_k)
    return {"tokens": tokens, "mask": mask, **targets, "hash": "test", "kinds": {}}


def test_kl_loss_is_the_teacher_topk_kl_one_position_later():
    trunk = frozen()
    model = rt.new_module_model(trunk, seed=0)
    data = fake_dataset(trunk)
    scored = torch.zeros(6, 11, dtype=torch.bool)
    scored[1, 4] = True
    got = rt.distill_loss(model, data["tokens"], data["hidden"].float(), data["top_ids"], data["top_logp"], scored)
    with torch.no_grad():
        state = model.head_state(2, data["hidden"].float(), data["tokens"])[1, 4]
        logq = torch.log_softmax(model.unembed(state, 2), -1)
    p = torch.softmax(data["top_logp"][1, 5], -1)  # teacher at position i + 1 = 5, renormalized
    want = (p * (p.log() - logq[data["top_ids"][1, 5].long()])).sum()
    assert torch.allclose(got, want, atol=1e-5)
    ce = rt.distill_loss(model, data["tokens"], data["hidden"].float(), data["top_ids"], data["top_logp"], scored, "ce")
    assert torch.allclose(ce, -logq[data["tokens"][1, 6]], atol=1e-5)


def test_valid_positions_skip_padding_and_the_unlabelled_last_position():
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    assert rt.valid_positions(mask, "kl").tolist() == [[True, True, True, False]]
    assert rt.valid_positions(mask, "ce").tolist() == [[True, True, False, False]]


def test_interrupted_training_resumes_to_the_same_weights(tmp_path):
    spec = rt.RetrofitSpec(steps=5, batch_size=2, warmup=1, loss_fraction=0.5, val_blocks=1)
    trunk = frozen()
    data = fake_dataset(trunk)
    whole = rt.new_module_model(trunk, seed=0)
    rt.train_retrofit(whole, data, spec, run_dir=tmp_path / "whole", save_every=2)
    part = rt.new_module_model(trunk, seed=0)
    first = rt.train_retrofit(part, data, spec, run_dir=tmp_path / "cut", save_every=2, stop_after=3)
    assert first["steps_done"] == 3
    resumed = rt.new_module_model(trunk, seed=0)  # a fresh process: starts from the saved state
    second = rt.train_retrofit(resumed, data, spec, run_dir=tmp_path / "cut", save_every=2)
    assert second["resumed_from"] == 3 and len(second["losses"]) == 5
    for (name, a), b in zip(whole.heads.state_dict().items(), resumed.heads.state_dict().values()):
        assert torch.equal(a, b), name
    untrained = rt.new_module_model(trunk, seed=0)
    assert not torch.equal(untrained.heads[0].proj.weight, resumed.heads[0].proj.weight)


def test_training_leaves_the_frozen_next_token_logits_identical(tmp_path):
    trunk = frozen()
    data = fake_dataset(trunk)
    before = trunk(input_ids=data["tokens"]).logits.detach().clone()
    model = rt.new_module_model(trunk, seed=0)
    rt.train_retrofit(model, data, rt.RetrofitSpec(steps=3, batch_size=2, warmup=1, val_blocks=0), run_dir=tmp_path)
    assert torch.equal(trunk(input_ids=data["tokens"]).logits, before)
    assert torch.equal(model.head_logits(data["tokens"])[0], before)


def test_step_rows_and_scored_positions_are_functions_of_seed_and_step():
    spec = rt.RetrofitSpec(batch_size=3, seed=1)
    assert torch.equal(rt.step_rows(7, 10, spec), rt.step_rows(7, 10, spec))
    epoch = torch.cat([rt.step_rows(s, 9, spec) for s in range(3)])
    assert sorted(epoch.tolist()) == list(range(9))  # one epoch visits every block once
    valid = torch.ones(2, 50, dtype=torch.bool)
    assert torch.equal(rt.scored_positions(4, valid, spec), rt.scored_positions(4, valid, spec))
    assert 0 < int(rt.scored_positions(4, valid, spec).sum()) < 100


@pytest.mark.parametrize("k", [1, 3])
def test_reused_module_drafts_keep_greedy_output(k):
    from decodelab.speculation import decode as speculative

    trunk = frozen()
    with torch.no_grad():
        trunk.model.embed_tokens.weight.mul_(5.0)
    model = rt.new_module_model(trunk, seed=0)
    with torch.no_grad():  # a non-identity module, so the chain's later drafts differ from the first
        for p in model.heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    prompts = [[5, 7, 9, 3, 11], [4, 4, 2], [8] * 9]
    tr = Transformer.from_hf(trunk)
    plain = engine.generate(tr, prompts, max_new_tokens=18, eos_token_ids=[])
    drafter = mtp_drafter.MTPDrafter(model, reuse=True)
    out = speculative.generate(tr, prompts, drafter, k=k, max_new_tokens=18, eos_token_ids=[])
    assert out.tokens == plain.tokens
    assert sum(out.stats.accepted[k:]) == 0 and out.stats.tau >= 1.0


def test_reused_chain_first_draft_equals_the_unchained_draft():
    from decodelab.speculation.drafters import DraftContext

    trunk = frozen()
    model = rt.new_module_model(trunk, seed=0)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    outs = []
    for reuse, k in ((False, 1), (True, 3)):
        d = mtp_drafter.MTPDrafter(model, reuse=reuse)
        d.begin(prompts, max_len=32)
        tokens, lengths = engine.pad_prompts(prompts, torch.device("cpu"))
        with torch.no_grad():
            hidden = model.hidden(tokens)
        d.observe(hidden, lengths, torch.roll(tokens, -1, dims=1))
        outs.append(d.propose(DraftContext(tokens=prompts), k).tokens)
    assert outs[1].shape == (2, 3)
    assert torch.equal(outs[0][:, 0], outs[1][:, 0])


def test_reuse_is_refused_for_independent_heads():
    from decodelab.mtp.model import MTPConfig, MTPModel

    with pytest.raises(ValueError, match="reuse=True"):
        mtp_drafter.MTPDrafter(MTPModel(frozen(), MTPConfig(n_heads=2), frozen_trunk=True), reuse=True)


def saved_module(tmp_path):
    model = rt.new_module_model(frozen(), seed=0)
    mtp_checkpoint.save_checkpoint(model, tmp_path, retrofit_model="tiny")
    return tmp_path


def test_checkpoint_for_another_tokenizer_is_refused_naming_the_file(tmp_path):
    directory = saved_module(tmp_path)
    other = tiny_model(seed=0, vocab_size=VOCAB + 3).hf_model
    with pytest.raises(ValueError, match=r"heads\.safetensors.*vocab_size=97.*vocab_size=100"):
        mtp_checkpoint.load_checkpoint(directory, trunk=other)


def test_half_written_checkpoint_is_refused_naming_the_file(tmp_path):
    directory = saved_module(tmp_path)
    weights = directory / "heads.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="heads.safetensors.*corrupted or half-written"):
        mtp_checkpoint.load_checkpoint(directory, trunk=frozen())


def test_more_heads_than_the_checkpoint_holds_is_refused(tmp_path):
    directory = saved_module(tmp_path)
    with pytest.raises(ValueError, match="n_heads=4 asked of .*mtp_config.json, which holds n_heads=2"):
        mtp_checkpoint.load_checkpoint(directory, trunk=frozen(), n_heads=4)


def test_record_check_catches_changed_weights_and_another_spec(tmp_path):
    directory = saved_module(tmp_path)
    spec = rt.RetrofitSpec()
    record = {"sha256": shipped.sha256_of(directory / "heads.safetensors"), "spec": spec.as_dict(), "model": "tiny",
              "corpus_hash": "abc"}
    (directory / "record.json").write_text(json.dumps(record))
    assert shipped.check_record(directory, spec=spec, model_name="tiny", corpus_hash="abc") == []
    assert "another spec" in " ".join(shipped.check_record(directory, spec=rt.RetrofitSpec(seed=1)))
    assert "for model 'tiny'" in " ".join(shipped.check_record(directory, model_name="smollm2-135m"))
    (directory / "heads.safetensors").write_bytes(b"x" * 10)
    problems = shipped.check_record(directory)
    assert problems and "heads.safetensors has sha256" in problems[0]
    with pytest.raises(ValueError, match="heads.safetensors has sha256"):
        shipped.load_shipped(directory, trunk=frozen())


def test_distillation_pairs_and_packing():
    request, answer = distill.code_edit_pair("f", "def f(x):\n    return x")
    assert "`f` to `f_v2`" in request and answer == "```python\ndef f_v2(x):\n    return x\n```"
    funcs = distill.functions_of("def a():\n    pass\n\ndef b():\n    x = 1\n    y = 2\n    return x\n",
                                 min_lines=3, max_chars=200)
    assert [name for name, _ in funcs] == ["b"]
    assert distill.extraction_pair("One. Two") is None
    blocks = distill.pack([[1] * 3, [2] * 4, [3] * 2, [4] * 9], seq_len=6, n_blocks=5, pad_id=0)
    assert blocks.tolist() == [[1, 1, 1, 0, 0, 0], [2, 2, 2, 2, 3, 3], [4] * 6]


def test_specs_refuse_bad_values_naming_them():
    with pytest.raises(ValueError, match="loss='mse'"):
        rt.RetrofitSpec(loss="mse")
    with pytest.raises(ValueError, match="loss_fraction=0"):
        rt.RetrofitSpec(loss_fraction=0)
    with pytest.raises(ValueError, match="n_blocks=0"):
        distill.DistillData(n_blocks=0)


def test_drafter_rows_compare_like_with_like_and_claim_reads_them():
    from decodelab.mtp import draft_eval, findings
    from decodelab.speculation.drafters import make_drafter

    trunk = frozen()
    model = rt.new_module_model(trunk, seed=0)
    tr = Transformer.from_hf(trunk)
    drafters = {"mtp": lambda: mtp_drafter.MTPDrafter(model, reuse=True), "ngram": lambda: make_drafter("ngram", tr)}
    prompts = {"code_edit": [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8]]}
    rows = draft_eval.drafter_rows(tr, drafters, prompts, [1, 2], k=2, max_new_tokens=6)
    assert [(r["batch"], r["drafter"]) for r in rows] == [(1, "mtp"), (1, "ngram"), (2, "mtp"), (2, "ngram")]
    assert all(r["greedy_match"] and r["tau"] >= 1.0 and len(r["acceptance"]) == 2 for r in rows)
    assert draft_eval.pick(rows, "batch", drafter="mtp", category="code_edit") == 1
    assert draft_eval.pick(rows, "tau", drafter="mtp", category="chat") is None
    record = {"name": "m", "sha256": "0" * 64, "model": "tiny", "spec": rt.RetrofitSpec().as_dict(),
              "distill_set": {"tokens": 1000}, "train_s": 120.0, "data_s": 60.0, "load_average": [1.0, 1.0, 1.0]}
    lines = findings.module_claim({"source": "shipped", "record": record}, rows)
    tau = draft_eval.pick(rows, "tau", drafter="mtp", category="code_edit")
    assert f"tau {tau:.2f}" in lines[1] and "ngram tau" in lines[1]
    assert lines[-1].startswith("Can MTP be retrofitted onto a model trained for one token?")
    with pytest.raises(ValueError, match="k=0"):
        draft_eval.drafter_rows(tr, drafters, prompts, [1], k=0, max_new_tokens=2)


class CharTokenizer:
    """A stand-in tokenizer: one id per character, a trivial chat template."""

    eos_token_id = 2

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        class Out:
            input_ids = [ord(c) % 90 + 3 for c in text]
        return Out()


def test_mixed_sequences_put_a_chat_answer_after_every_fourth_task():
    pairs = [("code_edit", f"r{i}", f"a{i}") for i in range(9)]
    chats = [[7, 7], [8, 8], [9, 9]]
    sequences, kinds = distill.mixed_sequences(CharTokenizer(), pairs, chats)
    assert kinds == ["code_edit"] * 4 + ["chat"] + ["code_edit"] * 4 + ["chat"] + ["code_edit"]
    assert sequences[4] == [7, 7] and sequences[9] == [8, 8]
    assert sequences[0][-1] == CharTokenizer.eos_token_id  # each answer ends its turn
    blocks, used = distill.pack_counted(sequences, seq_len=40, n_blocks=2, pad_id=0)
    assert blocks.shape == (2, 40) and 0 < used < len(sequences)


def test_own_code_requests_are_the_first_code_edits_and_leave_the_teacher_forced_set():
    pairs = [("extraction", "e0", "x"), ("code_edit", "r0", "a0"), ("code_edit", "r1", "a1"),
             ("extraction", "e1", "y"), ("code_edit", "r2", "a2")]
    own, rest = distill.split_own_code(pairs, 2)
    assert [p[1] for p in own] == ["r0", "r1"]
    assert [p[1] for p in rest] == ["e0", "e1", "r2"]  # order kept, no request taught twice
    assert distill.split_own_code(pairs, 0) == ([], pairs)


def test_mixed_sequences_put_the_models_own_code_answers_before_each_task_while_they_last():
    pairs = [("code_edit", f"r{i}", f"a{i}") for i in range(5)]
    own = [[50, 51], [52, 53]]
    sequences, kinds = distill.mixed_sequences(CharTokenizer(), pairs, [[7, 7]], own)
    assert kinds == (["code_edit_own", "code_edit"] * 2 + ["code_edit"] * 2 + ["chat"] + ["code_edit"])
    assert sequences[0] == [50, 51] and sequences[2] == [52, 53] and sequences[6] == [7, 7]
    assert set(kinds) <= set(distill.TASK_KINDS)


def test_more_own_code_answers_than_tasks_are_spread_evenly_and_none_is_dropped():
    pairs = [("code_edit", f"r{i}", f"a{i}") for i in range(3)]
    own = [[50 + i] for i in range(5)]  # ceil(5 / 3) = 2 before each task while they last
    sequences, kinds = distill.mixed_sequences(CharTokenizer(), pairs, [], own)
    assert kinds == ["code_edit_own"] * 2 + ["code_edit"] + ["code_edit_own"] * 2 + ["code_edit"] + \
        ["code_edit_own", "code_edit"]
    assert [s for s, k in zip(sequences, kinds) if k == "code_edit_own"] == own  # in order, all of them


def test_greedy_sequences_are_the_prompt_plus_the_engines_greedy_answer():
    loaded = tiny_model(seed=0, vocab_size=VOCAB)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    got = distill.greedy_sequences(loaded, prompts, 5, batch_size=1)
    for prompt, seq in zip(prompts, got):
        alone = engine.generate(loaded.transformer, [prompt], max_new_tokens=5).tokens[0]
        assert seq == prompt + list(alone) and len(seq) > len(prompt)
    assert distill.greedy_sequences(loaded, prompts, 0, batch_size=1) == []
    with pytest.raises(ValueError, match="code_gen_tokens=-1"):
        distill.DistillData(code_gen_tokens=-1)


def test_held_out_blocks_never_reach_the_training(tmp_path):
    spec = rt.RetrofitSpec(steps=4, batch_size=2, warmup=1, val_blocks=2)
    trunk = frozen()
    data = fake_dataset(trunk)
    changed = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    noise = torch.Generator().manual_seed(9)
    changed["tokens"][-2:] = torch.randint(3, VOCAB, changed["tokens"][-2:].shape, generator=noise)
    changed["hidden"][-2:] = torch.randn(changed["hidden"][-2:].shape).to(changed["hidden"].dtype)
    a, b = rt.new_module_model(trunk, seed=0), rt.new_module_model(trunk, seed=0)
    rt.train_retrofit(a, data, spec, run_dir=tmp_path / "a")
    rt.train_retrofit(b, changed, spec, run_dir=tmp_path / "b")
    for (name, x), y in zip(a.heads.state_dict().items(), b.heads.state_dict().values()):
        assert torch.equal(x, y), name
    train, held = rt.split_blocks(data, spec, max_blocks=3)
    assert torch.equal(train["tokens"], data["tokens"][:3]) and torch.equal(held["tokens"], data["tokens"][4:])
    with pytest.raises(ValueError, match="val_blocks=6"):
        rt.train_retrofit(a, data, rt.RetrofitSpec(val_blocks=6), run_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="val_blocks=64"):
        rt.RetrofitSpec(data=distill.DistillData(n_blocks=64), val_blocks=64)


def test_layer_copy_init_starts_from_the_trunk_layer_and_leaves_the_trunk_frozen(tmp_path):
    trunk = frozen()
    data = fake_dataset(trunk)
    before = trunk(input_ids=data["tokens"]).logits.detach().clone()
    layer_before = {k: v.clone() for k, v in trunk.model.layers[-1].state_dict().items()}
    model = rt.new_module_model(trunk, seed=0, init_layer=-1)
    for name, value in model.heads[0].block.state_dict().items():
        assert torch.equal(value, layer_before[name]), name
    d = model.heads[0].proj.weight.shape[0]
    assert torch.equal(model.heads[0].proj.weight, torch.cat([torch.eye(d), torch.zeros(d, d)], 1))  # W = [I, 0]
    spec = rt.RetrofitSpec(steps=4, batch_size=2, warmup=1, val_blocks=1, init_layer=-1)
    rt.train_retrofit(model, data, spec, run_dir=tmp_path / "whole", save_every=2)
    assert torch.equal(trunk(input_ids=data["tokens"]).logits, before)  # the copy trained, not the trunk's layer
    for name, value in trunk.model.layers[-1].state_dict().items():
        assert torch.equal(value, layer_before[name]), name
    cut = rt.new_module_model(trunk, seed=0, init_layer=-1)
    rt.train_retrofit(cut, data, spec, run_dir=tmp_path / "cut", save_every=2, stop_after=2)
    resumed = rt.new_module_model(trunk, seed=0, init_layer=-1)
    rt.train_retrofit(resumed, data, spec, run_dir=tmp_path / "cut", save_every=2)
    for (name, a), b in zip(model.heads.state_dict().items(), resumed.heads.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="init_layer=7"):
        rt.new_module_model(trunk, seed=0, init_layer=7)


def test_distillation_skips_the_evaluation_workloads_files():
    skip = distill.evaluation_files()
    assert "textwrap.py" in skip and "hand-written" not in skip

    class Corpus:
        root = None
        train_files = sorted(skip)

    assert distill.training_texts(Corpus()) == []


def test_drafter_rows_at_batch_1_pool_prompts_decoded_one_at_a_time():
    # batch1_prompts = 2: both prompts decoded alone, rows in order, acceptance and tau pooled from the counts of
    # the two runs (not averaged rates), and each row still equals plain greedy
    from decodelab.mtp import draft_eval
    from decodelab.speculation.decode import generate as spec_generate
    from decodelab.speculation.drafters import make_drafter

    tr = Transformer.from_hf(frozen())
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8]]
    rows = draft_eval.drafter_rows(tr, {"ngram": lambda: make_drafter("ngram", tr)}, {"code_edit": prompts}, [1],
                                   k=2, max_new_tokens=6, batch1_prompts=2)
    (row,) = rows
    assert row["rows"] == 2 and row["rows_identical"] == 2 and row["greedy_match"]
    alone = [spec_generate(tr, [p], make_drafter("ngram", tr), k=2, max_new_tokens=6).stats for p in prompts]
    assert row["tau"] == sum(s.emitted for s in alone) / sum(s.row_steps for s in alone)
    reached = [sum(v) for v in zip(*(s.reached for s in alone))][:2]
    accepted = [sum(v) for v in zip(*(s.accepted for s in alone))][:2]
    assert reached[0] > 0 and row["acceptance"] == [a / r if r else None for a, r in zip(accepted, reached)]
    with pytest.raises(ValueError, match="batch1_prompts=0"):
        draft_eval.drafter_rows(tr, {}, {"code_edit": prompts}, [1], k=1, max_new_tokens=2, batch1_prompts=0)


def test_prompt_acceptance_pools_counts_over_prompts_decoded_alone_with_an_interval_that_holds_the_rate():
    from decodelab.mtp import draft_eval
    from decodelab.speculation.decode import generate as spec_generate
    from decodelab.speculation.drafters import make_drafter

    tr = Transformer.from_hf(frozen())
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8], [3, 4, 3, 4, 3]]
    got = draft_eval.prompt_acceptance(tr, lambda: make_drafter("ngram", tr), prompts, k=2, max_new_tokens=8)
    alone = [spec_generate(tr, [p], make_drafter("ngram", tr), k=2, max_new_tokens=8).stats for p in prompts]
    assert got["prompts"] == 3 and got["reached"] == [list(s.reached[:2]) for s in alone]
    reached = sum(s.reached[0] for s in alone)
    assert reached > 0 and got["acceptance"][0] == sum(s.accepted[0] for s in alone) / reached
    low, high = got["ci"][0]
    assert 0.0 <= low <= got["acceptance"][0] <= high <= 1.0
    assert got["tau"] == sum(s.emitted for s in alone) / sum(s.row_steps for s in alone)
    with pytest.raises(ValueError, match="prompts is empty"):
        draft_eval.prompt_acceptance(tr, lambda: make_drafter("ngram", tr), [], k=1, max_new_tokens=2)


def test_best_k_reads_the_fastest_draft_length_and_the_claim_reports_it():
    from decodelab.mtp import draft_eval, findings

    def row(k, speedup, tau):
        return {"category": "code_edit", "batch": 1, "rows": 4, "drafter": "mtp", "k": k, "tau": tau,
                "acceptance": [0.4] * k, "speedup": speedup}

    rows = [row(3, 1.20, 1.6), row(1, 1.31, 1.4), row(2, 1.28, 1.5)]
    assert draft_eval.best_k(rows, drafter="mtp", category="code_edit", batch=1)["k"] == 1
    assert draft_eval.best_k(rows, drafter="mtp", category="chat", batch=1) is None
    assert draft_eval.pick(rows, "tau", drafter="mtp", category="code_edit") == 1.6  # the comparison's own k first
    assert draft_eval.pick(rows, "tau", drafter="mtp", category="code_edit", k=2) == 1.5
    record = {"name": "m", "sha256": "0" * 64, "model": "tiny", "spec": rt.RetrofitSpec().as_dict(),
              "distill_set": {"tokens": 1000}, "train_s": 120.0, "data_s": 60.0, "load_average": [1.0, 1.0, 1.0]}
    lines = findings.module_claim({"source": "shipped", "record": record}, rows)
    assert any("fastest draft length at batch 1 is k=1: 1.31x" in line for line in lines), lines


def test_best_k_note_lists_every_draft_length_and_names_the_fastest():
    from decodelab.mtp import draft_eval

    rows = [{"category": "code_edit", "batch": 1, "drafter": "mtp", "k": k, "speedup": s}
            for k, s in ((3, 1.25), (1, 1.27), (2, 1.33))]
    assert (draft_eval.best_k_note(rows, drafter="mtp", category="code_edit", batch=1)
            == "k = 2 of [1, 2, 3] (k = 1: 1.27x, k = 2: 1.33x, k = 3: 1.25x); ")
    assert draft_eval.best_k_note(rows, drafter="mtp", category="chat", batch=1) == ""


def test_a_cached_distill_set_remembers_what_building_it_cost(tmp_path, monkeypatch):
    """The record's data_s must state the build's seconds even when training found the set in the cache."""
    from types import SimpleNamespace

    monkeypatch.setattr(distill, "task_pairs", lambda corpus, data: [])
    monkeypatch.setattr(distill, "content_hash", lambda *args: "key")
    monkeypatch.setattr(distill, "mixed_sequences",
                        lambda tokenizer, pairs, chats, own: ([list(range(3, 11)), list(range(20, 25))], ["chat"] * 2))
    loaded = SimpleNamespace(name="tiny", hf_model=frozen(), tokenizer=SimpleNamespace(pad_token_id=0))
    corpus = SimpleNamespace(corpus_hash="c")
    data = distill.DistillData(seq_len=8, n_blocks=4, chat_prompts=0, code_gen_prompts=0, top_k=4)
    built = distill.build_core_set(loaded, corpus, data, cache_dir=tmp_path)
    again = distill.build_core_set(loaded, corpus, data, cache_dir=tmp_path)
    assert built["cached"] is False and again["cached"] is True
    assert built["build_s"] > 0 and again["build_s"] == built["build_s"]
    assert torch.equal(again["tokens"], built["tokens"]) and torch.equal(again["top_ids"], built["top_ids"])


def test_a_bfloat16_trunk_pass_changes_the_sets_hash_but_not_a_float32_ones_and_keeps_the_teacher_close(
        tmp_path, monkeypatch):
    from types import SimpleNamespace

    # sets cached (and shipped) before the field keep their hash
    assert "trunk_dtype" not in distill.DistillData(trunk_dtype="float32").as_dict()
    assert distill.DistillData(trunk_dtype="bfloat16").as_dict()["trunk_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="trunk_dtype='float16'"):
        distill.DistillData(trunk_dtype="float16")
    monkeypatch.setattr(distill, "task_pairs", lambda corpus, data: [])
    monkeypatch.setattr(distill, "mixed_sequences",
                        lambda tokenizer, pairs, chats, own: ([list(range(3, 40)), list(range(20, 50))], ["chat"] * 2))
    trunk = frozen()
    tokenizer = SimpleNamespace(pad_token_id=0, get_vocab=lambda: {"a": 0})
    loaded = SimpleNamespace(name="tiny", hf_model=trunk, tokenizer=tokenizer)
    corpus = SimpleNamespace(corpus_hash="c")
    sets = {dtype: distill.build_core_set(loaded, corpus, distill.DistillData(seq_len=40, n_blocks=4, chat_prompts=0,
                                                                               code_gen_prompts=0, top_k=4,
                                                                               trunk_dtype=dtype),
                                          cache_dir=tmp_path)
            for dtype in ("float32", "bfloat16")}
    full, half = sets["float32"], sets["bfloat16"]
    assert full["hash"] != half["hash"] and next(trunk.parameters()).dtype == torch.float32  # the model is not cast
    assert torch.equal(full["tokens"], half["tokens"])
    mask = full["mask"]
    assert (full["top_ids"][..., 0] == half["top_ids"][..., 0])[mask].float().mean() >= 0.9
    rel = (full["hidden"].float() - half["hidden"].float()).norm(dim=-1) / full["hidden"].float().norm(dim=-1)
    assert rel[mask].min() > 0 and rel[mask].mean() < 0.05  # a bfloat16 pass, and a close one


def test_the_method_pool_adds_class_methods_dedented_in_source_order_and_leaves_functions_as_they_were():
    source = ("def top(a):\n    x = a\n    \n    return x\n\n"
              "class C:\n    def m(self):\n        y = 1\n        return y\n\n    def short(self):\n        pass\n\n"
              "def last(b):\n    z = b\n    return z\n")
    plain = distill.functions_of(source, min_lines=3, max_chars=200)
    assert [name for name, _ in plain] == ["top", "last"]
    assert plain[0][1] == "def top(a):\n    x = a\n    \n    return x"  # whitespace-only lines kept: hashes hold
    both = distill.functions_of(source, min_lines=3, max_chars=200, methods=True)
    assert [name for name, _ in both] == ["top", "m", "last"]
    assert dict(both)["m"] == "def m(self):\n    y = 1\n    return y"
    assert "def m_v2(self):" in distill.code_edit_pair("m", dict(both)["m"])[1]
    assert "code_pool" not in distill.DistillData(code_pool="functions").as_dict()
    assert distill.DistillData(code_pool="functions+methods").as_dict()["code_pool"] == "functions+methods"
    with pytest.raises(ValueError, match="code_pool='classes'"):
        distill.DistillData(code_pool="classes")


def test_answers_in_bfloat16_come_from_a_bfloat16_copy_and_a_float32_set_keeps_its_hash(tmp_path, monkeypatch):
    from dataclasses import replace
    from types import SimpleNamespace

    assert "answer_dtype" not in distill.DistillData(answer_dtype="float32").as_dict()
    with pytest.raises(ValueError, match="answer_dtype='float16'"):
        distill.DistillData(answer_dtype="float16")
    seen = []

    def answers(loaded, prompts, new_tokens, batch_size, progress=False):
        seen.append(next(loaded.hf_model.parameters()).dtype)
        assert next(iter(loaded.transformer.state_dict().values())).dtype == seen[-1]
        return [p + [5] * new_tokens for p in prompts]

    monkeypatch.setattr(distill, "greedy_sequences", answers)
    monkeypatch.setattr(distill, "task_pairs", lambda corpus, data: [("code_edit", "rename", "a")])
    monkeypatch.setattr(distill, "mixed_sequences", lambda tokenizer, pairs, chats, own: (own, ["code_edit_own"]))
    monkeypatch.setattr("decodelab.workloads.prompts.user_prompt_ids", lambda tokenizer, text: [7, 8, 9])
    loaded = replace(tiny_model(seed=0, vocab_size=VOCAB),
                     tokenizer=SimpleNamespace(pad_token_id=0, get_vocab=lambda: {"a": 0}))
    corpus = SimpleNamespace(corpus_hash="c")
    for dtype in ("float32", "bfloat16"):
        data = distill.DistillData(seq_len=16, n_blocks=2, chat_prompts=0, code_gen_prompts=1, code_gen_tokens=3,
                                   top_k=4, answer_dtype=dtype)
        built = distill.build_core_set(loaded, corpus, data, cache_dir=tmp_path)
        assert built["tokens"][0, :6].tolist() == [7, 8, 9, 5, 5, 5]
    assert seen == [torch.float32, torch.bfloat16]
    assert next(loaded.hf_model.parameters()).dtype == torch.float32  # the loaded model is not cast

"""Notebook 03's experiment drivers: the retrofit experiment, the checkpoint's explicit retrofit_model,
the allocator-trace peak memory the training-cost comparison uses."""
import json

import pytest
import torch

from decodelab.common.timing import PeakMemory
from decodelab.core.models import LoadedModel, tiny_model
from decodelab.mtp import checkpoint as mtp_checkpoint
from decodelab.mtp import data as mtp_data
from decodelab.mtp import experiment as mtp_experiment
from decodelab.mtp import model as mtp


@pytest.fixture
def corpus(source_tree):
    return mtp_data.load_corpus(source_tree, val_fraction=0.25)


def frozen_on(corpus) -> LoadedModel:
    """A tiny random Llama with the corpus's own BPE tokenizer: what `load_model` gives, without a download."""
    tokenizer = mtp_data.train_bpe_tokenizer(corpus, 300)
    tiny = tiny_model(seed=0, vocab_size=tokenizer.get_vocab_size())
    return LoadedModel(name="tiny", hf_model=tiny.hf_model, tokenizer=tokenizer, transformer=tiny.transformer)


def test_retrofit_experiment_trains_each_design_on_the_frozen_model_and_records_its_name(corpus, tmp_path):
    loaded = frozen_on(corpus)
    before = {k: v.clone() for k, v in loaded.hf_model.state_dict().items()}
    out = mtp_experiment.retrofit_experiment(
        "tiny-dir", corpus, styles=["gloeckle", "deepseek"], n_heads=2, seq_len=16, train_tokens=64, val_tokens=32,
        steps=2, batch_size=2, lr=1e-3, seed=0, spec_batch_sizes=[1, 2], spec_new_tokens=4, timing_repeats=2,
        other_repeats=1, checkpoint_root=tmp_path / "checkpoints", loaded=loaded)
    assert out["frozen_bit_identical"] is True
    assert all(torch.equal(before[k], v) for k, v in loaded.hf_model.state_dict().items())
    assert [r["name"] for r in out["results"]] == ["retrofit-gloeckle-2", "retrofit-deepseek-2"]
    assert all(r["eval"]["head_loss"][0] == out["results"][0]["eval"]["head_loss"][0] for r in out["results"])
    assert [(row["model"], row["batch"]) for row in out["draft_rows"]] == [
        ("retrofit-gloeckle-2", 1), ("retrofit-gloeckle-2", 2), ("retrofit-deepseek-2", 1), ("retrofit-deepseek-2", 2)]
    assert all(row["greedy_match"] is True for row in out["draft_rows"])
    assert [row["repeats"] for row in out["draft_rows"]] == [2, 1, 2, 1]  # timing_repeats at batch 1 only
    meta = json.loads((tmp_path / "checkpoints" / "retrofit-gloeckle-2" / "mtp_config.json").read_text())
    assert meta["retrofit_model"] == "tiny-dir" and meta["frozen_trunk"] is True
    reloaded = mtp_checkpoint.load_checkpoint(tmp_path / "checkpoints" / "retrofit-gloeckle-2", trunk=loaded.hf_model)
    assert reloaded.frozen_trunk and reloaded.n_heads == 2


def test_retrofit_experiment_benchmarks_deepseek_only_at_depth_one(corpus):
    out = mtp_experiment.retrofit_experiment(
        "tiny-dir", corpus, styles=["gloeckle", "deepseek"], n_heads=3, seq_len=16, train_tokens=64, val_tokens=32,
        steps=1, batch_size=2, lr=1e-3, seed=0, spec_batch_sizes=[1], spec_new_tokens=4, timing_repeats=1,
        loaded=frozen_on(corpus))
    assert [r["name"] for r in out["results"]] == ["retrofit-gloeckle-3", "retrofit-deepseek-3"]
    assert {row["model"] for row in out["draft_rows"]} == {"retrofit-gloeckle-3"}


def test_checkpoint_names_the_retrofit_model_explicitly(tmp_path):
    frozen = tiny_model(seed=0, vocab_size=97).hf_model
    retrofit = mtp.MTPModel(frozen, mtp.MTPConfig(n_heads=2), frozen_trunk=True)
    with pytest.raises(ValueError, match="retrofit_model=None"):
        mtp_checkpoint.save_checkpoint(retrofit, tmp_path / "a")
    scratch = mtp.build_model(vocab_size=97, d_model=32, n_layers=2, n_heads=2)
    with pytest.raises(ValueError, match="retrofit_model='tiny'"):
        mtp_checkpoint.save_checkpoint(scratch, tmp_path / "b", retrofit_model="tiny")


def test_allocator_peak_memory_counts_a_tensor_the_block_allocates():
    with PeakMemory("cpu", how="allocator") as memory:
        block = torch.ones(1 << 20, dtype=torch.float32)  # 4 MiB
        del block
    assert memory.how == "cpu_allocator_trace"
    assert memory.peak_bytes >= 4 << 20
    with pytest.raises(ValueError, match="how='rss'"):
        PeakMemory("cpu", how="rss")

"""Notebook 05's experiment helpers: the vote-accuracy table of a set of pools, the per-row generators."""
import torch

from decodelab.common.seeding import row_generator
from decodelab.consistency.experiment import Pools, accuracy_vs_n
from decodelab.consistency.votes import vote_accuracy_vs_n


def _pools():
    answers = [[5, 5, 3, None], [1, 2, 2, 2], [None, None, 7, 7]]
    logprobs = [[-1.0, -2.0, -0.5, -3.0], [-0.1, -4.0, -4.0, -4.0], [-1.0, -1.0, -2.0, -2.5]]
    lengths = [[4, 5, 2, 6], [3, 3, 3, 3], [8, 8, 4, 5]]
    return Pools(truths=[5, 2, 7], answers=answers, logprobs=logprobs, lengths=lengths, texts=[[""] * 4] * 3,
                 greedy=[5, 1, None], greedy_lengths=[4, 3, 8], seconds=0.0, new_tokens=0)


def test_accuracy_vs_n_is_the_majority_then_the_weighted_table():
    pools = _pools()
    rows = accuracy_vs_n(pools, [1, 2, 4], n_subsets=30, seed=3)
    majority = vote_accuracy_vs_n(pools.answers, pools.truths, [1, 2, 4], lengths=pools.lengths, n_subsets=30,
                                  seed=3, vote="majority")
    weighted = vote_accuracy_vs_n(pools.answers, pools.truths, [1, 2, 4], weights=pools.weights(),
                                  lengths=pools.lengths, n_subsets=30, seed=3, vote="weighted")
    assert rows == majority + weighted
    assert [r["vote"] for r in rows] == ["majority"] * 3 + ["weighted"] * 3


def test_row_generators_do_not_depend_on_the_batch():
    """Sample s of problem p draws the same numbers whether it is decoded alone or in a batch."""
    alone = torch.rand(3, generator=row_generator(0, 2, 1))
    batch = [row_generator(0, p, s) for p in range(3) for s in range(2)]
    assert torch.equal(torch.rand(3, generator=batch[2 * 2 + 1]), alone)

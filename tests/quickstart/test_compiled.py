"""Compiled static step vs eager: the comparison's bookkeeping (the step's own token identity is tested in core)."""
import pytest

from decodelab.quickstart.compiled import check_compile_args, compiled_vs_eager


@pytest.mark.parametrize("kwargs, word", [(dict(batch_sizes=[0], max_new_tokens=4, repeats=1), "compile_batch_sizes"),
                                          (dict(batch_sizes=[1], max_new_tokens=0, repeats=1), "max_new_tokens"),
                                          (dict(batch_sizes=[1], max_new_tokens=4, repeats=0), "repeats")])
def test_bad_arguments_name_the_parameter(kwargs, word):
    with pytest.raises(ValueError, match=word):
        check_compile_args(**kwargs)


@pytest.mark.slow
def test_compiled_and_eager_decode_the_same_tokens_and_both_are_timed(tiny):
    out = compiled_vs_eager(tiny, [[5, 6, 7], [9, 3]], [1, 2], max_new_tokens=4, repeats=1)
    assert [r["batch"] for r in out["rows"]] == [1, 2]
    for row in out["rows"]:
        assert row["identical_rows"] == row["rows"]
        assert row["new_tokens"] == 4 * row["batch"]
        assert row["eager_s"] > 0 and row["compiled_s"] > 0 and row["compile_s"] > 0
        assert row["speedup"] == pytest.approx(row["eager_s"] / row["compiled_s"])
    assert out["status"]["compile_requested"] is True and "reason" in out["status"]

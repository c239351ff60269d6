"""Fixtures the sampler tests share."""
import pytest


@pytest.fixture(params=["kernel", "python"])
def draw_path(request, monkeypatch):
    """Run a test through the C draw (draw_kernel.c) and through the torch and numpy searches."""
    from decodelab.core import draw

    if request.param == "python":
        real = draw.native.load
        monkeypatch.setattr(draw.native, "load", lambda name: None if name == "draw_kernel" else real(name))
    elif draw.native.compiler() is None:
        pytest.skip("no C compiler here: only the Python path runs")
    return request.param

"""A small stand-in for the standard library: 40 modules in 4 packages, with the corpus cache in tmp_path."""
import pytest


@pytest.fixture
def source_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "lib"
    for i in range(40):
        package = root / f"pkg{i % 4}"
        package.mkdir(parents=True, exist_ok=True)
        (package / f"mod{i}.py").write_text(f"def function_{i}(value):\n    return value + {i}\n" * (i + 1))
    return root

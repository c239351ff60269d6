"""Where the suite's files live: the checkout (notebooks/, results/) and its data/ folder.

`DECODELAB_DATA` points the data folder elsewhere, so a non-editable install can read a checkout's data/.
"""
from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The checkout holding lib/decodelab (three levels above this module's package)."""
    return Path(__file__).resolve().parents[3]


def data_dir() -> Path:
    """data/ of the checkout, or $DECODELAB_DATA when set."""
    return Path(os.environ.get("DECODELAB_DATA") or repo_root() / "data")


def data_file(name: str) -> Path:
    """A shipped data file by name: data_dir() / name."""
    return data_dir() / name


def resolve_path(path, *, name: str) -> Path:
    """A data file given by a parameter: absolute, or relative to the working directory, else to the
    repository root (notebooks run with notebooks/ as their working directory, users type paths from the
    root). Raises ValueError naming the parameter and the places tried when the file is missing."""
    given = Path(path)
    tried = [given] if given.is_absolute() else [Path.cwd() / given, repo_root() / given]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    raise ValueError(f"{name}={str(path)!r} is not a file (looked for {', '.join(str(t) for t in tried)})")

"""Small C kernels next to their Python callers, compiled on first use and loaded with ctypes.

    lib = native.load("nucleus_kernel")   # ctypes.CDLL, or None where no C compiler works here

A kernel is one C file beside this module (``<name>.c``, plain C99 with no Python or torch headers, GCC and
clang vector types or the compiler's own intrinsics at most, so a build takes about a second). It is compiled
with the platform's C compiler (``$CC``, else Python's configured one, else ``cc``) at ``-O3`` (no ``-march``:
the library may be shared between hosts; a kernel that needs an instruction set names it in a target attribute
and checks the CPU at run time; one that needs more flags names them in ``EXTRA_FLAGS``) into a cache folder,
``$DECODELAB_NATIVE_CACHE`` or ``~/.cache/decodelab/native``, under a name holding the source's and the
flags' hash, so an edited kernel is rebuilt and a built one is reused by every later process. Where the build
fails ``load`` warns once and returns None, and the caller keeps its other path (the kernels compute what
that path computes, to the precision the caller states; tests check the two agree).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# these kernels share their rows among OpenMP threads: linked to libgomp.so.1, they use the runtime torch has
# already loaded (one thread pool, torch.set_num_threads applies)
# (the norm and RoPE kernels round as torch's separate ops do: no fused multiply-adds)
EXTRA_FLAGS = {**{name: ("-fopenmp",) for name in ("linear_kernel", "nucleus_kernel", "draw_kernel", "amx_kernel")},
               **{name: ("-fopenmp", "-ffp-contract=off") for name in ("norm_kernel", "rope_kernel")}}


def cache_dir() -> Path:
    return Path(os.environ.get("DECODELAB_NATIVE_CACHE") or Path.home() / ".cache" / "decodelab" / "native")


def compiler() -> list[str] | None:
    """The C compiler command, or None where none is installed."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    return cc if cc and shutil.which(cc[0]) else None


def library_path(name: str) -> Path:
    source = (_HERE / f"{name}.c").read_bytes()
    digest = hashlib.sha256(source + sys.platform.encode() + " ".join(EXTRA_FLAGS.get(name, ())).encode())
    digest = digest.hexdigest()[:16]
    return cache_dir() / f"{name}-{digest}.so"


def build(name: str) -> Path:
    """Compile `<name>.c` into the cache (atomically: a concurrent build never sees half a file) -> path.
    Raises RuntimeError with the compiler's message when it fails."""
    target = library_path(name)
    if target.exists():
        return target
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [*cc, "-O3", "-fopenmp-simd", *EXTRA_FLAGS.get(name, ()), "-std=c99", "-shared", "-fPIC",
               str(_HERE / f"{name}.c"), "-o", str(partial), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(partial, target)
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel `name` (built on first use), or None with a warning where it cannot be built."""
    try:
        return ctypes.CDLL(str(build(name)))
    except (OSError, RuntimeError) as error:
        warnings.warn(f"decodelab: the C kernel {name}.c is unavailable ({error}); using the slower Python path",
                      RuntimeWarning, stacklevel=2)
        return None


"""C kernels for the CPU, compiled with the system's gcc on first use and called through ctypes.

Each `NAME.c` here builds into `NAME-<hash of source and flags>.so` in a cache folder
(`LLMWORKER_KERNEL_CACHE`, default ~/.cache/llm-worker; a folder under the temp dir where
that cannot be written), once per source version; a build
goes to a temporary name and is renamed into place, so concurrent workers never load half a
file. `load()` returns None where a kernel cannot run here (no AVX2/FMA/F16C, no compiler):
callers then take their torch path. The kernels use OpenMP; torch has loaded its libgomp
first, so they share torch's thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_NEEDS = {"avx2", "fma", "f16c"}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled `name.c`, or None where it cannot be built or run."""
    import torch  # noqa: F401  (its libgomp must be in the process before ours is resolved)

    if not _NEEDS <= _cpu_flags():
        return None
    source = Path(__file__).with_name(f"{name}.c")
    tag = hashlib.sha256(source.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    for cache in _cache_dirs():
        so = cache / f"{name}-{tag}.so"
        if so.exists() or _build(source, so):
            return ctypes.CDLL(str(so))
    return None


def _cache_dirs() -> list[Path]:
    """The configured folder, then one under the temp dir (for a read-only home)."""
    first = Path(os.environ.get("LLMWORKER_KERNEL_CACHE", Path.home() / ".cache" / "llm-worker"))
    return [first, Path(tempfile.gettempdir()) / f"llm-worker-kernels-{os.getuid()}"]


def _build(source: Path, so: Path) -> bool:
    tmp = None
    try:
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        subprocess.run([os.environ.get("CC", "gcc"), *_FLAGS, str(source), "-o", tmp],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, so)
        return True
    except (OSError, subprocess.SubprocessError):
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        return False

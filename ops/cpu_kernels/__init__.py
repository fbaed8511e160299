"""C kernels for the CPU, compiled with the system's gcc on first use and called through ctypes.

The machines this runs on differ (AVX2-only Zen 3; AVX-512 with VNNI on Zen 4), so each
kernel is built for the best instruction set the CPU has (`isa()`), one of `ISAS`:

    avx2          AVX2 + FMA + F16C (the minimum; without it `load()` returns None)
    avx2-vnni     + AVX-VNNI (256-bit vpdpbusd: Alder Lake, Zen 5)
    avx512        + AVX-512 F/BW/VL/DQ
    avx512-vnni   + AVX-512 VNNI (Ice Lake, Zen 4)

The sources pick their code paths with the compiler's macros (`__AVX512F__`,
`__AVX512VNNI__`, `__AVXVNNI__`). Each `NAME.c` builds into `NAME-<isa>-<hash>.so`, the hash
over every source here, the flags and the ISA, in a cache folder (`LLMWORKER_KERNEL_CACHE`,
default ~/.cache/llm-worker; a folder under the temp dir where that cannot be written): a cache
shared by machines of different ISAs never hands one a binary built for another. A build goes
to a temporary name and is renamed into place, so concurrent workers never load half a file.
The kernels use OpenMP; torch has loaded its libgomp first, so they share torch's thread pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

# -ffp-contract=off: no FMA the source does not write, so every ISA's build of a kernel
# rounds the same way where its arithmetic is written the same way.
_COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# Best first: the flags each ISA builds with, and the /proc/cpuinfo flags it needs.
ISAS: dict[str, tuple[list[str], set[str]]] = {
    "avx512-vnni": ([*_AVX512, "-mavx512vnni"],
                    {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
    "avx512": (_AVX512, {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2-vnni": ([*_AVX2, "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}),
    "avx2": (_AVX2, {"avx2", "fma", "f16c"}),
}
_forced: str | None = None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def supported_isas() -> list[str]:
    """The ISAs this CPU can run, best first (empty: no kernel can run here)."""
    flags = _cpu_flags()
    return [name for name, (_, needs) in ISAS.items() if needs <= flags]


def isa() -> str | None:
    """The ISA the kernels are built for: the best this CPU has, unless `force_isa` chose."""
    if _forced is not None:
        return _forced
    best = supported_isas()
    return best[0] if best else None


def force_isa(name: str | None) -> None:
    """Build and load the kernels for `name` (one this CPU supports) from now on; None goes back
    to the best. For tests and benchmarks that compare the paths on one machine: libraries
    already loaded by callers keep their build, so set this before the first kernel loads."""
    global _forced
    if name is not None and name not in supported_isas():
        raise ValueError(f"ISA {name!r} is not one this CPU supports ({', '.join(supported_isas()) or 'none'})")
    _forced = name
    load.cache_clear()


@contextlib.contextmanager
def forced_isa(name: str | None) -> Iterator[None]:
    """`force_isa(name)` for the block, then back to the best (None: nothing forced). For a
    benchmark run in a fresh process, whose kernels first load inside the block."""
    if name is None:
        yield
        return
    force_isa(name)
    try:
        yield
    finally:
        force_isa(None)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled `name.c` for `isa()`, or None where it cannot be built or run."""
    import torch  # noqa: F401  (its libgomp must be in the process before ours is resolved)

    target = isa()
    if target is None:
        return None
    folder = Path(__file__).parent
    source = folder / f"{name}.c"
    flags = build_flags()
    digest = hashlib.sha256(" ".join([target, *flags]).encode())
    for path in sorted(folder.glob("*.[ch]")):  # a kernel may #include another
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for cache in _cache_dirs():
        so = cache / f"{name}-{target}-{digest.hexdigest()[:16]}.so"
        if so.exists() or _build(source, so, flags):
            return ctypes.CDLL(str(so))
    return None


def address(buf) -> int:
    """Where a C-contiguous, writable buffer's data starts (a numpy array, an array.array; it
    raises TypeError for any other): what a kernel's pointer argument takes. Cheaper than
    numpy's `a.ctypes.data`, which builds a Python-level helper object each time, a cost
    that a batch-1 step's Python pays several times in caches its native call has swept."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def build_flags() -> list[str]:
    """gcc's flags for a kernel built for `isa()` (which must not be None)."""
    return [*_COMMON, *ISAS[isa()][0]]


def build(source: Path, so: Path, extra_flags: Sequence[str] = ()) -> bool:
    """Compiles `source` (a kernel's .c, of this checkout or another) into `so` with
    `build_flags()` (and `extra_flags`, e.g. a benchmark's -D); False where it cannot."""
    return _build(source, so, [*build_flags(), *extra_flags])


def _cache_dirs() -> list[Path]:
    """The configured folder, then one under the temp dir (for a read-only home)."""
    first = Path(os.environ.get("LLMWORKER_KERNEL_CACHE", Path.home() / ".cache" / "llm-worker"))
    return [first, Path(tempfile.gettempdir()) / f"llm-worker-kernels-{os.getuid()}"]


def _build(source: Path, so: Path, flags: list[str]) -> bool:
    tmp = None
    try:
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        subprocess.run([os.environ.get("CC", "gcc"), *flags, str(source), "-o", tmp],
                       check=True, capture_output=True, timeout=180)
        os.replace(tmp, so)
        return True
    except (OSError, subprocess.SubprocessError):
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        return False

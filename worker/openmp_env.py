"""OpenMP's wait policy for a CPU worker's compute threads, chosen before torch loads.

libgomp reads its settings once, when torch's import loads it. By default a thread that
finishes its share of a parallel region spins ~300,000 pauses (milliseconds) before it
sleeps. The C kernels run a decode step as one parallel region (ops/cpu_decoder.py), and
between two steps the engine thread runs the step's Python alone: its OpenMP partner spins
through that gap on a core that a served worker's event loop, gRPC's threads and the
client need, and the gap is when their per-token work comes. With OMP_WAIT_POLICY=PASSIVE
the partner sleeps instead and is woken when the next step's region begins (the work
sharing of ops/cpu_kernels/workshare.h hands a late partner's items to the engine thread).
Served on this project's 2-core machines (BENCHMARKS.md, session 20): one stream 1.05x
greedy and 1.08x sampled, 64 streams 1.00x and 1.05x, a long prompt's time to first
token 1.02x; never slower.

The torch path runs each op as its own region, hundreds a step, and a sleeping partner
makes each begin with a wake-up: 0.54x there. So the default is set only where the C
kernels will run (not `--kernels torch`, not a CUDA device, a CPU with their minimum ISA
and a C compiler), and never over the operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import MutableMapping
from pathlib import Path

# ops/cpu_kernels' minimum ISA (its "avx2" build), as /proc/cpuinfo names the flags.
_C_KERNEL_FLAGS = {"avx2", "fma", "f16c"}


def _cpu_flags() -> set[str]:
    # As ops.cpu_kernels reads them; not imported from there: `ops` loads torch on import,
    # and this must run before torch loads.
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def c_kernels_will_run(kernels: str, device: str) -> bool:
    """Whether this process's model will run on the CPU's C kernels (as far as can be told
    before torch loads: `--kernels`, `--device`, the CPU's flags, a compiler)."""
    if kernels == "torch" or device.startswith("cuda"):
        return False
    return _C_KERNEL_FLAGS <= _cpu_flags() and shutil.which(os.environ.get("CC", "gcc")) is not None


def set_default_wait_policy(kernels: str, device: str,
                            environ: MutableMapping[str, str] = os.environ) -> str | None:
    """OMP_WAIT_POLICY=PASSIVE in `environ` where the C kernels will run and nothing chose
    otherwise; returns what it set (None: left alone, also once torch has loaded, when it
    could no longer take effect)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ or "torch" in sys.modules:
        return None
    if not c_kernels_will_run(kernels, device):
        return None
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"

"""The decode attention kernel's vector reductions against the scalar ones they replaced
(ops/cpu_kernels/paged_attention.c, simd.h): `hsum8x8` must give every vector hsum8's bits
(eight keys' dot products are reduced together), and `row_max` the scalar fold's maximum (a
chunk's softmax subtracts it). A request's logits keep their bits only if these hold.

The kernels are built into a small test library that includes the kernel source.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import numpy as np
import pytest

from ops import cpu_kernels

KERNELS = Path(cpu_kernels.__file__).parent

SOURCE = r"""
#include "paged_attention.c"

/* out[r] = hsum8x8's lane r and ref[r] = hsum8 of v[8r .. 8r + 7], for n groups of 8. */
void t_hsum(const float *v, int n, float *out, float *ref) {
    for (int g = 0; g < n; g++) {
        __m256 x[8];
        for (int u = 0; u < 8; u++) {
            x[u] = _mm256_loadu_ps(v + 64 * g + 8 * u);
            ref[8 * g + u] = hsum8(x[u]);
        }
        _mm256_storeu_ps(out + 8 * g, hsum8x8(x));
    }
}

/* row_max, and the scalar fold it replaced. */
void t_max(const float *sc, int64_t n, float *got, float *want) {
    *got = row_max(sc, n);
    float mx = sc[0];
    for (int64_t j = 1; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
    *want = mx;
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if cpu_kernels.isa() is None:
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    folder = tmp_path_factory.mktemp("reductions")
    src, so = folder / "reductions.c", folder / "reductions.so"
    src.write_text(SOURCE)
    assert cpu_kernels.build(src, so, ["-I", str(KERNELS)]), "the test library did not build"
    lib = ctypes.CDLL(str(so))
    p = ctypes.c_void_p
    lib.t_hsum.argtypes = [p, ctypes.c_int, p, p]
    lib.t_max.argtypes = [p, ctypes.c_int64, p, p]
    return lib


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def test_hsum8x8_has_hsum8s_bits(lib) -> None:
    """Mixed signs and magnitudes within a few decades, so that another order of the
    additions rounds differently (checked: a left-to-right sum differs in many groups), and
    some huge and tiny values and zeros."""
    rng = np.random.default_rng(0)
    n = 4000
    v = (rng.standard_normal(64 * n) * 10.0 ** rng.uniform(-3, 3, 64 * n)).astype(np.float32)
    v[rng.random(64 * n) < 0.02] *= np.float32(1e30)
    v[rng.random(64 * n) < 0.05] = 0.0
    out, ref = np.empty(8 * n, np.float32), np.empty(8 * n, np.float32)
    lib.t_hsum(v.ctypes.data, n, out.ctypes.data, ref.ctypes.data)
    assert np.array_equal(_bits(out), _bits(ref))
    in_order = v.reshape(-1, 8).astype(np.float32)
    naive = np.zeros(len(in_order), np.float32)
    for i in range(8):  # float32 additions left to right
        naive = (naive + in_order[:, i]).astype(np.float32)
    assert (_bits(naive) != _bits(ref)).mean() > 0.3, "the data cannot tell orders apart"


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 100, 1000, 4001])
def test_row_max_is_the_scalar_folds(lib, n) -> None:
    rng = np.random.default_rng(n)
    got, want = ctypes.c_float(), ctypes.c_float()

    def check(sc: np.ndarray) -> None:
        sc = np.ascontiguousarray(sc, dtype=np.float32)
        lib.t_max(sc.ctypes.data, len(sc), ctypes.byref(got), ctypes.byref(want))
        g, w = got.value, want.value
        if w != w:  # NaN (only where the first score is): the same NaN
            assert struct.pack("f", g) == struct.pack("f", w)
        elif w == 0.0:  # a zero of either sign may come back; z - 0 = z - (-0)
            assert g == 0.0
        else:
            assert struct.pack("f", g) == struct.pack("f", w)

    for _ in range(50):
        check(rng.standard_normal(n) * 100)
    ties = np.full(n, 3.5, np.float32)
    check(ties)
    zeros = rng.choice(np.array([0.0, -0.0, -1.0], np.float32), n)
    check(zeros)
    with_nan = rng.standard_normal(n).astype(np.float32)
    with_nan[rng.integers(0, n)] = np.nan  # a NaN score is skipped, as the fold skips it
    check(with_nan)
    with_nan[0] = np.nan  # ... unless it is the first: then the fold keeps it
    check(with_nan)
    check(np.array([-np.inf] * (n - 1) + [-1e30], np.float32))

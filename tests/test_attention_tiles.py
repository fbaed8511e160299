"""The decode attention kernel's tile path for every head size it takes (64, and multiples of
64 such as Llama 3's 128: ops/cpu_kernels/paged_attention.c) against its key-by-key path: the
same bits, so a model's tokens do not depend on which path its head size takes. The kernel
source is built twice into a small test library, once with `-DATTN_PER_KEY` (the key-by-key
arithmetic the tiles reproduce), and a run of rows (a lone decode row, a verification step's
rows, a prefill chunk's) is attended whole and chunk by chunk, over float32 and float16
caches, with grouped-query heads, and with sliding windows that start inside a tile.
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import numpy as np
import pytest

from ops import cpu_kernels

KERNELS = Path(cpu_kernels.__file__).parent

SOURCE = r"""
#include <stdlib.h>
#include "paged_attention.c"

/* Rows 0..R-1 of one request (row r over L0 + r keys, every row the same block table; with
 * a window, the last `window` of them) attended as the fused decoder attends a run: whole,
 * or its chunks one after another. */
int t_run(const float *q, const void *k, const void *v, int half, int bs, int hkv, int hq, int D,
          const int64_t *tables, int max_blocks, int64_t L0, int R, int chunked, float scale, float *out,
          int64_t window) {
    int64_t rows[ATTN_ROWS], lens[ATTN_ROWS];
    for (int r = 0; r < R; r++) rows[r] = r, lens[r] = L0 + r;
    attn_args a = {q, (size_t)hq * D, k, v, half, bs, hkv, hq, D, rows, tables, lens, max_blocks, R,
                   scale, out, (size_t)hq * D, NULL, NULL, window};
    const int64_t max_len = attention_check(&a);
    if (max_len < 0) return (int)max_len;
    void *parts = NULL;
    if (posix_memalign(&parts, 64, sizeof(float) * attention_parts(&a))) return -3;
    a.parts = parts;
    a.pending = calloc((size_t)R, sizeof(atomic_int));
    float *scratch = malloc(sizeof(float) * attention_scratch(&a, max_len));
    if (!a.pending || !scratch) return -3;
    if (chunked)
        for (int c = 0; c < ATTN_CHUNKS; c++) attention_rows_chunk(&a, max_len, 0, R, c, scratch);
    else
        attention_rows(&a, max_len, 0, R, scratch);
    free(parts);
    free(a.pending);
    free(scratch);
    return 0;
}
"""

BLOCK = 16


def _build(folder: Path, name: str, flags: list[str]) -> ctypes.CDLL:
    src, so = folder / f"{name}.c", folder / f"{name}.so"
    src.write_text(SOURCE)
    assert cpu_kernels.build(src, so, ["-I", str(KERNELS), *flags]), f"the {name} test library did not build"
    lib = ctypes.CDLL(str(so))
    p, i32 = ctypes.c_void_p, ctypes.c_int
    lib.t_run.argtypes = [p, p, p, i32, i32, i32, i32, i32, p, i32, ctypes.c_int64, i32, i32, ctypes.c_float, p,
                          ctypes.c_int64]
    lib.t_run.restype = i32
    return lib


# The best ISA here and AVX2, where this CPU has them: the AVX2-only machines' build is
# checked on an AVX-512 one too.
ISAS = list(dict.fromkeys(cpu_kernels.supported_isas()[:1] + [i for i in cpu_kernels.supported_isas() if i == "avx2"]))


@pytest.fixture(scope="module", params=ISAS or [None])
def libs(request, tmp_path_factory):
    if request.param is None:
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    cpu_kernels.force_isa(request.param)
    try:
        folder = tmp_path_factory.mktemp(f"tiles-{request.param}")
        return _build(folder, "tiles", []), _build(folder, "per_key", ["-DATTN_PER_KEY"])
    finally:
        cpu_kernels.force_isa(None)


def _case(D: int, hq: int, hkv: int, L0: int, R: int, half: bool, seed: int):
    rng = np.random.default_rng(seed)
    L = L0 + R - 1
    blocks = -(-L // BLOCK)
    num_blocks = blocks + 3
    dtype = np.float16 if half else np.float32
    k = rng.standard_normal((num_blocks, BLOCK, hkv, D)).astype(dtype)
    v = rng.standard_normal((num_blocks, BLOCK, hkv, D)).astype(dtype)
    table = rng.permutation(num_blocks)[:blocks].astype(np.int64)
    q = rng.standard_normal((R, hq * D)).astype(np.float32)
    return q, k, v, table


def _run(lib, q, k, v, table, D, hq, hkv, L0, R, half, chunked, window=0) -> np.ndarray:
    out = np.zeros_like(q)
    tables = np.ascontiguousarray(np.tile(table, (R, 1)))
    rc = lib.t_run(q.ctypes.data, k.ctypes.data, v.ctypes.data, int(half), BLOCK, hkv, hq, D, tables.ctypes.data,
                   tables.shape[1], L0, R, int(chunked), 1.0 / np.sqrt(D), out.ctypes.data, window)
    assert rc == 0
    return out


def _reference(q, k, v, table, D, hq, hkv, L0, R, window=0) -> np.ndarray:
    keys = k.astype(np.float64)[table].reshape(-1, hkv, D)
    vals = v.astype(np.float64)[table].reshape(-1, hkv, D)
    out = np.zeros((R, hq, D))
    for r in range(R):
        n = L0 + r
        j0 = max(0, n - window) if window else 0
        for h in range(hq):
            s = keys[j0:n, h // (hq // hkv)] @ q[r, h * D:(h + 1) * D].astype(np.float64) / np.sqrt(D)
            w = np.exp(s - s.max())
            out[r, h] = w @ vals[j0:n, h // (hq // hkv)] / w.sum()
    return out.reshape(R, hq * D)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_tiles_give_the_key_by_key_bits(libs, D) -> None:
    tiles, per_key = libs
    cases = itertools.product([(8, 2), (4, 4)], [1, 9, 40, 301], [1, 3, 8], [False, True], [False, True])
    for i, ((hq, hkv), L0, R, half, chunked) in enumerate(cases):
        q, k, v, table = _case(D, hq, hkv, L0, R, half, seed=1000 * D + i)
        got = _run(tiles, q, k, v, table, D, hq, hkv, L0, R, half, chunked)
        want = _run(per_key, q, k, v, table, D, hq, hkv, L0, R, half, chunked)
        where = f"D {D}, heads {hq}/{hkv}, {L0} keys, {R} rows, float16 {half}, chunked {chunked}"
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), where
        # both are attention (float32 arithmetic against a float64 reference)
        np.testing.assert_allclose(got, _reference(q, k, v, table, D, hq, hkv, L0, R), rtol=0, atol=2e-5,
                                   err_msg=where)


@pytest.mark.parametrize("D", [64, 128])
def test_tiles_give_the_key_by_key_bits_in_a_window(libs, D) -> None:
    """Windows of 7 and 37 keys over 40 and 301 (each row's first key inside a tile, the rows
    of a run a key apart), and one of 500 that no row outgrows: the tiles' bits, and attention
    over the last `window` keys of each row alone."""
    tiles, per_key = libs
    cases = itertools.product([7, 37, 500], [40, 301], [1, 8], [False, True], [False, True])
    for i, (window, L0, R, half, chunked) in enumerate(cases):
        q, k, v, table = _case(D, 8, 2, L0, R, half, seed=7000 * D + i)
        got = _run(tiles, q, k, v, table, D, 8, 2, L0, R, half, chunked, window)
        want = _run(per_key, q, k, v, table, D, 8, 2, L0, R, half, chunked, window)
        where = f"D {D}, window {window}, {L0} keys, {R} rows, float16 {half}, chunked {chunked}"
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), where
        np.testing.assert_allclose(got, _reference(q, k, v, table, D, 8, 2, L0, R, window), rtol=0, atol=2e-5,
                                   err_msg=where)
        if window == 500:  # a window no row outgrows is no window, to the bit
            assert np.array_equal(got, _run(tiles, q, k, v, table, D, 8, 2, L0, R, half, chunked)), where

"""The Triton paged-attention kernel against `paged_attention_ref`.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so those cases are small. Caches are random everywhere
and block tables are shuffled, with their unused columns pointing at other
random blocks, so reading a wrong page or a position past seq_len shows up as
a mismatch rather than a harmless zero.
"""

from __future__ import annotations

import pytest
import torch

from ops.attention import paged_attention_ref
from tests.helpers import kernel_device, requires_cuda, requires_triton

pytestmark = requires_triton


def _attn():
    from ops.attention_triton import paged_attention_triton

    return paged_attention_triton


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    spare_blocks: int = 7,
    table_slack: int = 2,
) -> dict:
    """specs: (q_len, seq_len) per request. Returns the kernel's arguments on kernel_device().

    Each request's pages are a random subset of a shuffled pool; table columns
    past its last page hold other random (valid) block ids.
    """
    dev = kernel_device()
    g = torch.Generator().manual_seed(seed)
    pages = [(s + block_size - 1) // block_size for _, s in specs]
    num_blocks = sum(pages) + spare_blocks
    width = max(pages) + table_slack
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(specs), width), generator=g)
    used = 0
    for r, n in enumerate(pages):
        tables[r, :n] = perm[used : used + n]
        used += n
    q_lens = torch.tensor([ql for ql, _ in specs])
    num_tokens = int(q_lens.sum())
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return {
        "q": torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dev, dtype),
        "k_cache": torch.randn(cache_shape, generator=g).to(dev, dtype),
        "v_cache": torch.randn(cache_shape, generator=g).to(dev, dtype),
        "block_tables": tables.to(dev, torch.int32),
        "seq_lens": torch.tensor([s for _, s in specs], device=dev),
        "query_start_loc": torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(dev),
        "max_query_len": int(q_lens.max()),
        "max_seq_len": max(s for _, s in specs),
        "scale": head_dim**-0.5,
    }


def reference(args: dict) -> torch.Tensor:
    """paged_attention_ref on float32 copies of the inputs."""
    up = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k, v in args.items()}
    return paged_attention_ref(**up)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


# Decodes (one at seq_len 1), a prefill chunk over a paged prefix, a whole prefill.
MIXED = [(1, 1), (1, 37), (9, 50), (1, 70), (20, 20), (1, 16)]

CONFIGS = {  # (Hq, Hkv, head_dim, block_size)
    "mha": (4, 4, 32, 16),
    "smollm2": (9, 3, 64, 32),
    "gqa4": (8, 2, 16, 16),
}


@pytest.mark.parametrize("num_splits", [1, 4, None])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_mixed_batch_float32(config: str, num_splits: int | None) -> None:
    """Mixed decode / chunked-prefill / prefill batch, float32: matches within 1e-4 (abs and rel),
    with split-K off, forced on (some splits then start past short contexts), and by heuristic."""
    hq, hkv, d, bs = CONFIGS[config]
    args = make_batch(MIXED, hq, hkv, d, bs, torch.float32, seed=list(CONFIGS).index(config))
    out = _attn()(**args, num_splits=num_splits)
    assert out.shape == args["q"].shape and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(args), rtol=1e-4, atol=1e-4)


def test_float16_mixed_batch() -> None:
    """float16 inputs with float32 accumulation: within 1e-2 of the float32 reference (max abs),
    and ||out - ref|| / ||ref|| < 5e-3."""
    args = make_batch(MIXED, 8, 2, 64, 16, torch.float16, seed=11)
    out = _attn()(**args, num_splits=2)
    ref = reference(args)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    assert rel_err(out, ref) < 5e-3


def test_multi_tile_prefill_and_small_tiles() -> None:
    """Prefills longer than one Q tile (block_m=16 -> 8 tokens per tile at GQA 2) so the flat tile
    numbering and its binary search are exercised, with 16-key steps over 32-key pages and one
    over 16; float32, 1e-4."""
    specs = [(19, 19), (1, 33), (17, 40), (3, 3), (1, 2), (8, 30)]
    args = make_batch(specs, 4, 2, 32, 32, torch.float32, seed=5)
    ref = reference(args)
    for block_n, splits in [(16, 1), (32, 3)]:
        out = _attn()(**args, block_m=16, block_n=block_n, num_splits=splits)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_strided_q_view_like_the_model() -> None:
    """q as the model passes it: a [T, Hq, D] view into a fused qkv buffer with
    stride(0) = (Hq + 2 * Hkv) * D. float32, 1e-4."""
    hq, hkv, d = 9, 3, 32
    args = make_batch(MIXED, hq, hkv, d, 16, torch.float32, seed=3)
    t = args["q"].shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=args["q"].device)
    q = qkv[:, : hq * d].view(t, hq, d)
    assert not q.is_contiguous() and q.stride(0) == (hq + 2 * hkv) * d
    args["q"] = q
    out = _attn()(**args, num_splits=2)
    assert out.is_contiguous()
    torch.testing.assert_close(out, reference(args), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [None, 8])
def test_graph_style_padded_decode(num_splits: int | None) -> None:
    """A pure decode batch as CUDA-graph capture sees it: max_query_len 1, max_seq_len =
    max_model_len (far above any real context), padded rows with seq_len 1 and a block table
    row of zeros. Every row, padding included, is finite and matches within 1e-4 (float32)."""
    real = [(1, 45), (1, 3), (1, 64), (1, 17)]
    args = make_batch(real + [(1, 1)] * 3, 8, 2, 32, 16, torch.float32, seed=7)
    args["block_tables"][len(real):] = 0
    args["max_seq_len"] = 512
    out = _attn()(**args, num_splits=num_splits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(args), rtol=1e-4, atol=1e-4)


def test_int32_metadata_and_int64_tables() -> None:
    """seq_lens and query_start_loc as int32, block tables as int64: same result (float32, 1e-4)."""
    args = make_batch(MIXED, 4, 2, 32, 16, torch.float32, seed=9)
    ref = reference(args)
    args["seq_lens"] = args["seq_lens"].int()
    args["query_start_loc"] = args["query_start_loc"].int()
    args["block_tables"] = args["block_tables"].long()
    torch.testing.assert_close(_attn()(**args, num_splits=3), ref, rtol=1e-4, atol=1e-4)


def test_num_splits_heuristic() -> None:
    """Big decode batches do not split; small ones split up to the context length allows."""
    from ops.attention_triton import default_num_splits

    assert default_num_splits(64 * 8, 4096, sm_count=132) == 1
    assert default_num_splits(16 * 8, 4096, sm_count=132) == 3  # cdiv(264, 128)
    assert default_num_splits(1 * 8, 4096, sm_count=132) == 16  # capped at 16
    assert default_num_splits(4 * 8, 1024, sm_count=132) == 4  # capped by 1024 // 256
    assert default_num_splits(8, 100, sm_count=132) == 1  # too short to split


# ----- on a GPU: production shapes in bf16 -----

LLAMA3_8B = (32, 8, 128, 16)  # Hq, Hkv, head_dim, block_size


@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_gpu_llama3_decode_batch64_bf16(num_splits: int | None) -> None:
    """64 decodes with contexts up to 4096, Llama-3-8B heads, bf16: ||out - ref|| / ||ref|| < 1e-2
    against the float32 reference on upcast inputs, and every value finite."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    args = make_batch([(1, n) for n in lens], *LLAMA3_8B, torch.bfloat16, seed=1)
    out = _attn()(**args, num_splits=num_splits)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(args)) < 1e-2


@requires_cuda
def test_gpu_llama3_mixed_batch_bf16() -> None:
    """Decodes, chunked prefills over long paged prefixes and whole prefills in one launch,
    Llama-3-8B heads, bf16: relative error < 1e-2 against the float32 reference."""
    specs = [(1, 4096), (512, 3000), (1, 7), (333, 333), (1, 1500), (64, 2100), (1, 1)] * 3
    args = make_batch(specs, *LLAMA3_8B, torch.bfloat16, seed=2)
    out = _attn()(**args)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(args)) < 1e-2


@requires_cuda
def test_gpu_smollm2_mixed_batch_bf16() -> None:
    """SmolLM2 heads (9 / 3, head_dim 64, block 32), mixed batch, bf16: relative error < 1e-2."""
    specs = [(1, 900), (100, 250), (1, 33), (47, 47)] * 4
    args = make_batch(specs, 9, 3, 64, 32, torch.bfloat16, seed=4)
    out = _attn()(**args, num_splits=3)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(args)) < 1e-2


@requires_cuda
def test_gpu_cuda_graph_replay() -> None:
    """Captured once with graph-style arguments (max_query_len 1, max_seq_len = max_model_len,
    padded rows), then replayed after the metadata tensors change in place: each replay matches
    the reference (bf16, relative error < 1e-2) for the real rows."""
    batch, real, max_model_len = 16, 11, 4096
    g = torch.Generator().manual_seed(3)
    args = make_batch([(1, max_model_len)] * batch, *LLAMA3_8B, torch.bfloat16, seed=5)
    args["max_seq_len"] = max_model_len
    args["block_tables"][real:] = 0
    attn = _attn()
    static_out = attn(**args)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attn(**args)
    for _ in range(2):
        lens = torch.ones(batch, dtype=torch.long)
        lens[:real] = torch.randint(1, max_model_len + 1, (real,), generator=g)
        args["seq_lens"].copy_(lens)
        args["q"].copy_(torch.randn(args["q"].shape, generator=g))
        graph.replay()
        expect = reference(args)
        assert torch.isfinite(static_out).all()
        assert rel_err(static_out[:real], expect[:real]) < 1e-2

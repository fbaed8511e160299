"""--kv-cache-dtype fp8 (vLLM's fp8 / fp8_e4m3): keys and values stored as float8_e4m3fn over
per-tensor scales (the checkpoint's k_scale / v_scale, else 1.0), written by the Triton
rotary + cache kernel and read by the Triton attention, on CUDA; refused on the CPU.

In Triton's interpreter: the cache write's bytes are the reference's (`ops.rotary.to_cache`:
x / scale saturated to +-448, rounded half to even) bit for bit; attention over an fp8
cache matches the reference reading the same bytes (fp8 -> float32 x scale) within the
float32 tolerance of test_attention_triton; swaps and copy-on-write move the bytes as they
are. On a GPU: the engine's greedy tokens with an fp8 cache against a bf16 cache, and its
capacity (twice the blocks in the same memory)."""

from __future__ import annotations

import pytest
import torch

from ops.attention import paged_attention_ref
from ops.block_copy import swap_blocks
from ops.rotary import rope_cos_sin_cache, rotary_kv_write_ref
from tests.helpers import kernel_device, requires_cuda, requires_triton
from worker import plan
from worker.config import CacheConfig
from worker.memory import kv_cache_dtype

FP8 = torch.float8_e4m3fn


def test_fp8_is_for_cuda() -> None:
    assert kv_cache_dtype("fp8", torch.device("cuda"), torch.bfloat16) == FP8
    assert kv_cache_dtype("fp8_e4m3", torch.device("cuda"), torch.float16) == FP8
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 is for CUDA.*use --kv-cache-dtype float16"):
        kv_cache_dtype("fp8", torch.device("cpu"), torch.float32)


def test_the_planner_counts_one_byte_a_value() -> None:
    model = plan.read_model("dummy:llama-3-8b")
    bf16, fp8 = (plan.make_plan(model, plan.DEVICES["h100"], plan.Workload(1000, 100),
                                cache=CacheConfig(kv_cache_dtype=dt)) for dt in ("auto", "fp8"))
    assert bf16.kv_cache["bytes_per_token"] == 2 * fp8.kv_cache["bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert fp8.kv_cache["num_blocks"] in (2 * bf16.kv_cache["num_blocks"], 2 * bf16.kv_cache["num_blocks"] + 1)


def _write_case(dev: torch.device, t: int = 37, hq: int = 4, hkv: int = 2, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dev) * 3 for h in (hq, hkv, hkv))
    k[0, 0, :4] = 5000.0  # past fp8's range at these scales: saturated to 448 x scale
    positions = torch.randperm(200, generator=g)[:t].to(dev)
    slots = torch.randperm(8 * 16, generator=g)[:t].to(dev)
    slots[3] = -1  # a padded row writes nothing
    cos_sin = rope_cos_sin_cache(d, 256, 10000.0).to(dev)
    return q, k, v, positions, cos_sin, slots


@requires_triton
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_the_triton_cache_write_is_the_references_bytes(scales) -> None:
    from ops.rotary_triton import rotary_kv_write_triton

    dev = kernel_device()
    q, k, v, pos, cs, slots = _write_case(dev)
    caches = [[torch.zeros(8, 16, 2, 64, dtype=FP8, device=dev) for _ in range(2)] for _ in range(2)]
    want_q, _ = rotary_kv_write_ref(q, k, v, pos, cs, *caches[0], slots, *scales)
    got_q, _ = rotary_kv_write_triton(q.clone(), k.clone(), v.clone(), pos, cs, *caches[1], slots, *scales)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    for ref, got in zip(caches[0], caches[1], strict=True):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert caches[0][0].float().abs().max() == 448.0  # saturated, not NaN
    assert not torch.isnan(caches[0][0].float()).any()


def _attention_case(dev: torch.device, lens: list[int], q_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = 4, 2, 64, 16
    blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache = (torch.randn(blocks, bs, hkv, d, generator=g) * 2).to(FP8).to(dev)
    v_cache = (torch.randn(blocks, bs, hkv, d, generator=g) * 2).to(FP8).to(dev)
    perm = torch.randperm(blocks, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables, first = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[first:first + nb] + [0] * (width - nb))
        first += nb
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    q = torch.randn(starts[-1], hq, d, generator=g).to(dev)
    return (q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=dev),
            torch.tensor(lens, device=dev), torch.tensor(starts, device=dev), max(q_lens), max(lens))


@requires_triton
@pytest.mark.parametrize("lens, q_lens", [([40, 7, 100], [1, 1, 1]), ([30, 50], [30, 3])])
def test_triton_attention_reads_an_fp8_cache_as_the_reference(lens, q_lens) -> None:
    from ops.attention_triton import paged_attention_triton

    dev = kernel_device()
    args = _attention_case(dev, lens, q_lens, seed=len(lens))
    for k_scale, v_scale in ((1.0, 1.0), (0.5, 3.0)):
        want = paged_attention_ref(*args, 0.125, k_scale=k_scale, v_scale=v_scale)
        got = paged_attention_triton(*args, 0.125, k_scale=k_scale, v_scale=v_scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the scales matter: a reference read without them is far off
    assert (paged_attention_ref(*args, 0.125) - want).abs().max() > 0.1


def test_swap_and_copy_move_fp8_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    dev = torch.device("cpu")
    gpu = (torch.randn(6, 16, 2, 64, generator=g) * 10).to(FP8)
    host = torch.zeros(4, 16, 2, 64, dtype=FP8, device=dev)
    swap_blocks(gpu, host, [5, 1], [0, 3])
    assert torch.equal(host[0].view(torch.uint8), gpu[5].view(torch.uint8))
    assert torch.equal(host[3].view(torch.uint8), gpu[1].view(torch.uint8))
    back = torch.zeros_like(gpu)
    swap_blocks(host, back, [0, 3], [2, 4])
    assert torch.equal(back[2].view(torch.uint8), gpu[5].view(torch.uint8))


@requires_triton
def test_copy_on_write_of_an_fp8_block() -> None:
    from ops.block_copy_triton import copy_blocks_triton

    cache = (torch.randn(5, 16, 2, 64, generator=torch.Generator().manual_seed(2)) * 10).to(FP8).to(kernel_device())
    copy_blocks_triton(cache, [1, 3], [0, 4])
    assert torch.equal(cache[0].view(torch.uint8), cache[1].view(torch.uint8))
    assert torch.equal(cache[4].view(torch.uint8), cache[3].view(torch.uint8))


@requires_cuda
def test_the_engine_on_an_fp8_cache() -> None:
    """dummy:llama-3.2-1b in bf16: twice the blocks of a bf16 cache in the same memory, and
    greedy tokens that start as the bf16 cache's (fp8 rounding may part them later)."""
    from scheduler.request import SamplingParams
    from worker.config import ModelConfig, WorkerConfig
    from worker.engine import Engine
    from worker.weights import load_model

    loaded = load_model("dummy:llama-3.2-1b", device="cuda")
    out = {}
    for dt in ("auto", "fp8"):
        engine = Engine(WorkerConfig(model=ModelConfig(max_model_len=2048),
                                     cache=CacheConfig(kv_cache_memory=0.5, kv_cache_dtype=dt)), loaded=loaded)
        reqs = [engine.make_request(list(range(5 + i, 300 + i)), SamplingParams(temperature=0, max_tokens=8))
                for i in range(4)]
        out[dt] = ([c.token_ids for c in engine.generate(reqs)], engine.budget.num_blocks)
        assert engine.runner.kv_caches[0][0].dtype == (FP8 if dt == "fp8" else torch.bfloat16)
    assert out["fp8"][1] >= 2 * out["auto"][1]
    assert sum(a[0] == b[0] for a, b in zip(out["fp8"][0], out["auto"][0], strict=True)) >= 3

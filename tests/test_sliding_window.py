"""Sliding-window attention (ModelConfig.window_of; `window` of ops.paged_attention): the
config's windows as transformers reads them, and each attention path against a dense
reference that masks keys to (position - window, position] itself, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from ops.attention import paged_attention_ref
from worker.models.llama import LlamaConfig

BS, HKV, HQ, D, NUM_BLOCKS = 16, 2, 6, 64, 120


def _hf(**over) -> dict:
    cfg = {"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "sliding_window": 16}
    cfg.update(over)
    return cfg


def test_mistral_has_its_window_on_every_layer() -> None:
    cfg = LlamaConfig.from_hf(_hf(layer_types=["full_attention"] * 4))  # Mistral ignores them
    assert [cfg.window_of(i) for i in range(4)] == [16] * 4
    assert LlamaConfig.from_hf(_hf(sliding_window=None)).window_of(0) is None


def test_qwen2_windows_follow_use_sliding_window_and_layer_types() -> None:
    qwen = dict(architectures=["Qwen2ForCausalLM"])
    assert LlamaConfig.from_hf(_hf(**qwen)).window_of(3) is None  # use_sliding_window defaults off
    mixed = LlamaConfig.from_hf(_hf(**qwen, use_sliding_window=True, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]))
    assert [mixed.window_of(i) for i in range(4)] == [16, None, 16, None]
    # without layer_types: transformers' Qwen2Config windows the layers from max_window_layers on
    by_count = LlamaConfig.from_hf(_hf(**qwen, use_sliding_window=True, max_window_layers=1))
    assert [by_count.window_of(i) for i in range(4)] == [None, 16, 16, 16]


def test_llama_has_no_window() -> None:
    """transformers' Llama reads no sliding_window: neither do we."""
    assert LlamaConfig.from_hf(_hf(architectures=["LlamaForCausalLM"])).window_of(0) is None


def test_a_window_past_every_position_is_global() -> None:
    """Phi-3-mini-128k's window (262,144) over its 131,072 positions excludes no key."""
    assert LlamaConfig.from_hf(_hf(sliding_window=512)).window_of(0) is None
    assert LlamaConfig.from_hf(_hf(sliding_window=511)).window_of(0) == 511


@pytest.mark.parametrize(("over", "match"), [
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"sliding_window": -4}, "sliding_window must be a positive integer"),
    ({"sliding_window": 16.5}, "sliding_window must be a positive integer"),
    ({"sliding_window": True}, "sliding_window must be a positive integer"),
    ({"sliding_window": "16"}, "sliding_window must be a positive integer"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries for num_hidden_layers 4"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]}, "layer_types entry 'chunked_attention'"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "layer_types": "sliding_attention"}, "layer_types must be a list"),
])
def test_bad_windows_are_refused_naming_the_field(over, match) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(_hf(**over))


def step(lens: list[int], q_lens: list[int], seed: int, dtype=torch.float32, device="cpu",
         poison: int | None = None):
    """A step's arguments: request r has lens[r] tokens, its last q_lens[r] queried now.
    `poison` (a window): the keys and values no query's window reaches are NaN, so a kernel
    that read one would say so."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    v = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    max_blocks = max(-(-n // BS) for n in lens) + 1
    tables = torch.randperm(NUM_BLOCKS, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    for r, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
        for p in range(max(0, n - m - poison + 1) if poison else 0):
            k[tables[r, p // BS], p % BS] = v[tables[r, p // BS], p % BS] = float("nan")
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], HQ, D, generator=g)
    t = {"dtype": dtype, "device": device}
    return (q.to(**t), k.to(**t), v.to(**t), tables.int().to(device), torch.tensor(lens, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device), max(q_lens), max(lens), D**-0.5)


def dense(q, k_cache, v_cache, tables, seq_lens, starts, scale, window):
    """Row by row, in float64: each query over its keys (position - window, position]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(len(seq_lens)):
        n, s0, s1 = int(seq_lens[r]), int(starts[r]), int(starts[r + 1])
        pos = torch.arange(n)
        slots = tables[r].long()[pos // BS] * BS + pos % BS
        keys = k_cache.reshape(-1, HKV, D)[slots].double().repeat_interleave(HQ // HKV, 1)
        vals = v_cache.reshape(-1, HKV, D)[slots].double().repeat_interleave(HQ // HKV, 1)
        for i in range(s0, s1):
            p = n - (s1 - s0) + (i - s0)
            seen = (pos <= p) & ((pos > p - window) if window is not None else True)
            sc = torch.einsum("hd,khd->hk", q[i].double(), keys[seen]) * scale
            out[i] = torch.einsum("hk,khd->hd", sc.softmax(-1), vals[seen])
    return out


# (lens, q_lens, window): decodes inside and past their window, prefill chunks that start
# before and after it (a prefix-cache hit's chunk), a chunk longer than the window, a
# verification step's rows (one-token rows of one request), windows of 1, 8, 16, 37
CASES = [
    ([5, 40, 100, 17, 16], [1, 1, 1, 1, 1], 16),
    ([70, 30, 200], [70, 10, 1], 16),
    ([90, 33], [25, 1], 37),
    ([50, 51, 52, 53, 9], [1, 1, 1, 1, 1], 8),
    ([64, 20], [64, 20], 1),
    ([130, 7], [3, 7], 100),
]


@pytest.mark.parametrize(("lens", "q_lens", "window"), CASES)
def test_the_reference_attends_its_window(lens, q_lens, window) -> None:
    args = step(lens, q_lens, seed=sum(lens))
    q, k, v, tables, seq_lens, starts, *_, scale = args
    want = dense(q, k, v, tables, seq_lens, starts, scale, window)
    got = paged_attention_ref(*args, window=window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the window matters here: the global answer differs
    assert not torch.allclose(paged_attention_ref(*args).double(), want, rtol=1e-3, atol=1e-3)


@pytest.fixture
def c_kernel_windows(monkeypatch) -> list:
    """The window of each call of the C decode kernel (a spy: it really ran)."""
    from ops import cpu_attention

    if not cpu_attention.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    calls: list = []
    real = cpu_attention.decode

    def spy(*args, window=None, **kwargs):
        calls.append(window)
        return real(*args, window=window, **kwargs)

    monkeypatch.setattr(cpu_attention, "decode", spy)
    return calls


@pytest.mark.parametrize(("lens", "q_lens", "window"), CASES)
def test_the_c_kernel_attends_its_window(lens, q_lens, window, c_kernel_windows) -> None:
    from ops.cpu_attention import paged_attention_c

    args = step(lens, q_lens, seed=sum(lens) + 1, poison=window if q_lens == [1] * len(lens) else None)
    q, k, v, tables, seq_lens, starts, *_, scale = args
    want = dense(q, k, v, tables, seq_lens, starts, scale, window)
    got = paged_attention_c(*args, window=window)
    assert c_kernel_windows == ([window] if 1 in q_lens else [])
    # (with decodes only, every key out of the windows is NaN: the kernel read none of them)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tuning", [{}, {"num_splits": 3, "block_n": 16}, {"block_m": 16, "block_n": 32}])
@pytest.mark.parametrize(("lens", "q_lens", "window"), CASES)
def test_the_triton_kernel_attends_its_window(lens, q_lens, window, tuning) -> None:
    """In Triton's interpreter without a GPU (float32), with the keys no window reaches
    poisoned: a tile's loop starts at its first query's window; split-K over the window's
    range; query tiles of 16 rows (several a chunk) and key steps of 16 and 32."""
    pytest.importorskip("triton")
    from ops.attention_triton import paged_attention_triton
    from tests.helpers import kernel_device

    dev = kernel_device()
    args = step(lens, q_lens, seed=sum(lens) + 2, device=dev, poison=window)
    q, k, v, tables, seq_lens, starts, *_, scale = args
    want = dense(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), seq_lens.cpu(), starts.cpu(), scale, window)
    got = paged_attention_triton(*args, window=window, **tuning)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_the_window_benchmark_times_both_variants_at_each_context(tmp_path) -> None:
    """`benchmarks.window --no-steps`: the C attention alone, windowed and global, at each
    context, in its JSON (the figures themselves are the lead's to measure)."""
    import json

    from ops import cpu_attention

    if not cpu_attention.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    from benchmarks import window

    out = tmp_path / "w.json"
    window.main(["--window", "32", "--contexts", "32,128", "--no-steps", "--rounds", "1", "--calls", "2",
                 "--output-json", str(out)])
    rows = json.loads(out.read_text())["attention"]
    assert [(r["variant"], r["context"]) for r in rows] == [
        ("windowed", 32), ("windowed", 128), ("global", 32), ("global", 128)]
    assert all(r["call_ms"] > 0 and r["ratio"] > 0 for r in rows)

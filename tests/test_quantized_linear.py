"""The CPU kernel over GGUF blocks (ops/quantized_linear.py): the same product as the
dequantized weights, a row's bits independent of its batch, every linear of the default
model covered, and the fall-back when the kernel cannot be built."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ops import cpu_kernels
from ops import quantized_linear as ql
from ops.linear import PackedLinear
from worker.config import ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import load_model

needs_kernel = pytest.mark.skipif(not ql.available(), reason="no gcc or no AVX2/FMA/F16C here")


def _random_blocks(qtype: str, n: int, k: int, seed: int) -> ql.QuantizedWeight:
    """GGUF blocks with random quants and realistic fp16 scales (d > 0, m < 0 for Q4_1)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).view(np.uint8)
    if qtype == "Q4_1":
        m = (-rng.uniform(0.0, 0.4, (n, nb, 1))).astype(np.float16).view(np.uint8)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        blocks = np.concatenate([d, m, qs], axis=-1)
    else:
        qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
        blocks = np.concatenate([d, qs], axis=-1)
    return ql.QuantizedWeight(qtype, blocks.reshape(n, -1), (n, k))


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "k"), [(64, 96), (96, 576)])
def test_quant_linear_matches_the_dequantized_weight(qtype, n, k) -> None:
    qw = _random_blocks(qtype, n, k, seed=n + k)
    w = ql.dequantize(qw)
    bias = torch.randn(n)
    layer = ql.QuantLinear(qw, bias)
    x = torch.randn(7, k)
    ref = F.linear(x.double(), w.double(), bias.double()).float()
    got = layer(x)
    assert got.shape == (7, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # Leading dimensions are kept, and no rows gives no rows.
    assert layer(x.reshape(7, 1, k)).shape == (7, 1, n)
    assert layer(torch.empty(0, k)).shape == (0, n)


def _q8_0_without_minus_128(n: int, k: int, seed: int) -> ql.QuantizedWeight:
    """Random Q8_0 blocks as gguf's quantizer writes them (quants in -127..127)."""
    qw = _random_blocks("Q8_0", n, k, seed)
    blocks = qw.blocks.reshape(n, k // 32, 34).copy()
    q = blocks[..., 2:].view(np.int8)
    q[q == -128] = -127
    return ql.QuantizedWeight("Q8_0", blocks.reshape(n, -1), (n, k))


@needs_kernel
@pytest.mark.parametrize("activations", list(ql.ACTIVATIONS))
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_rows_bits_do_not_depend_on_its_batch(qtype, activations) -> None:
    """Rows alone and in batches of 2 to 64 (every register blocking of every kernel, and the
    remainders) give identical bits."""
    qw = _random_blocks(qtype, 64, 192, seed=1) if qtype == "Q4_1" else _q8_0_without_minus_128(64, 192, 1)
    layer = ql.QuantLinear(qw, activations=activations)
    x = torch.randn(64, 192)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(64)])
    for m in range(2, 65):
        first = (5 * m) % 64  # batches start at different rows
        rows = [(first + i) % 64 for i in range(m)]
        assert torch.equal(layer(x[rows]), alone[rows]), f"{m} rows differ from the rows alone"


def _integer_reference(qw: ql.QuantizedWeight, x: torch.Tensor, planes: int) -> torch.Tensor:
    """The integer kernels' arithmetic in float64: x per block of 32 as integers of
    `planes` bytes (round(x * lim / max|x|) in float32, lim = 127 * 256^(planes-1)), exact
    block dot products with the quants, scaled by d dx, plus m times the block's sum (Q4_1)."""
    n, k = qw.shape
    nb = k // 32
    d, m, q = ql._quants(qw)  # [T, nb, 32 n], [T, nb, 32 n, 32 k]
    d = torch.from_numpy(d.astype(np.float64)).permute(0, 2, 1).reshape(n, nb)
    q = torch.from_numpy(q.astype(np.float64)).permute(0, 2, 1, 3).reshape(n, nb, 32)
    xb = x.reshape(-1, nb, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    lim = torch.tensor(127.0 * 256 ** (planes - 1))
    ints = torch.round(xb * torch.where(amax > 0, lim / amax, 0)).double()
    dx = (amax / lim).double()[..., 0]
    y = (torch.einsum("rbk,nbk->rnb", ints, q) * d[None] * dx[:, None, :]).sum(-1)
    if m is not None:
        m = torch.from_numpy(m.astype(np.float64)).permute(0, 2, 1).reshape(n, nb)
        y = y + (m[None] * xb.double().sum(-1)[:, None, :]).sum(-1)
    return y


@needs_kernel
@pytest.mark.parametrize("activations", ["int8", "int16", "int24"])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_integer_activations_compute_their_reference(qtype, activations) -> None:
    qw = _random_blocks(qtype, 96, 576, seed=3) if qtype == "Q4_1" else _q8_0_without_minus_128(96, 576, 4)
    x = torch.randn(13, 576)
    x[:, 5] *= 50  # an outlier, as SmolLM2's activations have
    got = ql.QuantLinear(qw, activations=activations)(x).double()
    ref = _integer_reference(qw, x, ql.ACTIVATIONS[activations])
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-6
    # int24 is as close to the float64 product of the dequantized weights as float32 is.
    exact = F.linear(x.double(), ql.dequantize(qw).double())
    err = ((got - exact).abs().max() / exact.abs().max()).item()
    assert err < {"int8": 5e-2, "int16": 2e-4, "int24": 2e-6}[activations], err



@needs_kernel
@pytest.mark.parametrize("activations", ["int8", "int16", "int24"])
def test_q8_0_integer_records_hold_the_gguf_bytes_and_take_extreme_quants(activations) -> None:
    """The integer layout keeps a Q8_0 weight in its GGUF size (no per-output sums: the
    offset of vpdpbusd's unsigned side comes out through the activations' digit sums), and
    quants and digits at their extremes, where an int16 or int32 sum would be nearest to
    overflowing, give the integer reference's result on every row and block."""
    n, k = 64, 192
    qw = _q8_0_without_minus_128(n, k, seed=7)
    assert ql.repack_int8(qw).numel() == qw.blocks.nbytes
    assert ql.held_bytes("Q8_0", qw.blocks.nbytes, activations) == qw.blocks.nbytes
    blocks = qw.blocks.reshape(n, k // 32, 34).copy()
    q = blocks[..., 2:].view(np.int8)
    q[: n // 2] = 127  # every quant of the first half of the outputs +127, then -127
    q[n // 2 :] = -127
    q[::3, ::2] = -q[::3, ::2]  # and mixed signs in every third output's even blocks
    qw = ql.QuantizedWeight("Q8_0", blocks.reshape(n, -1), (n, k))
    x = torch.full((4, k), 3.0)
    x[1] = -3.0  # every digit at its largest, of either sign
    x[2, ::2] = -3.0  # alternating
    x[3] = torch.randn(k) * 1e-30  # tiny: digits at full scale all the same
    got = ql.QuantLinear(qw, activations=activations)(x).double()
    ref = _integer_reference(qw, x, ql.ACTIVATIONS[activations])
    assert ((got - ref).abs() <= 1e-6 * ref.abs().amax(-1, keepdim=True)).all()
    assert torch.equal(ql.QuantEmbedding(qw, integer_layout=True)(torch.arange(n)), ql.dequantize(qw))

def test_auto_is_int16_with_avx512_vnni_else_float32(monkeypatch) -> None:
    from ops import cpu_kernels

    for isa, expected in [("avx512-vnni", "int16"), ("avx512", "float32"), ("avx2", "float32")]:
        monkeypatch.setattr(cpu_kernels, "isa", lambda isa=isa: isa)
        assert ql.resolve_activations("auto") == expected
    assert ql.resolve_activations("int8") == "int8"
    with pytest.raises(ValueError, match="activations must be auto or one of float32, int8, int16, int24"):
        ql.resolve_activations("int4")
    # A Q8_0 weight with a -128 quant keeps float32 (AVX2's sign trick cannot take it).
    assert ql.activations_for(_random_blocks("Q8_0", 32, 64, seed=0), "int24") == "float32"


def test_shapes_the_kernel_cannot_take_are_refused() -> None:
    assert ql.supports("Q4_1", (576, 1536)) and ql.supports("Q8_0", (49152, 576))
    assert not ql.supports("Q4_1", (100, 576))  # rows not a multiple of the 32-row tile
    assert not ql.supports("Q6_K", (576, 576))
    with pytest.raises(ValueError, match="cannot repack a Q4_1 weight of shape"):
        ql.repack(ql.QuantizedWeight("Q4_1", np.zeros((100, 20), np.uint8), (100, 32)))


@pytest.fixture
def fresh_kernel_cache(tmp_path, monkeypatch):
    """Kernel builds into tmp_path only, and no library loaded before."""
    monkeypatch.setenv("LLMWORKER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cpu_kernels.load.cache_clear()
    ql._library.cache_clear()
    yield tmp_path
    cpu_kernels.load.cache_clear()
    ql._library.cache_clear()


def test_no_compiler_means_no_kernel(fresh_kernel_cache, monkeypatch) -> None:
    monkeypatch.setenv("CC", str(fresh_kernel_cache / "no-such-compiler"))
    assert cpu_kernels.load("quant_matmul") is None and not ql.available()
    # A failed build leaves nothing behind.
    assert not list(fresh_kernel_cache.rglob("*.so"))


@needs_kernel
def test_an_unwritable_cache_falls_back_to_the_temp_dir(fresh_kernel_cache, monkeypatch) -> None:
    blocker = fresh_kernel_cache / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LLMWORKER_KERNEL_CACHE", str(blocker / "cache"))
    assert cpu_kernels.load("quant_matmul") is not None
    assert [p.parent.parent.name for p in fresh_kernel_cache.rglob("quant_matmul-*.so")] == ["tmp"]


@pytest.fixture(scope="module")
def fresh_default():
    """A load of its own: an engine takes the load it runs on, and the session's is shared."""
    return load_model("default")


@pytest.fixture(scope="module")
def float_default():
    """The default model dequantized to float32 (--no-cpu-quantized-linear)."""
    return load_model("default", cpu_quantized_linear=False)


@needs_kernel
def test_every_linear_of_the_default_model_runs_quantized(fresh_default, float_default) -> None:
    quantized = fresh_default.quantized
    cfg = fresh_default.config
    assert set(quantized) == {"embed_tokens"} | {
        f"layers.{i}.{m}" for i in range(cfg.num_layers)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    # q/k rows were unpermuted in the blocks as in the float32 weights: same products.
    for name in ("layers.0.self_attn.qkv_proj", "layers.29.mlp.down_proj", "embed_tokens"):
        dense = float_default.model.get_submodule(name).weight
        x = torch.randn(3, dense.shape[1])
        ref = x @ dense.T
        torch.testing.assert_close(ql.QuantLinear(quantized[name])(x), ref, rtol=1e-4,
                                   atol=1e-5 * float(ref.abs().max()))
    # The lookup on the Q8_0 blocks gives the float32 table's rows bit for bit, in either layout.
    table = float_default.model.embed_tokens.weight
    for integer_layout in (False, True):
        lookup = ql.QuantEmbedding(quantized["embed_tokens"], integer_layout=integer_layout)
        assert torch.equal(lookup(torch.arange(cfg.vocab_size)), table)
    ids = torch.tensor([[5, 49151], [0, 5]])
    assert torch.equal(lookup(ids), table[ids])
    # The load built the linears on the blocks: no float32 weight, and the engine runs them.
    assert not [n for n, p in fresh_default.model.named_parameters() if p.dim() == 2]
    engine = Engine(WorkerConfig(), loaded=fresh_default)
    # 4 per layer and the tied head; the start-up log line says so.
    kernels = engine.runner.describe_kernels()
    assert "linear layers: 121 QuantLinear; embedding: Q8_0 blocks;" in kernels
    assert isinstance(fresh_default.model.layers[3].mlp.down_proj, ql.QuantLinear)
    assert isinstance(fresh_default.model.tied_head, ql.QuantLinear)
    assert isinstance(fresh_default.model.embed_tokens, ql.QuantEmbedding)
    # The lookup reads the tied head's records: the table is held once.
    assert fresh_default.model.embed_tokens.packed is fresh_default.model.tied_head.packed
    assert torch.equal(fresh_default.model.embed_tokens(ids), table[ids])


def test_the_flag_turns_the_kernel_off() -> None:
    loaded = load_model("default")
    engine = Engine(WorkerConfig(model=ModelConfig(cpu_quantized_linear=False)), loaded=loaded)
    assert "linear layers: 121 PackedLinear; embedding: table;" in engine.runner.describe_kernels()
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(loaded.model.tied_head, PackedLinear)


@needs_kernel
def test_a_load_quantized_for_one_arithmetic_refuses_another() -> None:
    """A load's linears are built for one arithmetic: an engine asking another of a load no
    engine runs on gets it loaded again; a second engine on a load an engine runs on with
    other activations is refused (it would run the first one's arithmetic), the same ones
    are fine."""
    from worker.config import ModelConfig, WorkerConfig
    from worker.engine import Engine
    from worker.weights import load_model

    loaded = load_model("default")
    Engine(WorkerConfig(model=ModelConfig(cpu_activations="int24")), loaded=loaded)
    Engine(WorkerConfig(model=ModelConfig(cpu_activations="int24")), loaded=loaded)
    assert loaded.linears.activations == "int24"
    with pytest.raises(ValueError, match="this load's linear layers are quantized, int24 activations and an "
                                         "engine runs on them; quantized, int16 activations needs a load of its own"):
        Engine(WorkerConfig(model=ModelConfig(cpu_activations="int16")), loaded=loaded)

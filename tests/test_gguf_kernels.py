"""Native CPU kernels for the GGUF types users download (issue 49): Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, the grid types IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S, F16 and BF16 (ops/quantized_linear.py).

Weights are random blocks (any bit pattern with finite scales is a valid block), written into
a GGUF file with gguf-py's GGUFWriter and read back with the loader's reader
(worker/weights/gguf_reader.py), so the kernels see the blocks as a load gives them. The
reference is gguf-py's `dequantize` and a float64 matmul; each arithmetic has its bound:

- float32: every sub-block's sum of at most 32 products, then a few FMAs per block and the
  blocks' accumulation: |error| <= (2 nb + 40) u T, u = 2^-24, nb = K / 32, where
  T = |x| @ (|W_dq| + |W_m|)^T bounds every term's size (W_dq: the weight with its mins
  zeroed, d q; W_m = W - W_dq, the mins, which the kernels add as m times the block's sum of
  x; Q6_K's halves give 2 nb blocks).
  Q2_K's mins are per 16 k, each half's M times the half's sum of x in float32; in the
  integer kernels that sum is the half's digits' (the activations its quants meet), so its
  bound below takes |W| whole, mins included.
- int8/int16/int24 (P = 1, 2, 3 bytes): x is written per block b as integers m of at most
  lim = 127 256^(P-1) with dx_b = max|x_b| / lim; each element is off by at most
  e_b = dx_b (1/2 + lim 2^-24) (the rounding, and float32's rounding of x / dx before it)
  plus max|x_b| 2^-22 (dx's own rounding); the products with the integer quants are exact,
  so |error| <= sum_b e_b sum_(k in b) |W_dq[k]| + the float32 bound above.

Every ISA build this CPU can run is checked (`cpu_kernels.supported_isas()`), at 1, 3 and 64
rows, with each row's bits the same alone and in batches, and the same bits in every build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from benchmarks.gguf_blocks import FP16_MINS as _MINS
from benchmarks.gguf_blocks import FP16_SCALES as _SCALES
from benchmarks.gguf_blocks import random_weight, set_iq1m_d
from ops import cpu_kernels
from ops import quantized_linear as ql
from worker.weights.gguf_reader import GGUFFile

pytestmark = pytest.mark.skipif(not ql.available(), reason="no gcc or no AVX2/FMA/F16C here")

GRID = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", *GRID,
          "F16", "BF16"]
BLOCKS_256 = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", *GRID)
# The grid types' records' bytes per 256 weights of a row against the file's block: each
# weight's grid value and sign as a table index of 3 bits (IQ1, IQ2: 96 bytes) or 4 (IQ3: 128),
# d (2) and a byte per scale (8, or 16 for a scale per 16 weights), quant_types.h.
GRID_RATIO = {"IQ1_S": 106 / 50, "IQ1_M": 114 / 56, "IQ2_XXS": 106 / 66, "IQ2_XS": 114 / 74, "IQ2_S": 114 / 82,
              "IQ3_XXS": 138 / 98, "IQ3_S": 138 / 110}
N, K = 64, 512  # two super-blocks of the 256-block types
U = 2.0**-24
def through_a_file(weights: dict[str, ql.QuantizedWeight], path) -> dict[str, ql.QuantizedWeight]:
    """The weights written into a GGUF file by GGUFWriter and read back as the loader reads them."""
    writer = GGUFWriter(str(path), "llama")
    for name, w in weights.items():
        if w.qtype == "F16":
            writer.add_tensor(name, w.blocks.view(np.float16).reshape(w.shape))
        else:
            writer.add_tensor(name, w.blocks, raw_dtype=GGMLQuantizationType[w.qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = {}
    for t in GGUFFile(path).tensors:
        assert t.tensor_type.name == weights[t.name].qtype
        blocks = np.asarray(t.data)
        out[t.name] = ql.QuantizedWeight(t.tensor_type.name, blocks, (blocks.shape[0], int(t.shape[0])))
    return out


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, ql.QuantizedWeight]:
    made = {q: random_weight(q, N, K, seed=i) for i, q in enumerate(QTYPES)}
    read = through_a_file(made, tmp_path_factory.mktemp("gguf") / "random.gguf")
    for q in QTYPES:
        assert np.array_equal(np.asarray(read[q].blocks).view(np.uint8).reshape(N, -1),
                              made[q].blocks.reshape(N, -1)), q
    return read


def without_mins(w: ql.QuantizedWeight) -> ql.QuantizedWeight:
    if w.qtype not in _MINS:
        return w
    block = GGML_QUANT_SIZES[GGMLQuantizationType[w.qtype]][1]  # bytes
    raw = np.asarray(w.blocks).reshape(w.shape[0], -1, block).copy()
    raw[..., _MINS[w.qtype] : _MINS[w.qtype] + 2] = 0
    return ql.QuantizedWeight(w.qtype, raw.reshape(w.shape[0], -1), w.shape)


def bound(w: ql.QuantizedWeight, x: torch.Tensor, activations: str) -> torch.Tensor:
    """The largest |kernel - float64 reference| each output may have (see the top)."""
    wd = ql.dequantize(without_mins(w)).double()
    wm = ql.dequantize(w).double() - wd
    xd = x.double()
    nb = x.shape[1] // 32
    t = xd.abs() @ (wd.abs() + wm.abs()).T
    err = (2 * nb + 40) * U * t
    planes = ql.ACTIVATIONS[activations]
    if planes:
        lim = 127.0 * 256 ** (planes - 1)
        amax = xd.reshape(x.shape[0], nb, 32).abs().amax(-1)  # [rows, nb]
        e = amax / lim * (0.5 + lim * U) + amax * 2.0**-22
        wq = wd.abs() + wm.abs() if w.qtype == "Q2_K" else wd.abs()
        err = err + torch.einsum("rb,nb->rn", e, wq.reshape(w.shape[0], nb, 32).sum(-1))
    return err


def _activations(w: ql.QuantizedWeight) -> list[str]:
    return [a for a in ql.ACTIVATIONS if ql.activations_for(w, a) == a]


def test_every_type_is_supported_at_its_block_size() -> None:
    for q in QTYPES:
        k = 256 if q in BLOCKS_256 else 32
        assert ql.supports(q, (64, k)) and ql.supports(q, (128256, 8 * k)), q
        assert not ql.supports(q, (64 + 16, k)), q  # rows: a multiple of the 32-row tile
        if k == 256:
            assert not ql.supports(q, (64, 576)), q  # the default model's width is no multiple of 256
    assert not ql.supports("TQ2_0", (64, 256)) and not ql.supports("F32", (64, 32))
    assert ql.activations_for(random_weight("F16", 32, 64, 0), "int16") == "float32"
    assert ql.activations_for(random_weight("Q6_K", 32, 256, 0), "int16") == "int16"


@pytest.mark.parametrize("qtype", QTYPES)
def test_records_hold_the_files_bytes_as_stated(weights, qtype) -> None:
    """held_bytes is the records' size, which the kernels' own geometry agrees with, and within
    3% of the file's (Q3_K 3.6%: its 6-bit scales a byte each; the grid types as GRID_RATIO)."""
    w = weights[qtype]
    nbytes = np.asarray(w.blocks).nbytes
    lib = ql._library()
    for integer in (False, True) if ql.supports_int8(w) else (False,):
        packed = ql.repack_int8(w) if integer else ql.repack(w)
        activations = "int16" if integer else "float32"
        assert packed.numel() == ql.held_bytes(qtype, nbytes, activations)
        code = ql.TYPES[qtype].int_code if integer else ql.TYPES[qtype].code
        assert packed.numel() == N // 32 * lib.quant_tile_bytes(code, K)
    if qtype in GRID_RATIO:
        assert ql.HELD_RATIO[qtype] == pytest.approx(GRID_RATIO[qtype], rel=1e-12)
    else:
        assert 1.0 <= ql.HELD_RATIO[qtype] <= (1.037 if qtype == "Q3_K" else 1.03)
    assert ql.held_bytes(qtype, nbytes, "float32") == round(nbytes * ql.HELD_RATIO[qtype])


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_lookup_is_gguf_dequantize_bit_for_bit(weights, qtype) -> None:
    w = weights[qtype]
    table = ql.dequantize(w)
    ids = torch.tensor([[0, N - 1, 31], [32, 5, 5]])
    for integer in (False, True) if ql.supports_int8(w) else (False,):
        lookup = ql.QuantEmbedding(w, integer_layout=integer)
        assert torch.equal(lookup(torch.arange(N)), table), (qtype, integer)
        assert torch.equal(lookup(ids), table[ids])
        head = ql.QuantLinear(w, activations="int16" if integer else "float32")
        tied = ql.QuantEmbedding.of_head(head, w)
        assert tied.packed is head.packed and torch.equal(tied(ids), table[ids])
    with pytest.raises(IndexError, match="token ids must be in"):
        lookup(torch.tensor([N]))


@pytest.fixture
def restore_isa():
    yield
    cpu_kernels.force_isa(None)
    ql._library.cache_clear()
    ql._library_int8.cache_clear()


def _run_all(w: ql.QuantizedWeight, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each arithmetic's output on x (64 rows) with the current ISA's build, after checking
    its bound and that every row's bits are the same alone and in batches of 3 and more."""
    ref = x.double() @ ql.dequantize(w).double().T
    out = {}
    for activations in _activations(w):
        layer = ql.QuantLinear(w, activations=activations)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        err = (alone.double() - ref).abs()
        limit = bound(w, x, activations)
        assert (err <= limit).all(), (f"{w.qtype} {activations} {cpu_kernels.isa()}: error "
                                      f"{(err / limit).max().item():.2f} x the bound")
        for first, rows in ((0, 3), (5, 2), (7, 16), (9, 17), (0, 64)):
            assert torch.equal(layer(x[first : first + rows]), alone[first : first + rows]), (
                f"{w.qtype} {activations} {cpu_kernels.isa()}: {rows} rows differ from the rows alone")
        out[activations] = alone
    return out


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_isa_computes_within_the_bound_and_gives_the_same_bits(weights, qtype, restore_isa) -> None:
    w = weights[qtype]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, K, generator=g)
    x[:, 7] *= 40  # an outlier column, as SmolLM2's activations have
    x[3] = 0.0  # a zero row: dx = 0 in every block
    results = {}
    for isa in cpu_kernels.supported_isas():
        cpu_kernels.force_isa(isa)
        ql._library.cache_clear()
        ql._library_int8.cache_clear()
        results[isa] = _run_all(w, x)
    base = results["avx2"]
    for isa, out in results.items():
        for activations, y in out.items():
            assert torch.equal(y, base[activations]), f"{qtype} {activations}: {isa} differs from avx2"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
                                   *GRID])
def test_the_largest_quants_and_digits_do_not_overflow(qtype, restore_isa) -> None:
    """Every quant byte 0xFF (q at its largest: 3, 7, 15, 31 or 63; IQ4's index 15; the grid
    types' last grid entry, every sign negative, their scales at their largest), against
    activations whose digits are all at full scale, of one sign, alternating, or tiny: where
    the int16 sums of AVX2's vpmaddubsw and the int32 ones would be nearest to overflowing."""
    w = random_weight(qtype, 32, 256, seed=5)
    block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]  # bytes
    raw = w.blocks.reshape(32, -1, block).copy()
    fp16 = _SCALES.get(qtype, []) + ([_MINS[qtype]] if qtype in _MINS else [])
    keep = set(range(block)) - {i + j for i in fp16 for j in (0, 1)}
    if qtype in ("Q4_K", "Q5_K"):
        keep -= set(range(4, 16))  # the 6-bit sub-scales stay random
    if qtype == "Q6_K":
        keep -= set(range(192, 208))
    if qtype == "Q3_K":
        keep -= set(range(96, 108))
    if qtype == "Q2_K":
        keep -= set(range(0, 16))  # its scales and mins
    if qtype == "IQ4_XS":
        keep -= set(range(2, 8))
    if qtype == "IQ1_M":
        keep -= set(range(48, 56))  # its d is in these words' top nibbles: set below
    raw[..., sorted(keep)] = 0xFF
    if qtype == "IQ1_M":
        raw[..., 48:56] = 0xFF
        set_iq1m_d(raw, np.full(raw.shape[:2], 0.003))
    w = ql.QuantizedWeight(qtype, raw.reshape(32, -1), (32, 256))
    x = torch.full((4, 256), 3.0)
    x[1] = -3.0
    x[2, ::2] = -3.0
    x[3] = torch.randn(256) * 1e-30
    for isa in cpu_kernels.supported_isas():
        cpu_kernels.force_isa(isa)
        ql._library.cache_clear()
        ql._library_int8.cache_clear()
        ref = x.double() @ ql.dequantize(w).double().T
        for activations in _activations(w):
            got = ql.QuantLinear(w, activations=activations)(x).double()
            assert ((got - ref).abs() <= bound(w, x, activations)).all(), (qtype, activations, isa)


def test_a_weight_whose_bytes_disagree_with_its_shape_is_refused() -> None:
    w = random_weight("Q4_K", 32, 256, seed=0)
    with pytest.raises(ValueError, match=r"a Q4_K weight of shape \(32, 512\) needs 32 x 288 bytes"):
        ql.QuantLinear(ql.QuantizedWeight("Q4_K", w.blocks, (32, 512)))
    with pytest.raises(ValueError, match="cannot repack a Q6_K weight of shape"):
        ql.repack(ql.QuantizedWeight("Q6_K", np.zeros((32, 210 * 2), np.uint8), (32, 576)))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q3_K", "IQ2_XS", "Q4_1"])
def test_a_large_weight_repacks_row_chunk_by_row_chunk(qtype, monkeypatch) -> None:
    """A weight of many rows is repacked a chunk of rows at a time (temporaries of a few MB for a
    128256 x 2048 LM head), the chunks on threads, with the same records as one pass over all
    of it on one thread."""
    from ops import quant_records

    w = random_weight(qtype, 32 * 9, 512, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = ql.repack(w)
        monkeypatch.setattr(quant_records, "_CHUNK_WEIGHTS", 64 * 512)  # 64 rows a chunk on one thread, 32 on more
        for n in (1, 2, 3, 16):  # a chunk a thread (rows of 32 at the least), more threads than chunks
            torch.set_num_threads(n)
            assert torch.equal(ql.repack(w), whole), n
    finally:
        torch.set_num_threads(threads)


# ---- the fused decoder (ops/cpu_decoder.py) over a model whose linears mix the types ----

# Per layer (qkv, o, gate_up, down), as a Q4_K_M file mixes Q4_K, Q6_K, Q5_0 and Q8_0 (a Q3_K_M file
# Q3_K with Q4_K and Q5_K, a Q2_K file Q2_K with Q3_K, an IQ3_XXS file IQ3_XXS with IQ2_S and
# IQ3_S), and more.
_LAYER_TYPES = [("Q4_K", "Q5_0", "Q3_K", "Q6_K"), ("Q5_K", "IQ4_XS", "Q8_0", "Q4_0"),
                ("IQ4_NL", "Q5_1", "F16", "BF16"), ("Q2_K", "Q6_K", "Q2_K", "Q3_K"),
                ("IQ2_XXS", "IQ3_S", "IQ1_M", "IQ3_XXS"), ("IQ2_S", "IQ1_S", "IQ2_XS", "Q4_K")]
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def mixed_model(activations: str, tied: bool):
    """A random Llama (hidden 512, 6 layers, vocab 544) whose every linear is a QuantLinear of
    another type, its embedding a QuantEmbedding (Q4_K tied to the head, or Q6_K with a Q6_K
    head of its own), as the runner swaps them in."""
    from worker.models.llama import LlamaConfig, LlamaForCausalLM
    from worker.weights.dummy import init_dummy

    cfg = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=544, hidden_size=512, intermediate_size=512,
                      num_layers=len(_LAYER_TYPES), num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    init_dummy(model)
    quantized = {}
    for i, types in enumerate(_LAYER_TYPES):
        for j, (name, qtype) in enumerate(zip(_LINEARS, types, strict=True)):
            shape = tuple(model.get_submodule(f"layers.{i}.{name}").weight.shape)
            quantized[f"layers.{i}.{name}"] = random_weight(qtype, *shape, seed=10 * i + j, scale=0.03)
    embed = random_weight("Q4_K" if tied else "Q6_K", cfg.vocab_size, cfg.hidden_size, seed=99, scale=0.5)
    if not tied:
        quantized["lm_head"] = random_weight("Q6_K", cfg.vocab_size, cfg.hidden_size, seed=98, scale=0.05)
    assert ql.quantize_linears(model, quantized, activations) == len(quantized)
    if tied:
        model.tied_head = ql.QuantLinear(embed, activations=ql.activations_for(embed, activations))
        model.embed_tokens = ql.QuantEmbedding.of_head(model.tied_head, embed)
    else:
        model.embed_tokens = ql.QuantEmbedding(embed)
    return model


@pytest.mark.parametrize(("activations", "tied"), [("float32", False), ("int16", True)])
def test_the_fused_decoder_runs_a_model_of_mixed_types(activations, tied) -> None:
    """The fused decoder takes a model whose linears are each of another type (and one of them
    float32 beside integer ones: a Q8_0 weight with a -128 quant): its hidden states are the
    op-by-op model's within the bound the default model's test states (the norms, rotary and
    SiLU round differently), a decode step's logits are the head's bit for bit, and a row's
    bits are the same alone and in batches."""
    from ops import cpu_decoder
    from tests.test_cpu_decoder import _Requests

    model = mixed_model(activations, tied)
    assert cpu_decoder.unsupported(model) is None
    kinds = {m.activations for m in model.modules() if isinstance(m, ql.QuantLinear)}
    assert kinds == ({"float32"} if activations == "float32" else {"int16", "float32"}), kinds
    dec = cpu_decoder.CpuDecoder(model, block_size=16)
    assert dec.head is not None
    lens = [37, 5, 70, 12, 1, 23]
    reqs = _Requests(model, lens, seed=1)
    reqs.ids = [[t % model.config.vocab_size for t in ids] for ids in reqs.ids]
    prefill = [(r, 0, n) for r, n in enumerate(lens)]
    decode = [(r, n, 1) for r, n in enumerate(lens)]
    bound = {"float32": 1e-4, "int16": 1e-3}[activations]
    for chunks in (prefill, decode):
        fused = dec(*reqs.step(chunks))
        with torch.inference_mode():
            ref = model(*reqs.step(chunks))
        rel = ((fused - ref).abs().max() / ref.abs().max()).item()
        assert rel < bound, f"relative error {rel:.2e}"
    hidden, logits = dec.forward(*reqs.step(decode), logits=True)
    with torch.inference_mode():
        assert logits is not None and torch.equal(logits, model.compute_logits(hidden))
    alone = torch.cat([dec(*reqs.step([c])) for c in decode])
    assert torch.equal(alone, hidden), "a row's bits differ alone and in a batch"
    for b in (2, 5):
        assert torch.equal(dec(*reqs.step(decode[:b])), hidden[:b])

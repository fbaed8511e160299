"""The C kernels built per instruction set (ops/cpu_kernels): the best ISA the CPU has is
taken, each ISA's build is its own cached file, and every build this CPU can run gives the
same bits as the AVX2 one (float32 and integer-activation matmuls, the GGUF types' and the
checkpoints' records, decode attention), and
every build keeps the prefetches its source asks for."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from ops import cpu_attention, cpu_kernels
from ops import quantized_linear as ql
from tests.test_checkpoint_records import WEIGHTS
from tests.test_quantized_linear import _q8_0_without_minus_128, _random_blocks
from worker.weights.hf_quantized import checkpoint_records

pytestmark = pytest.mark.skipif(not cpu_kernels.supported_isas(), reason="no AVX2/FMA/F16C here")


@pytest.fixture
def restore_isa():
    yield
    cpu_kernels.force_isa(None)
    ql._library.cache_clear()
    ql._library_int8.cache_clear()
    cpu_attention._library.cache_clear()


def test_the_best_isa_is_taken_and_named_in_the_build(restore_isa) -> None:
    flags = cpu_kernels._cpu_flags()
    best = cpu_kernels.isa()
    assert best == cpu_kernels.supported_isas()[0]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags:
        assert best == "avx512-vnni"
    elif "avx512f" not in flags:
        assert not best.startswith("avx512")
    paths = set()
    for name in cpu_kernels.supported_isas():
        cpu_kernels.force_isa(name)
        lib = cpu_kernels.load("quant_matmul")
        assert lib is not None and f"quant_matmul-{name}-" in lib._name
        paths.add(lib._name)
    # One file per ISA: a cache shared by different machines never mixes them up.
    assert len(paths) == len(cpu_kernels.supported_isas())


def test_an_isa_the_cpu_lacks_is_refused(restore_isa, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert cpu_kernels.supported_isas() == ["avx2"]
    with pytest.raises(ValueError, match="'avx512-vnni' is not one this CPU supports"):
        cpu_kernels.force_isa("avx512-vnni")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"sse4_2"})
    cpu_kernels.load.cache_clear()
    assert cpu_kernels.isa() is None and cpu_kernels.load("quant_matmul") is None


def _outputs() -> list[torch.Tensor]:
    """Every kernel's output on fixed inputs, with the libraries of the current ISA."""
    g = torch.Generator().manual_seed(0)
    out = []
    checkpoints = [checkpoint_records(WEIGHTS[name]()) for name in ("Q4_G128", "Q8_CH")]  # int8's -128 too
    for qw in (_random_blocks("Q4_1", 96, 576, seed=3), _q8_0_without_minus_128(64, 192, seed=4), *checkpoints):
        x = torch.randn(11, qw.shape[1], generator=g)
        for activations in ql.ACTIVATIONS:
            out.append(ql.QuantLinear(qw, activations=activations)(x))
    q = torch.randn(5, 9, 64, generator=g)
    k, v = torch.randn(2, 40, 16, 3, 64, generator=g)
    o = torch.empty_like(q)
    cpu_attention.decode(q, k, v, torch.arange(5), torch.randperm(40, generator=g)[:25].view(5, 5),
                         torch.tensor([1, 9, 17, 50, 80]), 0.125, o)
    out.append(o)
    return out


def test_every_isa_gives_the_avx2_bits(restore_isa) -> None:
    results = {}
    for name in cpu_kernels.supported_isas():
        cpu_kernels.force_isa(name)
        ql._library.cache_clear()
        ql._library_int8.cache_clear()
        cpu_attention._library.cache_clear()
        assert f"-{name}-" in ql._library()._name
        results[name] = _outputs()
    for name, outs in results.items():
        for i, (a, b) in enumerate(zip(outs, results["avx2"], strict=True)):
            assert torch.equal(a, b), f"{name}: output {i} differs from the AVX2 build's"


def _prefetches(lib_path: str) -> dict[str, int]:
    """prefetcht0/t1 instructions in a built library, counted in objdump's disassembly."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib_path], capture_output=True, text=True,
                          check=True).stdout
    counts = {"prefetcht0": 0, "prefetcht1": 0}
    for m in re.finditer(r"\s(prefetcht[01])\s", text):
        counts[m.group(1)] += 1
    return counts


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")
def test_every_isas_decoder_build_keeps_its_weight_prefetches(restore_isa) -> None:
    """GCC counts a prefetch as no side effect: a helper it did not inline was a pure call
    nobody used, and the integer kernels' record prefetches were deleted from every build
    without a word (simd.h). Each build of the fused decoder must hold one per cache line of
    a record in every rows kernel it instantiates: dozens, not a loop or two."""
    for name in cpu_kernels.supported_isas():
        cpu_kernels.force_isa(name)
        lib = cpu_kernels.load("decoder")
        assert lib is not None
        counts = _prefetches(lib._name)
        # Records and the attention's keys and values go into L2 (t1) in every build.
        assert counts["prefetcht1"] >= 40, (name, counts)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")
def test_avx2_float32_kernels_unpack_quants_within_128_bit_halves(restore_isa) -> None:
    """The AVX2 float32 kernels spread Q4_1's quant bytes to 32-bit lanes with vpshufb inside
    each 128-bit half, and sign-extend Q8_0's straight from memory (quant_matmul.c).
    vpmovzxbd/vpmovsxbd from an xmm register into a ymm cross the halves and had set the
    one-row loop's pace on Zen 3 (the batch-1 call 1.16-1.22x slower with them): none may come
    back into an AVX2 build (the old code compiled to 34)."""
    builds = [n for n in ("avx2", "avx2-vnni") if n in cpu_kernels.supported_isas()]
    if not builds:
        pytest.skip("no AVX2 build here")
    for name in builds:
        cpu_kernels.force_isa(name)
        lib = cpu_kernels.load("quant_matmul")
        assert lib is not None
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib._name], capture_output=True,
                              text=True, check=True).stdout
        assert not re.findall(r"\svpmov[sz]xbd\s+%xmm\d+,\s*%ymm", text), name
        assert len(re.findall(r"\svpshufb\s", text)) >= 8, name  # Q4_1's spreading is there
        # Q8_0's: a memory operand (an address in parentheses) into a ymm
        assert len(re.findall(r"\svpmovsxbd\s+[^%\s]*\(%\w+[^)]*\),\s*%ymm", text)) >= 8, name

"""Pre-quantized checkpoints on the CPU, per format of the issue's table, against references
no one here wrote (tests/quant_checkpoints.py makes the checkpoints and the references).

Dequantized at load (weight-only, float32; --no-cpu-quantized-linear, and fp8 always), each
format is compared with transformers' float32 Llama on the same dequantized weights: decompressed by
compressed-tensors for its folders, by an independent numpy dequantization for the native
fp8, fbgemm_fp8, awq and gptq layouts. Shown: greedy tokens identical over 16 new tokens on
3 prompts (the worker's engine against transformers' generate), and the last position's
logits within 1e-5 of the largest (float32 on the same weights: only the order of sums
differs). The int4 and int8 formats on the CPU kernels' records (their default on the CPU
in float32) against the same references: greedy tokens identical (shown there, not again
dequantized), logits within their arithmetic's bounds.

The GPU's arithmetic (activations quantized as the checkpoint says) is the Triton kernels'
(tests/test_scaled_linear_triton.py against `scaled_linear_ref`); here that reference runs
a whole model on the CPU against transformers + compressed-tensors, which quantizes
activations likewise (FP8 per token and per group). INT8 is not compared that way:
compressed-tensors' int8 activation scale is amax / 127.5, vLLM's and ours amax / 127.
And the GPU's whole path (the Triton linears, attention and cache writes over an fp8 KV
cache) runs in Triton's interpreter against the torch references; the planner's bytes are
the loader's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import ops
from ops.scaled_linear import ScaledLinear
from scheduler.request import SamplingParams
from tests import quant_checkpoints as qc
from tests.helpers import last_logits
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import hf_folder, hf_quantized, load_model

pytest.importorskip("compressed_tensors")
PROMPTS = [[1, 45, 77, 300, 12, 9], [1, 200, 201, 202, 7, 99, 411, 36, 5, 18, 260, 3], [1, 5]]
NEW_TOKENS = 16
CT = {"ct-fp8-channel": "FP8_DYNAMIC", "ct-fp8-block": "FP8_BLOCK", "ct-w4a16": "W4A16",
      "ct-w4a16-asym": "W4A16_ASYM", "ct-w8a8": "W8A8", "ct-w8a16": "W8A16"}
NAMES = {"ct-fp8-channel": "compressed-tensors FP8 per-channel weights, dynamic per-token activations",
         "ct-fp8-block": "compressed-tensors FP8 128x128 block weights, dynamic per-group (128) activations",
         "ct-w4a16": "compressed-tensors W4A16 groups of 128, symmetric",
         "ct-w4a16-asym": "compressed-tensors W4A16 groups of 128, asymmetric (zero points)",
         "ct-w8a8": "compressed-tensors INT8 per-channel weights, dynamic per-token activations",
         "ct-w8a16": "compressed-tensors W8A16 INT8 groups of 128 weights",
         "fp8": "fp8 FP8 128x128 block weights, dynamic per-group (128) activations",
         "fbgemm": "fbgemm_fp8 FP8 per-channel weights, dynamic per-token activations",
         "awq": "awq W4A16 groups of 128, asymmetric (zero points)",
         "gptq": "gptq W4A16 groups of 128, symmetric"}


@pytest.fixture(scope="session")
def float_folder(tmp_path_factory):
    return qc.tiny_llama(tmp_path_factory.mktemp("float"))


@pytest.fixture(scope="session")
def folder(float_folder, tmp_path_factory):
    """The checkpoint of a format, made once per session (auto-round's once per cache)."""
    made = {}

    def get(fmt: str):
        if fmt not in made:
            out = tmp_path_factory.mktemp(fmt)
            if fmt in CT:
                made[fmt] = qc.compressed_tensors(out, CT[fmt], float_folder)
            elif fmt == "fp8":
                made[fmt] = qc.native_fp8(out, float_folder)
            elif fmt == "fbgemm":
                made[fmt] = qc.fbgemm_fp8(out, float_folder)
            elif fmt == "awq":
                made[fmt] = qc.auto_round("auto_awq", sym=False)
            else:
                made[fmt] = qc.auto_round("auto_gptq", sym=True)
        return made[fmt]

    return get


# The int4 and int8 formats as the CPU holds them by default: the kernels' record types.
ON_RECORDS = {"gptq": "Q4_0", "awq": "Q4_G128", "ct-w4a16": "Q4_G128", "ct-w4a16-asym": "Q4_G128",
              "ct-w8a8": "Q8_CH", "ct-w8a16": "Q8_CH"}  # (ct-w4a16: float32 scales, zero 8: m = -8 s)


@dataclass
class _Reference:
    logits: list[torch.Tensor]  # the last position's, per prompt
    greedy: list[list[int]]


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' float32 Llama on a format's dequantized weights (compressed-tensors'
    decompression, or the numpy one): its logits and greedy tokens, made once per format."""
    made = {}

    def get(fmt: str) -> _Reference:
        if fmt not in made:
            path = folder(fmt)
            model = qc.transformers_model(path, qc.ct_dequantized(path) if fmt in CT else qc.numpy_dequantized(path))
            with torch.inference_mode():
                logits = [model(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
            made[fmt] = _Reference(logits, _hf_greedy(model))
        return made[fmt]

    return get


def _engine_greedy(loaded) -> list[list[int]]:
    engine = Engine(WorkerConfig(model=ModelConfig(max_model_len=128), cache=CacheConfig(kv_cache_memory=0.01)),
                    loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = [c.token_ids for c in engine.generate([engine.make_request(p, params) for p in PROMPTS])]
    assert engine.kv.blocks_in_use() == 0
    return out


@torch.inference_mode()
def _hf_greedy(model) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("fmt", [*CT, "fp8", "fbgemm", "awq", "gptq"])
def test_format_against_transformers_on_the_dequantized_weights(fmt, folder, reference) -> None:
    path = folder(fmt)
    # Dequantized (--no-cpu-quantized-linear; the CPU kernels' records of int4 and int8:
    # test_int4_and_int8_on_the_cpus_integer_kernels)
    loaded = load_model(str(path), cpu_quantized_linear=False)
    assert loaded.quantization is not None and loaded.quantization.name == NAMES[fmt]
    assert "dequantized at load" in loaded.describe_weights()
    state = qc.ct_dequantized(path) if fmt in CT else qc.numpy_dequantized(path)
    ref = reference(fmt)
    # The dequantized weights themselves: what the worker holds is the reference's, exactly.
    ours = loaded.model.layers[1].self_attn.qkv_proj.weight
    theirs = torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(ours, theirs)
    for p, want in zip(PROMPTS, ref.logits, strict=True):  # (before an engine's runner takes the model)
        torch.testing.assert_close(last_logits(loaded.model, p), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert len({t for row in ref.greedy for t in row}) > 4, "a degenerate reference (one token over and over)"
    if fmt not in ON_RECORDS:  # (those formats' greedy tokens: on the CPU's default, the records)
        assert _engine_greedy(loaded) == ref.greedy


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "ct-fp8-block"])
def test_the_gpu_arithmetic_is_compressed_tensors_own(fmt, folder) -> None:
    """The model with its weights kept quantized, on `scaled_linear_ref` (the Triton kernels'
    reference: activations quantized per token / per group), against transformers +
    compressed-tensors, which quantizes activations the same way on the CPU: greedy tokens
    identical, logits within 1e-3 (fp8 quants of one activation may round apart by an ulp
    where float32 sums differ in order)."""
    from transformers import AutoModelForCausalLM

    path = folder(fmt)
    cfg = hf_folder.read_config(path)
    fmt_ = hf_folder.read_quantization(path)
    files = hf_folder.safetensors_files(path)
    model = hf_quantized.load_quantized(cfg, fmt_, hf_folder.tensor_names(files), hf_folder.iter_safetensors(files),
                                        torch.device("cpu"), torch.float32, dequantize_on_cpu=False)
    assert sum(isinstance(m, ScaledLinear) for m in model.modules()) == 2 * 4
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with ops.use_backend("torch"):
        for p in PROMPTS:
            with torch.inference_mode():
                theirs = ref(torch.tensor([p])).logits[0, -1]
            ours = last_logits(model, p)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)
            assert int(ours.argmax()) == int(theirs.argmax())


@pytest.mark.parametrize("fmt", ["ct-fp8-block", "ct-w4a16-asym", "gptq"])
def test_the_planner_holds_what_the_loader_holds(fmt, folder) -> None:
    """`llm-worker plan` on a GPU: the linears as the loader keeps them for the kernels (its
    ScaledLinear bytes, here kept on the CPU), the rest in bf16; on the CPU dequantized."""
    from worker import plan

    path = folder(fmt)
    info = plan.read_model(str(path))
    gpu = plan.weights(info, plan.DEVICES["h100"], "bfloat16")
    kind = info.quantization.kind
    cfg = hf_folder.read_config(path)
    files = hf_folder.safetensors_files(path)
    model = hf_quantized.load_quantized(cfg, info.quantization, hf_folder.tensor_names(files),
                                        hf_folder.iter_safetensors(files), torch.device("cpu"), torch.float32,
                                        dequantize_on_cpu=False)
    assert gpu.held[kind] == sum(m.weight.nbytes for m in model.modules() if isinstance(m, ScaledLinear))
    assert kind in gpu.how or info.quantization.name in gpu.how
    cpu = plan.weights(info, plan.Device("cpu", "cpu", 1 << 34, 1e10, {"float32": 1e11}), "float32")
    assert kind not in cpu.held
    records = {"ct-w4a16-asym": "Q4_G128", "gptq": "Q4_0"}
    if fmt in records:  # held as the CPU kernels' records (test_int4_and_int8_on_the_cpus_integer_kernels)
        from ops.quantized_linear import QuantLinear

        on_cpu = load_model(str(path), cpu_activations="float32").model
        assert cpu.held[records[fmt]] == sum(m.packed.nbytes for m in on_cpu.modules() if isinstance(m, QuantLinear))
        assert f"{records[fmt]} records" in cpu.how
    else:
        assert "dequantized at load" in cpu.how


@torch.inference_mode()
def _logits_with_cache(model, ids: list[int], kv_dtype: torch.dtype, block_size: int = 16) -> torch.Tensor:
    """A whole-prompt forward through a private paged cache of `kv_dtype`; every position's logits."""
    from worker.models.llama import AttentionMetadata

    cfg = model.config
    n = len(ids)
    nblk = -(-n // block_size)
    kv = [tuple(torch.zeros(nblk, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype) for _ in range(2))
          for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(nblk, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([n]), query_start_loc=torch.tensor([0, n]), max_query_len=n,
                             max_seq_len=n)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, kv))


@pytest.mark.parametrize("fmt", ["ct-fp8-block", "ct-w8a8", "gptq"])
def test_the_gpu_path_end_to_end_in_the_interpreter(fmt, folder) -> None:
    """The model as CUDA runs it (ScaledLinear on the Triton kernels, Triton attention and
    cache writes over an fp8 KV cache with the layers' scales), in Triton's interpreter,
    against the same model on the torch references: every position's logits within 1e-3
    of their largest and the same argmax (each kernel matches its reference; a float32
    sum's last bit may still move one fp8 activation by an ulp)."""
    pytest.importorskip("triton")
    path = folder(fmt)
    cfg = hf_folder.read_config(path)
    files = hf_folder.safetensors_files(path)
    model = hf_quantized.load_quantized(cfg, hf_folder.read_quantization(path), hf_folder.tensor_names(files),
                                        hf_folder.iter_safetensors(files), torch.device("cpu"), torch.float32,
                                        dequantize_on_cpu=False)
    for i, layer in enumerate(model.layers):
        layer.self_attn.k_scale, layer.self_attn.v_scale = 0.05 * (i + 1), 0.03 * (i + 1)
    ids = PROMPTS[1]
    with ops.use_backend("torch"):
        want = _logits_with_cache(model, ids, torch.float8_e4m3fn)
    with ops.use_backend("triton"):
        got = _logits_with_cache(model, ids, torch.float8_e4m3fn)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fmt, qtype", ON_RECORDS.items())
def test_int4_and_int8_on_the_cpus_integer_kernels(fmt, qtype, folder, reference) -> None:
    """Every quantized linear held on the CPU kernels' records (no float32 copy): GPTQ
    (symmetric, fp16 scales) as Q4_0 blocks, AWQ, compressed-tensors' W4A16 (float32
    scales) and its asymmetric W4A16 (zero points) as Q4_G128 (float32 d = s and m = -s z per group of 128), W8A8's int8
    per-channel weights and W8A16's groups of 128 as Q8_CH (float32 scales per output and 128
    inputs), multiplying in float32 (weight-only,
    W8A8's activations not quantized) and int16 activations (--cpu-activations): against
    transformers on the dequantized weights (compressed-tensors' own decompression, or the
    numpy one), float32 activations give its greedy tokens and logits within 2e-4 of the
    largest (Q4_G128 adds m times a block's sum of x: a cancellation the dequantized product
    does not have), int16 activations within 1e-2 of it."""
    from torch import nn

    from ops import quantized_linear
    from ops.quantized_linear import QuantLinear

    if not quantized_linear.available():
        pytest.skip("the CPU kernels do not build here")
    path = folder(fmt)
    ref = reference(fmt)
    for activations in ("float32", "int16"):
        loaded = load_model(str(path), cpu_activations=activations)
        linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == 4 * 2
        assert {(m.qtype, m.activations) for m in linears} == {(qtype, activations)}
        # No float copy of a quantized linear: the only float linear is the ignored lm_head.
        assert [n for n, m in loaded.model.named_modules() if isinstance(m, nn.Linear)] == ["lm_head"]
        assert f"{qtype} x8" in loaded.describe_weights()
        for p, want in zip(PROMPTS, ref.logits, strict=True):
            tol = (2e-4 if activations == "float32" else 1e-2) * float(want.abs().max())
            torch.testing.assert_close(last_logits(loaded.model, p), want, rtol=0, atol=tol)
        if activations == "float32":
            assert _engine_greedy(loaded) == ref.greedy

"""GGUF files made by llama.cpp's own tools (benchmarks/make_gguf_models.py: llama-quantize
from an F32 GGUF of the default model's weights; convert_hf_to_gguf.py from transformers'
save_pretrained) against transformers: the default model's Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0
and IQ4_XS variants and a pure K-quant model token for token, its IQ3_XXS file and one of
every IQ1-IQ3 grid type among them (made with llama-imatrix's importance matrix; transformers'
own GGUF loader, float32, is the reference), a Llama-3.1-style file (rope_freqs) against
transformers on its Hugging Face folder, and how each is held (the start-up log, the
capacity planner).

llama-quantize is found where a build left it (../shared/tools/build_llamacpp.sh,
$LLAMA_CPP_DIR) or built here (only that target, from the llama-cpp-python sdist on PyPI;
LLMWORKER_NO_LLAMACPP_BUILD=1 skips instead); the made files and transformers' greedy tokens
on them are kept in the cache ($LLMWORKER_GGUF_CACHE, ~/.cache/llm-worker/gguf-models).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import make_gguf_models as made
from ops.quantized_linear import QuantEmbedding
from tests.conftest import CHAT_PROMPTS
from tests.helpers import engine_greedy, hf_greedy, last_logits
from worker.weights import LoadedModel, load_model

NEW_TOKENS = 32


@pytest.fixture(scope="session")
def tools() -> made.Tools:
    found = made.find_tools()
    if found is not None:
        return found
    if os.environ.get("LLMWORKER_NO_LLAMACPP_BUILD"):
        pytest.skip("llama-quantize not found and LLMWORKER_NO_LLAMACPP_BUILD is set")
    try:
        return made.build_tools()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"llama-quantize could not be built here: {str(e)[:300]}")


@pytest.fixture(scope="session")
def out() -> Path:
    d = made.cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def default_variants(tools: made.Tools, out: Path) -> dict[str, Path]:
    return made.default_variants(tools, out)


@pytest.fixture(scope="session")
def kquant(tools: made.Tools, out: Path) -> dict[str, Path]:
    return made.kquant_model(tools, out)


@pytest.fixture(scope="session")
def llama31(tools: made.Tools, out: Path) -> dict[str, Path]:
    return made.llama31_model(tools, out)


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    assert tok is not None
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in CHAT_PROMPTS]


def _transformers_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens on the file (`gguf_file=`, float32), kept beside it by the
    file's and the prompts' digest and transformers' version (a load and 320 tokens take
    minutes on 2 cores)."""
    import transformers

    key = hashlib.sha256(json.dumps([path.name, path.stat().st_size, path.stat().st_mtime_ns, prompts,
                                     NEW_TOKENS, transformers.__version__]).encode()).hexdigest()[:16]
    cached = path.with_name(f"{path.name}.transformers-{key}.json")
    if cached.is_file():
        return json.loads(cached.read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ref = [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts]
    cached.write_text(json.dumps(ref))
    return ref


# Our logits' largest error against a float64 reference, relative to the largest |logit|, per
# activation arithmetic (the fused decoder's bound, tests/test_gguf_kernels.py).
LOGIT_BOUND = {"float32": 1e-4, "int16": 1e-3}


def _assert_same_greedy(path: Path) -> LoadedModel:
    """Our greedy tokens are transformers' until a step where the two can rightly differ: one
    whose float64 logits (transformers on the same file, float64) put the two tokens chosen
    within twice our logits' bound of each other, a near-tie that neither float32 (theirs)
    nor our activations decide. There our logits must be within the bound of float64's, and
    the prompt's comparison ends (the continuations differ after). A divergence at a larger
    gap, or logits beyond the bound, fails. (The pure K-quant model's Q6_K file has, prompt 5
    step 22, a float64 gap of 3.2e-4 with logits of up to 7.8: our int16 logits are 1.2e-3 off.)"""
    loaded = load_model(str(path))
    prompts = _prompts(loaded)
    ours = engine_greedy(loaded, prompts, NEW_TOKENS)
    ref = _transformers_greedy(path, prompts)
    hf64 = None
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), None)
        assert j is not None or a == b, f"{path.name}, prompt {i}: ours {a} != transformers {b}"
        if j is None:
            continue
        if hf64 is None:
            import transformers

            hf64 = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                     dtype=torch.float64).eval()
        seq = prompts[i] + b[:j]
        with torch.inference_mode():
            l64 = hf64(torch.tensor([seq])).logits[0, -1]
        bound = LOGIT_BOUND[loaded.linears.activations] * l64.abs().max().item()
        err = (last_logits(loaded.model, seq).double() - l64).abs().max().item()
        gap = abs(l64[a[j]] - l64[b[j]]).item()
        where = f"{path.name}, prompt {i}, token {j}: ours {a[j]}, transformers {b[j]}"
        assert err <= bound, f"{where}: our logits {err:.2e} off float64's, beyond the bound {bound:.2e}"
        assert gap <= 2 * bound, f"{where}: float64's logits {gap:.2e} apart, not a near-tie (bound {bound:.2e})"
    return loaded


@pytest.mark.slow
@pytest.mark.parametrize("variant", made.DEFAULT_VARIANTS)
def test_the_default_model_s_variants_give_transformers_greedy_tokens(default_variants, variant: str) -> None:
    loaded = _assert_same_greedy(default_variants[variant])
    kinds = {h.qtype for h in loaded.held}
    assert variant.split("_")[0] in "".join(kinds)  # the file holds the type it is named for


@pytest.mark.slow
@pytest.mark.parametrize("variant", made.KQUANT_VARIANTS)
def test_a_pure_k_quant_model_gives_transformers_greedy_tokens(kquant, variant: str) -> None:
    loaded = _assert_same_greedy(kquant[variant])
    matrices = {h.qtype for h in loaded.held if h.qtype != "F32"}
    assert matrices <= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} and matrices, matrices
    assert variant.split("_")[0] in "".join(matrices)  # the file holds the type it is named for
    assert all(h.how.endswith("records") for h in loaded.held if h.qtype != "F32"), loaded.describe_weights()


# The IQ files (made with llama-imatrix's importance matrix, as llama-quantize wants): the IQ3_XXS
# preset's, and one of every grid type (make_gguf_models.MIXES: its tied embedding IQ3_S).
GRID_FILES = {"IQ3_XXS": {"IQ3_XXS", "IQ2_S", "IQ3_S"},
              "IQ_MIX": {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"}}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(GRID_FILES))
def test_the_grid_types_files_give_transformers_greedy_tokens(kquant, variant: str) -> None:
    """The pure K-quant model's IQ1-IQ3 files: every matrix on its records (before, each grid
    type's tensor was dequantized to float32 at load), greedy tokens transformers'."""
    loaded = _assert_same_greedy(kquant[variant])
    matrices = {h.qtype for h in loaded.held if h.qtype != "F32"}
    assert GRID_FILES[variant] <= matrices, matrices
    if variant == "IQ_MIX":
        assert isinstance(loaded.model.embed_tokens, QuantEmbedding) and matrices == GRID_FILES[variant], matrices
    assert all(h.how.endswith("records") for h in loaded.held if h.qtype != "F32"), loaded.describe_weights()


# ----- Llama 3.1's rope scaling, read from rope_freqs -----

def test_a_llama_3_1_gguf_equals_transformers_on_its_folder(llama31) -> None:
    """convert_hf_to_gguf wrote the folder's llama3 rope_scaling (original context 32: wavelengths
    above 32 tokens are slowed 8x) as rope_freqs; our GGUF load uses it as llama.cpp does,
    and equals transformers on the folder at prompts of 10 to 400 tokens, logits and greedy
    tokens. Without the factors the logits at 400 tokens are far off (the check can fail)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ops.rotary import rope_cos_sin_cache, rope_inv_freq

    hf = AutoModelForCausalLM.from_pretrained(str(llama31["folder"]), dtype=torch.float32).eval()
    ours = load_model(str(llama31["F32"]))
    cfg = ours.config
    assert cfg.rope_freq_factors is not None and cfg.rope_scaling is None
    assert max(cfg.rope_freq_factors) == 8.0 and min(cfg.rope_freq_factors) == 1.0
    ref_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    ours_inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None, cfg.rope_freq_factors)
    torch.testing.assert_close(ours_inv, ref_inv.float(), rtol=1e-6, atol=0)

    g = torch.Generator().manual_seed(0)
    for n in (10, 100, 400):
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        rel = ((last_logits(ours.model, ids) - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{n} tokens: relative max logit error {rel:.2e}"
    plain = load_model(str(llama31["F32"]))
    plain.model.cos_sin = rope_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    rel = ((last_logits(plain.model, ids) - ref).abs().max() / ref.abs().max()).item()
    assert rel > 1e-2, f"without rope_freqs the logits at {n} tokens are only {rel:.2e} off"

    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 120, 300)]
    assert engine_greedy(ours, prompts, 24) == [hf_greedy(hf, p, 24) for p in prompts]


# ----- how they are held -----

def test_the_start_up_log_says_per_type_what_is_held(default_variants) -> None:
    from worker.weights.gguf_reader import GGUFFile

    path = default_variants["Q4_K_M"]
    loaded = load_model(str(path))
    line = loaded.describe_weights()
    counts: dict[str, int] = {}
    tensors = GGUFFile(path).tensors  # (gguf-py's reader: ~10 s over the vocabulary)
    for t in tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    for qtype, n in counts.items():
        assert sum(h.qtype == qtype for h in loaded.held) == n
        assert f"{qtype} x" in line, (qtype, line)
    total = sum(t.n_bytes for t in tensors)
    assert sum(h.file_bytes for h in loaded.held) == total
    assert f"in all {total / (1 << 20):.1f} MiB in the file" in line
    # What a kernel takes is held at its records' size; the rest in float32.
    from ops.quantized_linear import held_bytes

    for h in loaded.held:
        if h.how.endswith("records"):
            assert h.held_bytes <= held_bytes(h.qtype, h.file_bytes, loaded.linears.activations) + 64, h
        else:
            assert h.how == "float32" and h.note, h


@pytest.mark.parametrize("which", ["default Q4_K_M", "kquant Q4_K_M", "kquant Q3_K_M", "kquant Q2_K", "default IQ4_XS",
                                   "kquant IQ_MIX"])
def test_the_planner_holds_what_the_runner_holds(default_variants, kquant, which: str) -> None:
    from tests.test_plan import CPU, _held_bytes
    from worker import plan
    from worker.config import CacheConfig, ModelConfig, WorkerConfig
    from worker.engine import Engine

    group, variant = which.split()
    path = (default_variants if group == "default" else kquant)[variant]
    engine = Engine(WorkerConfig(model=ModelConfig(max_model_len=512), cache=CacheConfig(kv_cache_memory=0.05)),
                    loaded=load_model(str(path)))
    w = plan.weights(plan.read_model(str(path)), CPU, "float32")
    assert sum(w.held.values()) == _held_bytes(engine.runner.model)


# ----- elsewhere than the CPU kernels: every tensor dequantized at load, one at a time -----

def _all_dequantized(loaded: LoadedModel, dtype: str, why: str) -> None:
    assert {h.how for h in loaded.held} == {dtype}, {h.how for h in loaded.held}
    assert all(why in h.note for h in loaded.held if len(h.name) and "norm" not in h.name), loaded.held[:3]
    assert f"as {dtype} ({why}" in loaded.describe_weights()


def test_a_k_quant_file_in_bfloat16_is_dequantized_per_tensor(kquant) -> None:
    """The path CUDA takes (no GGUF kernels there), on the CPU in bfloat16: the same logits
    as the float32 load within bfloat16's precision."""
    path = str(kquant["Q4_K_M"])
    ours = load_model(path, "cpu", torch.bfloat16)
    _all_dequantized(ours, "bfloat16", "the CPU kernels take float32 loads: dequantized at load to bfloat16")
    ref = load_model(path, cpu_quantized_linear=False)
    ids = list(range(100, 160))
    a, b = last_logits(ours.model, ids).float(), last_logits(ref.model, ids)
    assert ((a - b).abs().max() / b.abs().max()).item() < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_k_quant_file_loads_on_cuda_dequantized(kquant) -> None:
    from worker.config import ModelConfig, WorkerConfig
    from worker.engine import Engine

    path = str(kquant["Q4_K_M"])
    engine = Engine(WorkerConfig(model=ModelConfig(model=path, device="cuda", max_model_len=512)))
    _all_dequantized(engine.loaded, "bfloat16", "no GGUF kernels on cuda: dequantized at load")
    ref = load_model(path, cpu_quantized_linear=False)
    ids = list(range(100, 160))
    a, b = last_logits(engine.loaded.model, ids).float().cpu(), last_logits(ref.model, ids)
    assert ((a - b).abs().max() / b.abs().max()).item() < 5e-2

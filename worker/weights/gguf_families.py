"""The GGUF architectures beyond Llama's layout: `phi3` (Phi-3, Phi-4-mini) and `gemma2`,
`gemma3`, read as llama.cpp reads them (src/models/phi3.cpp, gemma2.cpp, gemma3.cpp) from
what its convert_hf_to_gguf.py writes (conversion/phi.py, gemma.py):

- phi3: q/k/v fused on disk as `attn_qkv`, gate and up as one `ffn_up` (gate's rows first);
  `rope.dimension_count` the rotating share of a head (Phi-4-mini: 0.75); LongRoPE as the
  `rope_factors_long` / `rope_factors_short` tensors with `rope.scaling.attn_factor` and
  `rope.scaling.original_context_length` (no scaling type is written); `sliding_window` 0
  for none. llama.cpp disables Phi-3's window (its phi3.cpp); transformers, whose modeling
  code the Hugging Face folder's load follows, windows every layer: so do we, so a file and
  its folder give one model.
- gemma2 / gemma3: norms stored as 1 + w (the converter adds the 1: held as they are, never
  folded again); `ffn_norm` is the pre-feed-forward norm, beside `post_attention_norm` and
  `post_ffw_norm`; windowed layers by `attention.sliding_window_pattern` (a period, or one
  bool a layer) else llama.cpp's defaults (Gemma 2 every other layer, Gemma 3 five in six);
  Gemma 2's soft-caps (defaults 50 and 30); Gemma 3's local rope base `rope.freq_base_swa`
  (default 10,000, unscaled) and its optional final soft-cap. The attention scale is not in
  the file: llama.cpp's rule, 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B
  checkpoints (46 / 62 layers), which is each released checkpoint's query_pre_attn_scalar.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ops.rotary import RopeScaling
from worker.models.gemma import GemmaConfig
from worker.weights.gguf_meta import Metadata
from worker.weights.gguf_reader import GGUFFile

log = logging.getLogger(__name__)

GEMMA = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

# Tensor names that differ from Llama's (gguf_file._LAYER_NAMES) in these architectures.
LAYER_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    **{arch: {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "ffn_norm.weight": "pre_feedforward_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"} for arch in GEMMA},
}
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's Gemma defaults where the file leaves a key out.
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def _bad(path: Path, key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{path}: GGUF {key} = {str(value)[:100]!r}: {why}")


def window(reader: GGUFFile, path: Path, arch: str, context: int, default: int | None = None) -> int | None:
    """`{arch}.attention.sliding_window`, None for none (0, as the phi3 converter writes for
    Phi-4). A window not below the context excludes no key: global, as transformers and vLLM
    take such configs (Phi-3-mini-128k: 262,144 over 131,072), and the log says so."""
    key = f"{arch}.attention.sliding_window"
    w = _field(reader, key, default)
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int | np.integer) or w < 0:
        raise _bad(path, key, w, "a window is a count of tokens (0: none)")
    if w == 0:
        return None
    if w >= context:
        log.warning("GGUF %s %d is not below the context %d: every layer attends to every key", key, w, context)
        return None
    return int(w)


def phi3_fields(reader: GGUFFile, path: Path, base: dict[str, Any], rotary_dim: int) -> dict[str, Any]:
    """Phi-3's window and LongRoPE (from its factor tensors) over the generic fields."""
    context = base["max_position_embeddings"]
    out: dict[str, Any] = {"sliding_window": window(reader, path, "phi3", context)}
    tensors = {t.name: t for t in reader.tensors if t.name in LONGROPE_TENSORS}
    if not tensors:
        if Metadata(reader.fields, path).string("phi3.rope.scaling.type") == "longrope":
            raise ValueError(f"{path}: GGUF phi3.rope.scaling.type is longrope but the file has no "
                             f"{' or '.join(LONGROPE_TENSORS)}")
        return out
    if len(tensors) != 2:
        raise ValueError(f"{path}: LongRoPE needs both {' and '.join(LONGROPE_TENSORS)}; the file has "
                         f"{', '.join(tensors)} alone")
    half = rotary_dim // 2
    factors = {}
    for name, t in tensors.items():
        if t.tensor_type.name != "F32" or t.shape != (half,):
            raise ValueError(f"{path}: {name} is {t.tensor_type.name} of shape {list(t.shape)}; F32 of "
                             f"[{half}] (rotary dimensions / 2) expected")
        values = np.array(t.data, dtype=np.float32)
        if not (np.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"{path}: {name} holds a factor that is not finite and positive")
        factors[name.split("_")[2].removesuffix(".weight")] = [float(v) for v in values]
    meta = Metadata(reader.fields, path)
    key = "phi3.rope.scaling.original_context_length"
    orig = meta.integer(key, low=1)
    if orig is None:
        raise ValueError(f"{path}: GGUF {key} is missing: LongRoPE's factors need the original context")
    rs = {"rope_type": "longrope", "short_factor": factors["short"], "long_factor": factors["long"]}
    attn = meta.number("phi3.rope.scaling.attn_factor")
    if attn is not None:
        rs["attention_factor"] = attn
    try:
        out["rope_scaling"] = RopeScaling.from_hf(rs, context, orig)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return out


def gemma_config(reader: GGUFFile, path: Path, arch: str, base: dict[str, Any]) -> GemmaConfig:
    """A Gemma 2 / 3 config from the generic fields and the Gemma keys (llama.cpp's defaults)."""
    n = base["num_layers"]
    context = base["max_position_embeddings"]
    gemma2 = arch == "gemma2"
    raw = _field(reader, f"{arch}.attention.sliding_window", 4096 if gemma2 else None)
    w = window(reader, path, arch, context, 4096 if gemma2 else None)
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = _field(reader, key, _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise _bad(path, key, pattern, f"{len(pattern)} entries for {n} layers")
        swa = [bool(x) for x in pattern]
    elif isinstance(pattern, int | np.integer) and not isinstance(pattern, bool) and pattern >= 0:
        swa = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]  # llama.cpp's set_swa_pattern
    else:
        raise _bad(path, key, pattern, "a period (0: every layer) or one bool a layer")
    if raw in (None, 0):
        swa = [False] * n  # no window at all (a Gemma 3 file without the key): every layer global
    heads, head_dim = base["num_heads"], base["head_dim"]
    scalar = base["hidden_size"] // heads if n == _GEMMA_27B_LAYERS[arch] else head_dim

    meta = Metadata(reader.fields, path)

    def cap(name: str, default: float | None) -> float | None:
        v = meta.number(f"{arch}.{name}", default, positive=False)
        if v is not None and v < 0:
            raise meta.bad(f"{arch}.{name}", v, "a cap above 0 (0: none)")
        return v or None

    local = meta.number(f"{arch}.rope.freq_base_swa", None if gemma2 else 10000.0)
    if local is not None and gemma2:
        if local == base["rope_theta"]:
            local = None
        elif base["rope_scaling"] is not None:  # llama.cpp scales Gemma 2's local table too; we do not
            raise _bad(path, f"{arch}.rope.freq_base_swa", local, "a local rope base beside rope scaling")
    fields = {**base, "architecture": GEMMA[arch], "qk_norm": not gemma2, "sliding_window": w,
              "layer_types": tuple("sliding_attention" if s else "full_attention" for s in swa)}
    return GemmaConfig(**fields, query_pre_attn_scalar=float(scalar),
                       attn_logit_softcapping=cap("attn_logit_softcapping", 50.0) if gemma2 else None,
                       final_logit_softcapping=cap("final_logit_softcapping", 30.0 if gemma2 else None),
                       rope_local_theta=local)

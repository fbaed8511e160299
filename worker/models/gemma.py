"""Gemma 2 and Gemma 3 (text) on the Llama decoder (worker/models/llama.py).

Where they differ from Llama, as transformers' modeling code computes them:
- RMSNorm times (1 + w): the checkpoint's w is held as 1 + w, folded at load in float32 (so
  every norm kernel, the fused CPU decoder's included, runs Gemma's norm unchanged), and
  the norms' arithmetic is Gemma's float32 one: x normalized and multiplied in float32,
  rounded once to the activations' dtype (`_norm`);
- embeddings times sqrt(hidden_size), that constant rounded to the weights' dtype first;
- four norms a layer: each sublayer's output is normalized (post_attention_layernorm,
  post_feedforward_layernorm) before the residual add, and the MLP's input by its own
  (pre_feedforward_layernorm);
- GeGLU: gelu_pytorch_tanh(gate) * up;
- attention scale query_pre_attn_scalar ** -0.5; Gemma 2's scores soft-capped, c tanh(s / c)
  (attn_logit_softcapping), and its logits (final_logit_softcapping);
- windowed and global layers (`layer_types`; without them Gemma 2 alternates, first layer
  windowed, and Gemma 3 has one global layer in sliding_window_pattern);
- Gemma 3: q/k norms (the Llama decoder's qk_norm hook), and two rotary tables: the
  windowed layers' base rope_local_base_freq with no scaling, the global layers'
  rope_theta with the config's rope_scaling (linear 8 on the 4B-27B checkpoints).

Gemma3ForConditionalGeneration folders load their language model: its tensors' prefix is
dropped and the vision tower's and projector's tensors are skipped (the log says so).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

import ops
from worker.models.llama import (
    GEMMA_ARCHITECTURES,
    MLP,
    AttentionMetadata,
    DecoderLayer,
    KVCache,
    LayerLora,
    LlamaConfig,
    LlamaForCausalLM,
    our_name,
)

log = logging.getLogger(__name__)

# transformers' defaults where a Gemma config leaves a field out (Gemma2Config / Gemma3TextConfig).
_DEFAULTS = {
    "Gemma2ForCausalLM": dict(rope_theta=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0, head_dim=256,
                              max_position_embeddings=8192, tie_word_embeddings=True),
    "Gemma3ForCausalLM": dict(rope_theta=1_000_000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
                              sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                              head_dim=256, max_position_embeddings=131_072, tie_word_embeddings=True,
                              vocab_size=262_208),
}
# The tensors of a Gemma 3 multimodal checkpoint that are not its language model's.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_LANGUAGE_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")
# The norms every layer has (a checkpoint without one is refused, naming it).
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3's windowed layers' rotary base (no scaling there); None: every layer's table is one.
    rope_local_theta: float | None = None

    ARCHITECTURES: ClassVar[tuple[str, ...]] = GEMMA_ARCHITECTURES

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0):
                raise ValueError(f"{name} must be a positive number or null, not {str(v)[:40]!r}")

    @property
    def gemma3(self) -> bool:
        return self.architecture != "Gemma2ForCausalLM"

    @property
    def num_params(self) -> int:
        return super().num_params + 2 * self.hidden_size * self.num_layers  # the post norms

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GemmaConfig:
        """From a Gemma 2 / Gemma 3 config.json (a ConditionalGeneration's text_config),
        in transformers 4's layout (rope_theta, rope_local_base_freq, rope_scaling) or 5's
        (rope_parameters by layer type)."""
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch == "Gemma3ForConditionalGeneration":
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("a Gemma3ForConditionalGeneration config needs its text_config")
            cfg = {**text, "architectures": [arch]}
        defaults = _DEFAULTS["Gemma2ForCausalLM" if arch == "Gemma2ForCausalLM" else "Gemma3ForCausalLM"]
        cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")}}
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {str(act)[:40]!r}: Gemma runs gelu_pytorch_tanh only")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is true: an encoder (EmbeddingGemma), not served here")
        global_rs, local_theta = _gemma_rope(cfg, arch)
        num_layers = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if types is None:  # transformers' patterns for configs written before layer_types
            every = 2 if arch == "Gemma2ForCausalLM" else int(cfg.get("sliding_window_pattern")
                                                              or cfg.get("_sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
        if not isinstance(types, list):
            raise ValueError(f"layer_types must be a list, not {str(types)[:40]!r}")
        base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        base["rope_theta"] = global_rs.pop("rope_theta")
        base["rope_scaling"] = global_rs or None
        plain = LlamaConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"]})
        fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(LlamaConfig)}
        return cls(**{**fields, "architecture": arch, "qk_norm": arch != "Gemma2ForCausalLM",
                      "sliding_window": cfg.get("sliding_window"), "layer_types": tuple(types)},
                   query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
                   attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                   final_logit_softcapping=cfg.get("final_logit_softcapping"),
                   rope_local_theta=local_theta)


def _gemma_rope(cfg: dict[str, Any], arch: str) -> tuple[dict[str, Any], float | None]:
    """The global layers' rope dict (rope_theta and any scaling) and Gemma 3's local base."""
    rp = cfg.get("rope_parameters")
    if arch == "Gemma2ForCausalLM":
        rs = dict(rp or cfg.get("rope_scaling") or {})
        rs.setdefault("rope_theta", cfg["rope_theta"])
        return rs, None
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, local = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
    else:
        full, local = dict(cfg.get("rope_scaling") or {}), {"rope_theta": cfg["rope_local_base_freq"]}
    full.setdefault("rope_theta", cfg["rope_theta"])
    kind = local.get("rope_type", local.get("type")) or "default"
    if kind != "default":
        raise ValueError(f"rope_parameters.sliding_attention type {str(kind)[:40]!r}: Gemma 3's local "
                         "layers rotate with their base alone")
    return full, float(local.get("rope_theta", cfg["rope_local_base_freq"]))


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
          residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.rms_norm with `weight` = 1 + w (float32). Float32 activations take the kernels;
    others Gemma's arithmetic, normalized and multiplied in float32 and rounded once (Llama's
    rounds before the multiply)."""
    if x.dtype == torch.float32:
        return ops.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype), x


class GemmaMLP(MLP):
    activation = "gelu_tanh"  # (ops/cpu_decoder.py reads it)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        from worker.models.llama import _linear

        h = ops.gelu_tanh_and_mul(_linear(self.gate_up_proj, x, lora, "gate_up_proj"))
        return _linear(self.down_proj, h, lora, "down_proj")


def _norm_param(n: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(n, dtype=torch.float32))  # 1 + w: float32 whatever the model's dtype


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: GemmaConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        h = cfg.hidden_size
        self.input_layernorm, self.post_attention_layernorm = _norm_param(h), _norm_param(h)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = _norm_param(h), _norm_param(h)
        self.mlp = GemmaMLP(cfg)
        attn = self.self_attn
        attn.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        attn.softcap = cfg.attn_logit_softcapping
        if cfg.qk_norm:
            attn.q_norm, attn.k_norm = _norm_param(cfg.head_dim), _norm_param(cfg.head_dim)
        # Gemma 3's windowed layers' own rotary table (set by the model; None: the model's).
        attn.cos_sin = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        lora: LayerLora | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As Llama's, the residual add fused into the next norm: the sublayers' outputs are
        # normalized first (post_*), then added by the norm that reads the sum (pre_*).
        h, residual = _norm(x, self.input_layernorm, self.eps, residual)
        own = self.self_attn.cos_sin
        h = self.self_attn(h, positions, cos_sin if own is None else own, meta, kv_cache, lora)
        h, _ = _norm(h, self.post_attention_layernorm, self.eps)
        h, residual = _norm(h, self.pre_feedforward_layernorm, self.eps, residual)
        h, _ = _norm(self.mlp(h, lora), self.post_feedforward_layernorm, self.eps)
        return h, residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    config: GemmaConfig

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__(cfg)
        self.norm = _norm_param(cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5  # times the table's rows, in its dtype
        self._local_rope()

    def _local_rope(self) -> None:
        """Gemma 3's windowed layers' table (the local base, unscaled), shared by those layers."""
        cfg = self.config
        if cfg.rope_local_theta is None:
            return
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
        self.register_buffer("cos_sin_local", _rope(local), persistent=False)
        for i, layer in enumerate(self.layers):
            if cfg.window_of(i) is not None or cfg.layer_types[i] == "sliding_attention":
                layer.self_attn.cos_sin = self.cos_sin_local

    def make_rope_tables(self) -> None:
        super().make_rope_tables()
        self._local_rope()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        step_lora = meta.lora
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            lora = None if step_lora is None else (step_lora.rows, step_lora.layers[i])
            x, residual = layer(x, residual, positions, self.cos_sin, meta, kv_cache, lora)
        x, _ = _norm(x, self.norm, self.config.rms_norm_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().compute_logits(hidden), self.config.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama loader's, on the language model's tensors with each norm's w as 1 + w;
        a missing norm is named."""
        norms = {f"layers.{i}.{n}" for i in range(self.config.num_layers) for n in LAYER_NORMS} | {"norm"}
        if self.config.qk_norm:
            norms |= {f"layers.{i}.self_attn.{n}" for i in range(self.config.num_layers) for n in ("q_norm", "k_norm")}
        seen: set[str] = set()

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            skipped = 0
            for name, t in weights:
                if name.startswith(_VISION_PREFIXES):
                    skipped += 1
                    continue
                for p in _LANGUAGE_PREFIXES:
                    if name.startswith(p):
                        name = "model." + name.removeprefix(p)
                        break
                ours = our_name(name)
                if ours in norms:
                    seen.add(ours)
                    t = 1.0 + t.float()
                yield name, t
            if skipped:
                log.info("skipped %d vision tower and projector tensors: the language model alone is served "
                         "(text only)", skipped)
            missing = sorted(norms - seen)
            if missing:
                raise ValueError(f"a Gemma checkpoint without its norms: {', '.join(missing)[:300]} missing "
                                 f"(each layer has {', '.join(LAYER_NORMS)})")

        super().load_weights(text())


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap tanh(x / cap) (Gemma's logit soft-capping); x itself without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def _rope(cfg: LlamaConfig) -> torch.Tensor:
    from worker.models.llama import rope_cache

    return rope_cache(cfg)

"""The Llama family in one file: Llama 2/3 (with Llama-3 RoPE scaling), Mistral,
Qwen2 (q/k/v bias), Qwen3 (q/k norms), Phi-3/Phi-4 (partial rotary, LongRoPE) and SmolLM2.

The Llama decoder's hooks that other families take (worker/models/gemma.py): a per-head
RMSNorm of q and k before rotary (`q_norm`, `k_norm`), a rotary table narrower than the
head (`rotary_dim`), every RoPE variant as a precomputed table (ops/rotary.py), and a
window per layer (`window_of`).

Every forward pass is over a flat list of tokens from many requests (no batch
dimension, no padding): prefill chunks and decodes share one step. Attention
reads and writes a paged KV cache through `AttentionMetadata`; everything the
model computes goes through `ops`, so fused kernels replace references without
touching this file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

import ops
from ops.attention import StepPlan
from ops.lora import LoraRows, LoraStack
from ops.rotary import CONTEXT_DEPENDENT, RopeScaling

T = TypeVar("T")
log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM")
# Built by worker/models/gemma.py on this decoder (its GemmaConfig, GemmaForCausalLM).
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Architectures whose attention normalizes each q and k head before rotary (RMSNorm over head_dim).
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)
# transformers' names of a layer's attention (`layer_types`): a window, or every key.
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    # The window of the layers it applies to (see window_of); layer_types: each layer's
    # attention by transformers' names (None: every layer has the window).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # A GGUF's rope_freqs (Llama 3.1+): a divisor of each rotary pair's frequency, which the
    # converter computed from the llama3 rope_scaling (ops/rotary.py).
    rope_freq_factors: tuple[float, ...] | None = None
    # The share of each head that rotates (Phi-4-mini: 0.75): its first rotary_dim dimensions.
    partial_rotary_factor: float = 1.0
    # RMSNorm of each q and k head over head_dim before rotary (Qwen3's q_norm, k_norm).
    qk_norm: bool = False
    # The architectures this class builds (a family's subclass names its own: gemma.py).
    ARCHITECTURES: ClassVar[tuple[str, ...]] = SUPPORTED_ARCHITECTURES

    def __post_init__(self) -> None:
        if self.architecture not in self.ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES + GEMMA_ARCHITECTURES)
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be a positive integer or null, not {str(w)[:40]!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"num_hidden_layers {self.num_layers}")
            bad = next((t for t in self.layer_types if t not in LAYER_TYPES), None)
            if bad is not None:
                raise ValueError(f"layer_types entry {str(bad)[:40]!r} is not one of {', '.join(LAYER_TYPES)}")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], not {str(f)[:40]!r}")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor {f} leaves {self.rotary_dim} of head_dim {self.head_dim} "
                             "rotating: rotary pairs need an even number")
        if w is not None and w >= self.max_position_embeddings:
            log.warning("sliding_window %d is not below max_position_embeddings %d: every layer attends "
                        "to every key (as transformers and vLLM take such configs)", w, self.max_position_embeddings)

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions rotate (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)
    def window_of(self, layer: int) -> int | None:
        """How many of the most recent tokens a query at position p of `layer` attends to, p
        included: keys in (p - w, p], as transformers' sliding window (its mask keeps
        kv > q - w; vLLM's kernels take window_size (w - 1, 0), the same keys). None: every
        key up to p. A window at least max_position_embeddings excludes no key any position
        can have, so the layer is global: transformers and vLLM accept such configs
        (Phi-3-mini-128k ships a 262,144-token window over 131,072 positions), and so do we."""
        w = self.sliding_window
        if w is None or w >= self.max_position_embeddings:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return w

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face config.json dict."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if not isinstance(rs, dict):
            raise ValueError(f"rope_scaling must be an object, not {str(rs)[:40]!r}")
        phi3 = arch == "Phi3ForCausalLM"
        scaling = RopeScaling.from_hf(
            rs, max_pos, cfg.get("original_max_position_embeddings") if phi3 else None,
            legacy={"su": "longrope", "yarn": "longrope"} if phi3 else None)
        if scaling is not None and scaling.context_length is not None and scaling.context_length > max_pos:
            log.info("max_position_embeddings %d extended to %d by rope_scaling %s (factor %g), as vLLM serves it",
                     max_pos, scaling.context_length, scaling.rope_type, scaling.factor)
            max_pos = scaling.context_length
        theta = cfg.get("rope_theta")
        if theta is None and rs:  # transformers 5 keeps it in rope_parameters
            theta = rs.get("rope_theta")
        partial = cfg.get("partial_rotary_factor", rs.get("partial_rotary_factor", 1.0))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=scaling,
            partial_rotary_factor=1.0 if partial is None else partial,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            **_windows_from_hf(cfg, arch, int(cfg["num_hidden_layers"])),
        )

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        per_layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


def _windows_from_hf(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """sliding_window and layer_types as transformers' modeling code reads them for `arch`:
    Mistral's and Phi-3's window on every layer (their configs' layer_types are ignored
    there); Qwen2's and Qwen3's only with use_sliding_window, on the layers layer_types
    names, or else on layers from max_window_layers on; Llama has none."""
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return {"sliding_window": cfg.get("sliding_window")}
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window", False):
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if not isinstance(types, list):
            raise ValueError(f"layer_types must be a list, not {str(types)[:40]!r}")
        return {"sliding_window": cfg.get("sliding_window"), "layer_types": tuple(types)}
    return {}


@dataclass
class StepLora:
    """A step's LoRA input (worker/lora/slots.py): which rows use which adapter slot, and
    each layer's slot stacks by linear name (qkv_proj, o_proj, gate_up_proj, down_proj),
    only those some adapter of the step targets; and each token's slot (-1: the base
    model), which the CPU's fused decoder reads instead of `rows`."""

    rows: LoraRows
    layers: list[Mapping[str, LoraStack]]
    token_slots: Sequence[int] = ()


# One layer's share of a StepLora: the rows and that layer's stacks.
LayerLora = tuple[LoraRows, Mapping[str, LoraStack]]


def _linear(module: nn.Module, x: torch.Tensor, lora: LayerLora | None, name: str) -> torch.Tensor:
    """module(x), plus each LoRA row's adapter delta (ops/lora.py): one gathered computation
    for all the step's adapters; fused q/k/v and gate/up add theirs per output slice. A
    linear no adapter of the step targets has no stack in `lora` and is skipped. A
    row-parallel linear (worker/parallel/shard.py, `sums_partials`) takes the delta as a
    function: this rank's share of it joins its partial product before the all-reduce."""
    stack = None if lora is None else lora[1].get(name)
    if stack is None:
        return module(x)
    rows = lora[0]

    def add(y: torch.Tensor) -> torch.Tensor:
        return ops.lora_add(y, x, stack.a, stack.bs, rows)

    if getattr(module, "sums_partials", False):
        return module(x, add)
    return add(module(x))


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache (see ops/attention.py). One per step:
    every layer of the step reads the same object."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1]
    max_query_len: int
    max_seq_len: int
    # The torch and C attention paths' grouping and masks, built by the step's first layer.
    plan: StepPlan = field(default_factory=StepPlan, repr=False, compare=False)
    # LoRA adapters of this step's rows; None = every row runs the base model.
    lora: StepLora | None = field(default=None, repr=False, compare=False)


KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, kv_heads, head_dim]


class Linear(nn.Linear):
    """nn.Linear without its random init: every weight comes from a checkpoint (load_weights
    checks that each was given) or from the dummy init. Kaiming init of the default model's
    linears took ~1.5 s of each worker's start."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without its random init, as Linear."""

    def reset_parameters(self) -> None:
        pass


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.window = cfg.window_of(layer)  # None: every key up to the query's position
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # One matmul for q, k and v.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.softcap: float | None = None  # tanh soft-capping of the scores (Gemma 2's 50)
        # Qwen3's per-head RMSNorm of q and k (over head_dim), before rotary.
        self.eps = cfg.rms_norm_eps
        self.q_norm = nn.Parameter(torch.empty(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(cfg.head_dim)) if cfg.qk_norm else None
        # An fp8 KV cache's per-tensor scales (--kv-cache-dtype fp8): the checkpoint's
        # k_scale / v_scale where it has them (worker/weights/hf_quantized.py), else 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = _linear(self.qkv_proj, x, lora, "qkv_proj").split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.eps)[0]
            k = ops.rms_norm(k, self.k_norm, self.eps)[0]
        k_cache, v_cache = kv_cache
        # Only an fp8 cache takes scales (the C kernels never see one: refused on the CPU).
        fp8 = {"k_scale": self.k_scale, "v_scale": self.v_scale} if k_cache.dtype == torch.float8_e4m3fn else {}
        q, _ = ops.rotary_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, **fp8)
        out = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_seq_len,
            self.scale,
            plan=meta.plan,
            window=self.window,
            **({"softcap": self.softcap} if self.softcap else {}),
            **fp8,
        )
        return _linear(self.o_proj, out.reshape(n, self.q_size), lora, "o_proj")


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        h = ops.silu_and_mul(_linear(self.gate_up_proj, x, lora, "gate_up_proj"))
        return _linear(self.down_proj, h, lora, "down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.mlp = MLP(cfg)

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
        # Residual adds are fused into the norms: norm(x + residual) -> (h, new residual).
        h, residual = ops.rms_norm(x, self.input_layernorm, self.eps, residual)
        h = self.self_attn(h, positions, cos_sin, meta, kv_cache, lora)
        h, residual = ops.rms_norm(h, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(h, lora), residual


class LlamaForCausalLM(nn.Module):
    layer_class: ClassVar[type[nn.Module]] = DecoderLayer  # a family's own (gemma.py)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        # A runner may swap this for a lookup on the GGUF's own blocks (QuantEmbedding).
        self.embed_tokens: nn.Module = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        # Under -tp both become a rank's vocabulary rows (worker/parallel/vocab.py): the lookup
        # summed over the ranks, and `lm_head` (tied or not) gathering the logits to rank 0.
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A runner may give a tied model a head of its own (a packed or quantized copy).
        self.tied_head: nn.Module | None = None
        self.register_buffer("cos_sin", rope_cache(cfg), persistent=False)

    def make_rope_tables(self) -> None:
        """The rotary tables, made on the default device: a loader that built the model on
        `meta` (worker/weights/gguf_load.py) calls it once the weights are in."""
        self.cos_sin = rope_cache(self.config)

    def serve_context(self, max_model_len: int) -> None:
        """The longest context the engine serves: the rotary table of a type whose frequencies
        depend on it (dynamic NTK, LongRoPE: ops/rotary.py's rope_inv_freq) is made for it."""
        cfg = self.config
        if cfg.rope_scaling is None or cfg.rope_scaling.rope_type not in CONTEXT_DEPENDENT:
            return
        self.cos_sin = rope_cache(cfg, max_model_len).to(self.norm.device)
        log.info("%s", cfg.rope_scaling.describe(max_model_len))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual = None
        step_lora = meta.lora
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            lora = None if step_lora is None else (step_lora.rows, step_lora.layers[i])
            x, residual = layer(x, residual, positions, self.cos_sin, meta, kv_cache, lora)
        x, _ = ops.rms_norm(x, self.norm, self.config.rms_norm_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the rows that sample (the runner selects them first)."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is not None:
            return head(hidden).float()
        return (hidden @ self.embed_tokens.weight.t()).float()

    # ----- weights -----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take tensors named as in a Hugging Face checkpoint, fuse q/k/v and
        gate/up, and check that every parameter was given exactly once."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unfinished: set[str] = set()
        named = ((n, t) for n, t in ((our_name(h), t) for h, t in weights) if n is not None)
        for name, tensor in fuse_shards(named, torch.cat, unfinished):
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still ship it
            self._assign(params, name, tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if unfinished or missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing + sorted(unfinished))[:500]}")

    @staticmethod
    def _assign(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
        p = params[name]
        if tuple(p.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(p.shape)}")
        if tensor.dtype == p.dtype and tensor.device == p.device and tensor.is_contiguous():
            p.data = tensor  # the loader's own tensor: a second copy of every weight is time
        else:
            with torch.no_grad():
                p.copy_(tensor)


# Checkpoint projections that this model runs as one matmul: name -> (fused name, shard),
# and each fused weight's shards in the order their rows are concatenated.
FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
FUSED_ORDER = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def fuse_shards(named: Iterable[tuple[str, T]], cat: Callable[[list[T]], T | None],
                unfinished: set[str]) -> Iterator[tuple[str, T]]:
    """Pass (name, weight) pairs through, joining each q/k/v and gate/up set into its fused
    name once all its shards have come, by `cat` over them in FUSED_ORDER (a None from `cat`
    drops the set). Names of sets still incomplete at the end go into `unfinished`."""
    parts: dict[str, dict[str, T]] = {}
    for name, weight in named:
        for old, (new, shard) in FUSED.items():
            if f".{old}." in name:
                target = name.replace(f".{old}.", f".{new}.")
                parts.setdefault(target, {})[shard] = weight
                if len(parts[target]) == len(FUSED_ORDER[new]):
                    shards = parts.pop(target)
                    joined = cat([shards[s] for s in FUSED_ORDER[new]])
                    if joined is not None:
                        yield target, joined
                break
        else:
            yield name, weight
    unfinished.update(parts)


def rope_cache(cfg: LlamaConfig, context: int | None = None) -> torch.Tensor:
    """The model's rotary cos/sin table [max_position_embeddings, rotary_dim] (on the default
    device), for a served context of `context` tokens (None: max_position_embeddings). On
    `meta` (a model a loader fills, worker/weights/gguf_load.py) only its shape: torch's meta
    kernels for the math would import ~140 MB of Python (torch._refs)."""
    if torch.empty(0).is_meta:
        return torch.empty(cfg.max_position_embeddings, cfg.rotary_dim)
    return ops.rope_cos_sin_cache(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                  cfg.rope_scaling, cfg.rope_freq_factors,
                                  context or cfg.max_position_embeddings)


def our_name(hf_name: str) -> str | None:
    """Map a Hugging Face tensor name to this module's; None for tensors we derive ourselves."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    name = hf_name.removeprefix("model.")
    # The norms are bare parameters here, not modules with a .weight.
    return name.removesuffix(".weight") if name.endswith("norm.weight") else name

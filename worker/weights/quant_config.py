"""Which pre-quantized format a Hugging Face folder holds, from config.json's
`quantization_config`, as vLLM detects it (one format per checkpoint):

| quant_method (and scheme)                         | tensors per quantized linear            | kind |
|---------------------------------------------------|-----------------------------------------|------|
| compressed-tensors float-quantized, 8-bit float   | weight F8_E4M3, weight_scale            | fp8  |
|   channel / tensor / block weights; activations   |   [N,1] / [1] / [N/bn, K/bk]            |      |
|   none, dynamic per token or per group            |                                         |      |
| compressed-tensors int-quantized, 8-bit int       | weight I8, weight_scale [N,1]           | int8 |
|   channel weights; activations none or dynamic    |                                         |      |
|   per token (symmetric)                           |                                         |      |
| compressed-tensors pack-quantized, 4-bit int      | weight_packed I32 [N, K/8], weight_shape,| int4 |
|   groups (GPTQ/RTN symmetric, AWQ asymmetric)     |   weight_scale [N, K/G], weight_zero_point|      |
|                                                   |   [N/8, K/G] (asymmetric), weight_g_idx |      |
| compressed-tensors pack-quantized, 8-bit int      | weight_packed I32 [N, K/4] (q + 128),   | int8 |
|   (W8A16) groups or channel, symmetric            |   weight_shape, weight_scale [N, K/G]   |      |
| fp8 with weight_block_size (DeepSeek, Qwen3-FP8)  | weight F8_E4M3, weight_scale_inv        | fp8  |
|   dynamic per-token-group activations             |   [N/bn, K/bk]                          |      |
| fbgemm_fp8 (Llama 3.1 405B FP8)                   | weight F8_E4M3, weight_scale [N,1]      | fp8  |
|   dynamic per-token activations, amax <= ub       |                                         |      |
| awq, version gemm                                 | qweight I32 [K, N/8], qzeros [K/G, N/8] | int4 |
|                                                   |   (AWQ's nibble order), scales [K/G, N] |      |
| gptq, 4 bits (desc_act only with a trivial g_idx) | qweight I32 [K/8, N], qzeros [K/G, N/8] | int4 |
|                                                   |   (v1: zero - 1), scales [K/G, N], g_idx|      |

Modules the config leaves out (compressed-tensors' `ignore`, `modules_to_not_convert`,
typically lm_head) keep float weights; a compressed-tensors `kv_cache_scheme` adds per-layer
k_scale / v_scale (read for --kv-cache-dtype fp8). Anything else is refused naming the
format: NVFP4, MXFP4, static activation scales, sparsity, transforms, other methods."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED = ("compressed-tensors (FP8, INT8 W8A8, W4A16 and W8A16 pack-quantized)", "fp8 (weight_block_size)",
             "fbgemm_fp8", "awq (gemm)", "gptq (4-bit)")
# Layouts: how a quantized linear's tensors are named and packed (worker/weights/hf_quantized.py).
LAYOUTS = ("ct-float", "ct-int", "ct-pack", "fp8", "fbgemm", "awq", "gptq")


class UnsupportedQuantization(ValueError):
    """A quantization_config this worker does not serve; the message names it."""


@dataclass(frozen=True)
class QuantFormat:
    method: str  # quant_method as the config spells it
    layout: str  # one of LAYOUTS
    kind: str  # "fp8" | "int8" | "int4"
    strategy: str  # weights: "channel" | "tensor" | "block" | "group"
    act: str | None = None  # None | "token" | "group" (dynamic)
    act_group: int = 128
    act_scale_ub: float | None = None
    block: tuple[int, int] | None = None
    group_size: int = 0  # int4: -1 = one group per row (the whole input)
    symmetric: bool = True
    gptq_v1: bool = False  # gptq's zero points stored minus one
    trivial_g_idx_only: bool = False  # desc_act / actorder: a g_idx must be the identity
    ignore: tuple[str, ...] = ()  # compressed-tensors' names and "re:" patterns
    not_convert: tuple[str, ...] = ()  # transformers' modules_to_not_convert: substrings
    targets: tuple[str, ...] = ("Linear",)
    kv_cache_scales: bool = False

    @property
    def name(self) -> str:
        """The format as a user knows it, for messages and the start-up log."""
        if self.kind == "int4":
            sym = "symmetric" if self.symmetric else "asymmetric (zero points)"
            what = f"W4A16 groups of {self.group_size if self.group_size > 0 else 'one row'}, {sym}"
        elif self.kind == "int8" and self.layout == "ct-pack":
            what = f"W8A16 INT8 {f'groups of {self.group_size}' if self.group_size > 0 else 'per-channel'} weights"
        elif self.strategy == "block":
            assert self.block is not None
            what = f"{self.kind.upper()} {self.block[0]}x{self.block[1]} block weights"
        else:
            what = f"{self.kind.upper()} per-{self.strategy} weights"
        acts = {None: "", "token": ", dynamic per-token activations",
                "group": f", dynamic per-group ({self.act_group}) activations"}[self.act]
        return f"{self.method} {what}{acts}"

    def quantizes(self, module: str) -> bool:
        """Whether the config quantizes the linear `module` (a Hugging Face name such as
        "model.layers.0.self_attn.q_proj" or "lm_head")."""
        if any(n in module for n in self.not_convert):
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        for t in self.targets:
            if t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)) or module == t:
                return True
        return False


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization_config: {what}; this worker serves "
                                   f"{', '.join(SUPPORTED)}")


def _bounded(v: Any) -> str:
    return repr(v)[:80]


def detect(cfg: dict[str, Any]) -> QuantFormat | None:
    """The format of a config.json dict; None without a quantization_config."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _refuse(f"must be an object, not {_bounded(qc)}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _native_fp8(qc)
    if method == "fbgemm_fp8":
        ub = qc.get("activation_scale_ub", 1200.0)
        if not isinstance(ub, int | float) or isinstance(ub, bool) or not 0 < ub < float("inf"):
            raise _refuse(f"fbgemm_fp8 activation_scale_ub must be a positive number, not {_bounded(ub)}")
        return QuantFormat("fbgemm_fp8", "fbgemm", "fp8", "channel", act="token", act_scale_ub=float(ub),
                           not_convert=_names(qc, "modules_to_not_convert"))
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "modelopt" and "FP4" in str(qc.get("quant_algo", "")).upper():
        raise _refuse(f"modelopt {str(qc.get('quant_algo'))[:40]} (NVFP4) is not supported")
    raise _refuse(f"quant_method {_bounded(method)} is not supported")


def _names(qc: dict[str, Any], key: str) -> tuple[str, ...]:
    """A list of module names (and compressed-tensors' "re:" patterns, compiled here)."""
    value = qc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(f"{key} must be a list of module names, not {_bounded(value)}")
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as e:
                raise _refuse(f"{key} entry {v[:60]!r} is not a regular expression ({e})") from None
    return tuple(value)


def _positive(qc: dict[str, Any], key: str, method: str, allow_minus_one: bool = False) -> int:
    v = qc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not (v > 0 or (allow_minus_one and v == -1)):
        raise _refuse(f"{method} {key} must be a positive integer, not {_bounded(v)}")
    return v


def _native_fp8(qc: dict[str, Any]) -> QuantFormat:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(f"fp8 activation_scheme {_bounded(qc.get('activation_scheme'))} (static activation "
                      "scales) is not supported, only dynamic")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"fp8 fmt {_bounded(qc.get('fmt'))} is not supported, only e4m3")
    block = qc.get("weight_block_size")
    if block is None:
        raise _refuse("fp8 without weight_block_size (per-tensor weight scales) is not supported")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _refuse(f"fp8 weight_block_size must be two positive integers, not {_bounded(block)}")
    bn, bk = block
    return QuantFormat("fp8", "fp8", "fp8", "block", act="group", act_group=bk, block=(bn, bk),
                       not_convert=_names(qc, "modules_to_not_convert") + _names(qc, "ignored_layers"))


def _awq(qc: dict[str, Any]) -> QuantFormat:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {_bounded(qc.get('version'))} is not supported, only gemm")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"awq with {_bounded(bits)} bits is not supported, only 4")
    if not qc.get("zero_point", True):
        raise _refuse("awq without zero points (zero_point false) is not supported")
    group = _positive({"group_size": qc.get("group_size", qc.get("q_group_size"))}, "group_size", "awq", True)
    return QuantFormat("awq", "awq", "int4", "group", group_size=group, symmetric=False,
                       not_convert=_names(qc, "modules_to_not_convert"))


def _gptq(qc: dict[str, Any]) -> QuantFormat:
    if qc.get("bits") != 4:
        raise _refuse(f"gptq with {_bounded(qc.get('bits'))} bits is not supported, only 4")
    group = _positive(qc, "group_size", "gptq", True)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {_bounded(fmt)} is not supported (gptq, gptq_v2)")
    if qc.get("dynamic"):
        raise _refuse("gptq with per-module overrides (dynamic) is not supported")
    return QuantFormat("gptq", "gptq", "int4", "group", group_size=group, symmetric=bool(qc.get("sym", True)),
                       gptq_v1=fmt == "gptq", trivial_g_idx_only=bool(qc.get("desc_act", False)),
                       not_convert=_names(qc, "modules_to_not_convert"))


def _compressed_tensors(qc: dict[str, Any]) -> QuantFormat:
    fmt = str(qc.get("format", ""))
    if "nvfp4" in fmt or "mxfp4" in fmt or "fp4" in fmt:
        raise _refuse(f"compressed-tensors format {_bounded(fmt)} ({'NVFP4' if 'nv' in fmt else 'MXFP4'}) "
                      "is not supported")
    if qc.get("sparsity_config"):
        raise _refuse("compressed-tensors sparsity (sparsity_config) is not supported")
    if qc.get("transform_config"):
        raise _refuse("compressed-tensors transforms (transform_config) are not supported")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise _refuse(f"compressed-tensors config_groups must be an object, not {_bounded(groups)}")
    schemes = {}
    targets: list[str] = []
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise _refuse(f"compressed-tensors config group {str(name)[:40]!r} is not an object")
        key = repr((g.get("weights"), g.get("input_activations"), g.get("output_activations"),
                    g.get("format", fmt)))
        schemes[key] = g
        targets += _names({"targets": g.get("targets")}, "targets")
    if len(schemes) != 1:
        raise _refuse(f"compressed-tensors with {len(schemes)} different schemes is not supported (one scheme "
                      "for every quantized linear)" if schemes else "compressed-tensors without config_groups")
    (g,) = schemes.values()
    w, a = g.get("weights"), g.get("input_activations")
    if not isinstance(w, dict):
        raise _refuse("compressed-tensors scheme without weights is not supported")
    if g.get("output_activations"):
        raise _refuse("compressed-tensors output_activations quantization is not supported")
    gfmt = str(g.get("format") or fmt)
    if "fp4" in gfmt:
        raise _refuse(f"compressed-tensors format {_bounded(gfmt)} (FP4) is not supported")
    bits, wtype, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    name = f"compressed-tensors {wtype} {bits}-bit {strategy} weights ({gfmt})"
    if w.get("dynamic"):
        raise _refuse(f"{name}: dynamic weight quantization is not supported")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and not (isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float"
                               and kv.get("strategy", "tensor") == "tensor"):
        raise _refuse(f"compressed-tensors kv_cache_scheme {_bounded(kv)} is not supported (8-bit float per tensor)")
    common: dict[str, Any] = {"ignore": _names(qc, "ignore"), "targets": tuple(targets) or ("Linear",),
                              "kv_cache_scales": kv is not None}
    if wtype == "float" and bits == 8:
        if gfmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"{name} is not supported")
        if not w.get("symmetric", True):
            raise _refuse(f"{name}: asymmetric fp8 weights are not supported")
        act, group = _ct_acts(a, "float", name)
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise _refuse(f"{name}: block_structure must be two positive integers, not {_bounded(block)}")
            return QuantFormat("compressed-tensors", "ct-float", "fp8", "block", act, group,
                               block=(block[0], block[1]), **common)
        if strategy not in ("channel", "tensor"):
            raise _refuse(f"{name}: fp8 {_bounded(strategy)} weights are not supported (channel, tensor, block)")
        return QuantFormat("compressed-tensors", "ct-float", "fp8", strategy, act, group, **common)
    if wtype == "int" and bits == 8 and gfmt in ("int-quantized", "naive-quantized"):
        if strategy != "channel" or not w.get("symmetric", True):
            raise _refuse(f"{name}: int8 weights must be symmetric per channel")
        act, group = _ct_acts(a, "int", name)
        if act == "group":
            raise _refuse(f"{name}: per-group int8 activations are not supported")
        return QuantFormat("compressed-tensors", "ct-int", "int8", "channel", act, group, **common)
    if wtype == "int" and bits == 8 and gfmt == "pack-quantized":
        if a is not None:
            raise _refuse(f"{name}: quantized activations with pack-quantized int8 weights are not supported")
        if not w.get("symmetric", True):
            raise _refuse(f"{name}: asymmetric int8 weights are not supported")
        group = -1
        if strategy == "group":
            group = w.get("group_size")
            if isinstance(group, bool) or not isinstance(group, int) or group < 1:
                raise _refuse(f"{name}: group_size must be a positive integer, not {_bounded(group)}")
        elif strategy != "channel":
            raise _refuse(f"{name}: 8-bit {_bounded(strategy)} weights are not supported (group, channel)")
        return QuantFormat("compressed-tensors", "ct-pack", "int8", "group" if group > 0 else "channel",
                           group_size=group, **common)
    if wtype == "int" and bits == 4 and gfmt == "pack-quantized":
        if a is not None:
            raise _refuse(f"{name}: quantized activations with 4-bit weights (W4A8) are not supported")
        if strategy == "group":
            group = w.get("group_size")
            if isinstance(group, bool) or not isinstance(group, int) or group < 1:
                raise _refuse(f"{name}: group_size must be a positive integer, not {_bounded(group)}")
        elif strategy == "channel":
            group = -1
        else:
            raise _refuse(f"{name}: 4-bit {_bounded(strategy)} weights are not supported (group, channel)")
        return QuantFormat("compressed-tensors", "ct-pack", "int4", "group", group_size=group,
                           symmetric=bool(w.get("symmetric", True)),
                           trivial_g_idx_only=w.get("actorder") == "group", **common)
    raise _refuse(f"{name} is not supported")


def _ct_acts(a: Any, wtype: str, name: str) -> tuple[str | None, int]:
    """compressed-tensors input_activations -> (act, act_group)."""
    if a is None:
        return None, 128
    if not isinstance(a, dict):
        raise _refuse(f"{name}: input_activations must be an object")
    if a.get("type") != wtype or a.get("num_bits") != 8:
        raise _refuse(f"{name}: {a.get('type')} {a.get('num_bits')}-bit activations are not supported")
    if not a.get("dynamic"):
        raise _refuse(f"{name}: static activation scales are not supported, only dynamic ones")
    if not a.get("symmetric", True):
        raise _refuse(f"{name}: asymmetric activations are not supported")
    strategy = a.get("strategy")
    if strategy == "token":
        return "token", 128
    if strategy == "group" and wtype == "float":
        group = a.get("group_size")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise _refuse(f"{name}: activation group_size must be a positive integer, not {_bounded(group)}")
        return "group", group
    raise _refuse(f"{name}: dynamic {_bounded(strategy)} activations are not supported (token, group)")

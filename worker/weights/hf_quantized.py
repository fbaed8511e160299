"""A pre-quantized Hugging Face folder (quant_config.py's formats) built one tensor at a time
onto a `meta` model.

Each quantized linear's tensors (weight / weight_scale, qweight / qzeros / scales, ...) are
gathered as the files are read, checked against the shapes the config implies (a bad
checkpoint is refused naming the tensor and the format: a scale of the wrong shape, NaN or
infinite scales, a packed tensor of the wrong size, a group size that does not divide the
input, a g_idx that reorders), converted into one `ScaledWeight` in the kernels' layout
(ops/scaled_linear.py), and fused as the model fuses q/k/v and gate/up. Then:

- on CUDA each becomes a `ScaledLinear` on the device (the Triton kernels compute on it);
- on the CPU in float32 with the C kernels built (the load's --cpu-activations), int4 and
  int8 linears become `QuantLinear` layers on the integer kernels' records (`cpu_records`:
  Q4_0, Q4_G128, Q4_G32, Q8_CH; no float32 copy), multiplying in that arithmetic;
- else on the CPU (fp8, --no-cpu-quantized-linear, other dtypes) each is dequantized at load
  into the model's dtype (weight-only: it multiplies float weights as for any folder).

Everything else (embeddings, norms, float linears the config ignores) is set as it comes.
A compressed-tensors kv_cache_scheme's k_scale / v_scale go to each layer's attention.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ops.quantized_linear import QuantizedWeight, QuantLinear, activations_for, supports
from ops.scaled_linear import (
    ScaledLinear,
    ScaledWeight,
    cat,
    dequantize,
    for_device,
    pack_int4,
    unpack_int4,
)
from worker.models.llama import LlamaConfig, LlamaForCausalLM, fuse_shards, our_name, rope_cache
from worker.weights.quant_config import QuantFormat

# Tensors of one quantized linear, by layout: the ones it must have, and the ones it may.
REQUIRED = {"ct-float": ("weight", "weight_scale"), "ct-int": ("weight", "weight_scale"),
            "ct-pack": ("weight_packed", "weight_scale", "weight_shape"), "fp8": ("weight", "weight_scale_inv"),
            "fbgemm": ("weight", "weight_scale"), "awq": ("qweight", "qzeros", "scales"),
            "gptq": ("qweight", "qzeros", "scales")}
OPTIONAL = {"ct-float": ("weight_zero_point",), "ct-int": ("weight_zero_point",),
            "ct-pack": ("weight_zero_point", "weight_g_idx"), "fp8": (), "fbgemm": ("input_scale_ub",),
            "awq": (), "gptq": ("g_idx",)}
# A checkpoint's per-layer KV cache scales (compressed-tensors and other tools' names).
_KV_SCALE = {"self_attn.k_scale": "k", "self_attn.v_scale": "v", "self_attn.k_proj.k_scale": "k",
             "self_attn.v_proj.v_scale": "v", "self_attn.k_proj.output_scale": "k",
             "self_attn.v_proj.output_scale": "v"}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column _AWQ_ORDER[i]
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class BadCheckpoint(ValueError):
    pass


def linear_shape(cfg: LlamaConfig, module: str) -> tuple[int, int] | None:
    """(out, in) of the Hugging Face linear `module` of `cfg`; None for a name that is not one."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    if module == "lm_head":
        return cfg.vocab_size, h
    proj = module.rpartition(".")[2]
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    return shapes.get(proj) if module.startswith("model.layers.") else None


@dataclass
class _Check:
    fmt: QuantFormat
    module: str

    def fail(self, attr: str, problem: str) -> BadCheckpoint:
        return BadCheckpoint(f"{self.fmt.name}: tensor {self.module}.{attr} {problem}")

    def shape(self, parts: dict[str, torch.Tensor], attr: str, want: tuple[int, ...],
              dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
        t = parts[attr]
        if tuple(t.shape) != tuple(want):
            raise self.fail(attr, f"has shape {tuple(t.shape)}; this linear needs {tuple(want)}")
        if dtypes is not None and t.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise self.fail(attr, f"is {str(t.dtype).removeprefix('torch.')}; this format stores {names}")
        return t

    def scale(self, parts: dict[str, torch.Tensor], attr: str, want: tuple[int, ...]) -> torch.Tensor:
        t = self.shape(parts, attr, want)
        if not t.is_floating_point():
            raise self.fail(attr, f"is {str(t.dtype).removeprefix('torch.')}, not floating point")
        t = t.to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise self.fail(attr, "holds NaN or infinite scales")
        return t.contiguous()


def _group(fmt: QuantFormat, check: _Check, attr: str, k: int) -> int:
    g = k if fmt.group_size == -1 else fmt.group_size
    if k % g:
        raise check.fail(attr, f"cannot be read: group_size {g} does not divide the linear's {k} inputs")
    if g % 8:
        raise check.fail(attr, f"cannot be read: group_size {g} is not a multiple of 8")
    return g


def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C/8] int32 packed along columns -> [R, C] nibbles (column 8j + order[i] is nibble i)."""
    shifts = torch.tensor([4 * order.index(c) for c in range(8)], dtype=torch.int32)
    return ((packed[..., None] >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def _g_idx(check: _Check, parts: dict[str, torch.Tensor], attr: str, k: int, g: int) -> None:
    """A g_idx must say input k is in group k // g: any other order (act-order) is refused."""
    if attr not in parts:
        return
    t = check.shape(parts, attr, (k,))
    if not torch.equal(t.to(torch.int64), torch.arange(k) // g):
        raise check.fail(attr, "reorders the inputs (desc_act / activation order), which is not supported")


def convert(fmt: QuantFormat, module: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> ScaledWeight:
    """One linear's checkpoint tensors -> its `ScaledWeight`, checked (BadCheckpoint)."""
    n, k = shape
    c = _Check(fmt, module)
    lay = fmt.layout
    common = {"act": fmt.act, "act_group": fmt.act_group, "act_scale_ub": fmt.act_scale_ub}
    if lay in ("ct-float", "fp8", "fbgemm"):
        q = c.shape(parts, "weight", (n, k), (torch.float8_e4m3fn,))
        if fmt.act == "group" and k % fmt.act_group:
            raise c.fail("weight", f"cannot be read: activation group {fmt.act_group} does not divide {k} inputs")
        attr = "weight_scale_inv" if lay == "fp8" else "weight_scale"
        if fmt.strategy == "block":
            assert fmt.block is not None
            bn, bk = fmt.block
            s = c.scale(parts, attr, (-(-n // bn), -(-k // bk)))
            return ScaledWeight("fp8", q.contiguous(), s, shape, block=fmt.block, **common)
        if fmt.strategy == "tensor":
            raw = parts[attr]
            s = c.scale(parts, attr, tuple(raw.shape) if raw.numel() == 1 else (1,))
            return ScaledWeight("fp8", q.contiguous(), s.reshape(1).expand(n).contiguous(), shape, **common)
        s = c.scale(parts, attr, (n, 1) if parts[attr].dim() == 2 else (n,))
        return ScaledWeight("fp8", q.contiguous(), s.reshape(n), shape, **common)
    if lay == "ct-int":
        q = c.shape(parts, "weight", (n, k), (torch.int8,))
        s = c.scale(parts, "weight_scale", (n, 1) if parts["weight_scale"].dim() == 2 else (n,))
        if "weight_zero_point" in parts and bool(parts["weight_zero_point"].any()):
            raise c.fail("weight_zero_point", "is not zero: asymmetric int8 weights are not supported")
        return ScaledWeight("int8", q.contiguous(), s.reshape(n), shape, **common)
    if lay == "ct-pack":
        g = _group(fmt, c, "weight_scale", k)
        got = tuple(int(v) for v in parts["weight_shape"].reshape(-1).tolist())
        if got != (n, k):
            raise c.fail("weight_shape", f"says {got}; this linear is {(n, k)}")
        if fmt.kind == "int8":  # W8A16: byte i of word j is input 4j + i, as q + 128
            words = c.shape(parts, "weight_packed", (n, k // 4), (torch.int32,))
            q = (words.contiguous().view(torch.uint8).reshape(n, k).to(torch.int16) - 128).to(torch.int8)
            s = c.scale(parts, "weight_scale", (n, k // g))
            if g == k:
                return ScaledWeight("int8", q, s.reshape(n), shape)
            return ScaledWeight("int8", q, s, shape, block=(1, g))
        q = c.shape(parts, "weight_packed", (n, k // 8), (torch.int32,))
        s = c.scale(parts, "weight_scale", (n, k // g))
        _g_idx(c, parts, "weight_g_idx", k, g)
        zero = None
        if not fmt.symmetric:
            if "weight_zero_point" not in parts:
                raise c.fail("weight_zero_point", "is missing: asymmetric weights need zero points")
            z = c.shape(parts, "weight_zero_point", (-(-n // 8), k // g), (torch.int32,))
            zero = _unpack_cols(z.t().contiguous()).t()[:n].contiguous()  # packed along the rows
        return ScaledWeight("int4", q.contiguous(), s, shape, zero=zero, group_size=g)
    if lay in ("awq", "gptq"):
        g = _group(fmt, c, "scales", k)
        if n % 8:
            raise c.fail("qzeros", f"cannot be read: {n} outputs are not a multiple of 8")
        s = c.scale(parts, "scales", (k // g, n)).t().contiguous()
        zq = c.shape(parts, "qzeros", (k // g, n // 8), (torch.int32,))
        if lay == "awq":
            qw = c.shape(parts, "qweight", (k, n // 8), (torch.int32,))
            packed = pack_int4(_unpack_cols(qw, _AWQ_ORDER).t().contiguous())  # [N, K] -> along K
            z = _unpack_cols(zq, _AWQ_ORDER).t()
        else:
            qw = c.shape(parts, "qweight", (k // 8, n), (torch.int32,))
            packed = qw.t().contiguous()  # packed along K already, nibble i = input 8j + i
            z = _unpack_cols(zq).t()
            if fmt.gptq_v1:
                z = z.to(torch.int16) + 1  # AutoGPTQ's format stores zero - 1
                if bool((z > 15).any()):
                    raise c.fail("qzeros", "holds a zero point of 16 (a v1 zero of -1)")
                z = z.to(torch.uint8)
            _g_idx(c, parts, "g_idx", k, g)
        zero = None if fmt.symmetric and bool((z == 8).all()) else z.contiguous()
        return ScaledWeight("int4", packed, s, shape, zero=zero, group_size=g)
    raise AssertionError(lay)


def as_gguf_blocks(w: ScaledWeight) -> QuantizedWeight | None:
    """An int4 weight as the GGUF blocks of 32 the CPU's kernels take, where they hold it
    exactly: a group of G (a multiple of 32) is G / 32 blocks sharing its scale and zero.
    Symmetric (zero 8) with fp16-exact scales: Q4_0, w = d (q - 8), d = s. With zero points:
    Q4_1, w = d q + m, d = s and m = -s z, where both are fp16-exact. Else None (the loader
    dequantizes): GPTQ's and AWQ's fp16 scales are exact, -s z mostly not; bf16 or float32
    scales mostly not; INT8 per-channel scales are float32, which no Q8_0 d holds."""
    if w.kind != "int4" or w.group_size % 32:
        return None
    n, k = w.shape
    s = w.scale.to(torch.float32)
    d = s.to(torch.float16)
    if not torch.equal(d.to(torch.float32), s):
        return None
    per = w.group_size // 32
    u = unpack_int4(w.qweight).reshape(n, k // 32, 32)
    qs = (u[..., :16] | (u[..., 16:] << 4)).numpy()  # byte j: k = j (low nibble), j + 16 (high)
    d_blocks = d.repeat_interleave(per, 1).numpy().view(np.uint8).reshape(n, k // 32, 2)
    if w.zero is None:
        blocks = np.concatenate([d_blocks, qs], axis=-1)
        return QuantizedWeight("Q4_0", blocks.reshape(n, -1), w.shape)
    m32 = -s * w.zero.to(torch.float32)
    m = m32.to(torch.float16)
    if not torch.equal(m.to(torch.float32), m32):
        return None
    m_blocks = m.repeat_interleave(per, 1).numpy().view(np.uint8).reshape(n, k // 32, 2)
    blocks = np.concatenate([d_blocks, m_blocks, qs], axis=-1)
    return QuantizedWeight("Q4_1", blocks.reshape(n, -1), w.shape)


def checkpoint_records(w: ScaledWeight) -> QuantizedWeight | None:
    """An int4 or int8 weight as blocks of the CPU kernels' checkpoint types (quant_types.h),
    whose scales are float32, so they hold any checkpoint's scales as they are:

    - int4 in groups of 128 (or a multiple) as Q4_G128, of 32 or 64 as Q4_G32: per group
      d = s and m = -s z (z = 8 where symmetric); w = d q + m is s (q - z) exactly where s z
      is exact in float32 (fp16 and bf16 scales: 11 or 8 significant bits times z < 16),
      else m is s z rounded once (float32 scales), as the dequantization's own rounding;
    - int8 per channel, or in groups of a multiple of 128 (W8A16), as Q8_CH (in_features a
      multiple of 128): d = the channel's (group's) scale, exactly.

    None for anything else (fp8; int4 groups not a multiple of 32; int8 with in_features not
    a multiple of 128): the loader dequantizes those."""
    n, k = w.shape
    g = k if w.block is None else w.block[1]
    if w.kind == "int8" and k % 128 == 0 and g % 128 == 0 and (w.block is None or w.block[0] == 1):
        d = w.scale.to(torch.float32).reshape(n, -1).repeat_interleave(g // 128, 1)
        q = w.qweight.reshape(n, k // 128, 128).contiguous()
        blocks = np.concatenate([d.numpy().view(np.uint8).reshape(n, k // 128, 4), q.numpy().view(np.uint8)], -1)
        return QuantizedWeight("Q8_CH", blocks.reshape(n, -1), w.shape)
    if w.kind != "int4" or w.group_size % 32:
        return None
    qtype, block = ("Q4_G128", 128) if w.group_size % 128 == 0 else ("Q4_G32", 32)
    per = w.group_size // block
    s = w.scale.to(torch.float64)
    z = 8.0 if w.zero is None else w.zero.to(torch.float64)
    d = s.to(torch.float32).repeat_interleave(per, 1)
    m = (-s * z).to(torch.float32).repeat_interleave(per, 1)  # rounded once, where not exact
    u = unpack_int4(w.qweight).reshape(n, k // 32, 32)
    qs = (u[..., :16] | (u[..., 16:] << 4)).reshape(n, k // block, block // 2)  # k = j low, j + 16 high
    fields = [d.numpy().view(np.uint8).reshape(n, -1, 4), m.numpy().view(np.uint8).reshape(n, -1, 4), qs.numpy()]
    return QuantizedWeight(qtype, np.concatenate(fields, -1).reshape(n, -1), w.shape)


def cpu_records(w: ScaledWeight) -> QuantizedWeight | None:
    """The CPU kernels' holding of a checkpoint weight: a symmetric int4 with fp16-exact
    scales as Q4_0 (`as_gguf_blocks`: no m term, so no cancellation with the block's sum),
    else `checkpoint_records`; None: dequantized at load (fp8)."""
    if w.kind == "int4" and w.zero is None:
        blocks = as_gguf_blocks(w)
        if blocks is not None:
            return blocks
    return checkpoint_records(w)


def cpu_record_type(kind: str, symmetric: bool, group_size: int, k: int, fp16_scales: bool) -> str | None:
    """The record type `cpu_records` picks for a linear of `k` inputs, from the format alone
    (the planner's): `fp16_scales` where the checkpoint stores its scales in float16 or
    bfloat16, whose values fp16 holds (bf16 ones below 2^-14 but for a few bits: there the
    loader takes Q4_G128, the same bytes for groups of 128)."""
    g = k if group_size <= 0 else group_size  # int8 per channel: 0 or -1
    if kind == "int8":
        return "Q8_CH" if k % 128 == 0 and g % 128 == 0 else None
    if kind != "int4" or g % 32:
        return None
    if symmetric and fp16_scales:
        return "Q4_0"
    return "Q4_G128" if g % 128 == 0 else "Q4_G32"


class _Reader:
    """The checkpoint's tensors by module, grouped as they arrive."""

    def __init__(self, fmt: QuantFormat, cfg: LlamaConfig, keys: Iterable[str]) -> None:
        self.fmt, self.cfg = fmt, cfg
        names = set(REQUIRED[fmt.layout] + OPTIONAL[fmt.layout])
        present: dict[str, set[str]] = {}
        for key in keys:
            module, _, attr = key.rpartition(".")
            if attr in names:
                present.setdefault(module, set()).add(attr)
        self.expect: dict[str, set[str]] = {}
        for module, attrs in present.items():
            is_weight = attrs <= {"weight"}
            if is_weight and not (fmt.layout in ("awq", "gptq") or self._config_quantizes(module)):
                continue  # a float linear (ignored) or some other weight
            if linear_shape(cfg, module) is None:
                raise BadCheckpoint(f"{fmt.name}: tensor {module}.{sorted(attrs)[0]} is not of a linear "
                                    "this model has")
            missing = [a for a in REQUIRED[fmt.layout] if a not in attrs]
            if missing:
                raise BadCheckpoint(f"{fmt.name}: tensor {module}.{missing[0]} is missing "
                                    f"(the checkpoint has {', '.join(sorted(attrs))} for this linear)")
            self.expect[module] = attrs
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def _config_quantizes(self, module: str) -> bool:
        return linear_shape(self.cfg, module) is not None and self.fmt.quantizes(module)

    def take(self, name: str, t: torch.Tensor) -> ScaledWeight | bool | None:
        """False: not a quantized linear's tensor; None: taken, its linear not complete;
        else the complete linear's weight."""
        module, _, attr = name.rpartition(".")
        want = self.expect.get(module)
        if want is None or attr not in want:
            return False
        parts = self.pending.setdefault(module, {})
        parts[attr] = t
        if len(parts) < len(want):
            return None
        shape = linear_shape(self.cfg, module)
        assert shape is not None
        return convert(self.fmt, module, self.pending.pop(module), shape)


def _cat(items: list) -> object:
    if all(isinstance(i, ScaledWeight) for i in items):
        return cat(items)
    if all(isinstance(i, torch.Tensor) for i in items):
        return torch.cat(items)
    raise BadCheckpoint("a fused q/k/v or gate/up set mixes quantized and float shards")


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor, device: torch.device,
                   dtype: torch.dtype) -> None:
    path, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint") from None
    old = getattr(owner, attr, None)
    if not isinstance(old, nn.Parameter):
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
    if not old.is_meta:
        raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(old.shape)}")
    setattr(owner, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))


def load_quantized(cfg: LlamaConfig, fmt: QuantFormat, keys: list[str],
                   tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device,
                   dtype: torch.dtype, dequantize_on_cpu: bool = True,
                   cpu_activations: str | None = None) -> LlamaForCausalLM:
    """The model of a folder in `fmt` (`keys`: every tensor name of its files, from their
    headers; `tensors`: the tensors as read), on `device` in `dtype` (see the top).
    `dequantize_on_cpu=False` keeps ScaledLinear layers on the CPU too (tests: the
    reference arithmetic of the GPU's kernels). `cpu_activations` (the load's LinearPolicy,
    CPU float32 with the kernels built): int4 linears the GGUF kernels hold exactly
    (`as_gguf_blocks`) become QuantLinear layers multiplying in that arithmetic."""
    reader = _Reader(fmt, cfg, keys)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    kv_scales: dict[tuple[int, str], float] = {}

    def named() -> Iterator[tuple[str, object]]:
        for name, t in tensors:
            layer_rest = name.removeprefix("model.layers.")
            layer, _, rest = layer_rest.partition(".")
            if rest in _KV_SCALE and layer.isdigit():
                v = t.to(torch.float32).reshape(-1)
                if v.numel() != 1 or not math.isfinite(float(v[0])) or float(v[0]) <= 0:
                    raise BadCheckpoint(f"{fmt.name}: tensor {name} must be one positive finite scale, "
                                        f"not {v.tolist()[:4]}")
                kv_scales[int(layer), _KV_SCALE[rest]] = float(v[0])
                continue
            got = reader.take(name, t)
            if got is False:
                ours = our_name(name)
                if ours is not None:
                    yield ours, t
            elif got is not None:
                module = name.rpartition(".")[0]
                ours = our_name(module + ".weight")
                assert ours is not None
                yield ours, got

    later: list[tuple[str, ScaledWeight | QuantizedWeight]] = []
    unfinished: set[str] = set()
    for name, item in fuse_shards(named(), _cat, unfinished):
        if name == "lm_head.weight" and model.lm_head is None:
            continue
        if isinstance(item, ScaledWeight):
            blocks = cpu_records(item) if cpu_activations and device.type == "cpu" and dequantize_on_cpu else None
            if blocks is not None and supports(blocks.qtype, blocks.shape):
                later.append((name.removesuffix(".weight"), blocks))
            elif (device.type == "cpu" and dequantize_on_cpu) or (item.kind == "int8" and item.block is not None):
                # weight-only: dequantized once, here (W8A16's int8 groups: no Triton kernel takes them)
                _set_parameter(model, name, dequantize(item, dtype), device, dtype)
            else:
                later.append((name.removesuffix(".weight"), item))
        else:
            assert isinstance(item, torch.Tensor)
            _set_parameter(model, name, item, device, dtype)
    if reader.pending:
        module, parts = next(iter(reader.pending.items()))
        raise BadCheckpoint(f"{fmt.name}: {module} has only {', '.join(sorted(parts))} of its tensors")
    for path, w in later:
        meta = model.get_submodule(path)
        if meta.bias is not None and meta.bias.is_meta:
            raise ValueError(f"weights missing from the checkpoint: {path}.bias")
        parent, _, child = path.rpartition(".")
        if isinstance(w, QuantizedWeight):  # the CPU's integer kernels (Q4_0, Q4_G128, Q4_G32, Q8_CH records)
            assert cpu_activations is not None
            layer: nn.Module = QuantLinear(w, meta.bias, activations_for(w, cpu_activations))
        else:
            layer = ScaledLinear(for_device(w.to(device), device), meta.bias)
        setattr(model.get_submodule(parent), child, layer)
    for (layer, which), scale in kv_scales.items():
        if layer >= cfg.num_layers:
            raise BadCheckpoint(f"{fmt.name}: a KV cache scale for layer {layer}; the model has {cfg.num_layers}")
        setattr(model.layers[layer].self_attn, f"{which}_scale", scale)
    with torch.device(device):
        model.cos_sin = rope_cache(cfg)
    missing = sorted(n for n, p in model.named_parameters() if p.is_meta)
    if unfinished or missing:
        raise ValueError(f"weights missing from the checkpoint: {', '.join(missing + sorted(unfinished))[:500]}")
    return model.eval().requires_grad_(False)


def held_bytes(fmt: QuantFormat, n: int, k: int) -> int:
    """Bytes a ScaledWeight of (n, k) in `fmt` holds (ops/scaled_linear.py's layout: quants,
    float32 scales, uint8 zero points where asymmetric), as `ScaledWeight.nbytes`."""
    if fmt.kind == "int4":
        g = k if fmt.group_size == -1 else fmt.group_size
        return n * k // 2 + n * (k // g) * (4 + (0 if fmt.symmetric else 1))
    if fmt.block is not None:
        return n * k + 4 * -(-n // fmt.block[0]) * -(-k // fmt.block[1])
    return n * k + 4 * n

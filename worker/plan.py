"""`llm-worker plan`: what one replica of a model holds and serves on a device, and how many
replicas a load needs, from the model's config alone (no weights are loaded).

    llm-worker plan --model dummy:llama-3-8b --device h100 --prompt-len 1024 --output-len 256 \\
        --qps 10 --ttft-slo 1 --tpot-slo 0.05

How this is estimated (a roofline; the output repeats it in one line):

- Weights: a GGUF's tensors as stored; held in memory as the loader holds them
  (worker/weights/gguf_load.py): on the CPU in float32 every linear of a type the CPU
  kernels take (`ops.quantized_linear.supports`) stays quantized (the file's bytes, as
  `held_bytes` repacks them; this assumes gcc and AVX2 for the C kernel), a fused q/k/v of
  several such types too, and the rest is float32; elsewhere every weight in --dtype. A
  decode step reads every weight once except the embedding table (only a few rows are
  looked up), unless the table is the head (tied).
- KV cache: 2 (K and V) x layers x KV heads x head dim x dtype bytes per token; the budget
  and blocks as the engine sizes them (`kvcache.budget.budget_bytes` and `fit_budget`, the
  same functions): 1 GiB on the CPU, else --gpu-memory-utilization of the memory left after
  the weights and a CUDA context allowance (CUDA_CONTEXT_BYTES).
- Decode step of B sequences at context c (c = prompt + output / 2, the mean while
  decoding): the slower of reading (weights + B x c x KV bytes per token) at the memory
  bandwidth and computing B x (2 x matmul weights + 4 x layers x heads x head dim x c)
  FLOPs at the peak rate.
- Prefill of P tokens: the slower of its FLOPs (2 P x matmul weights + 2 x layers x heads x
  head dim x P^2 for causal attention, the head for one row) at the peak rate and one
  weight read per --max-num-batched-tokens chunk.
- TPOT at batch B = the decode step + the prefill compute of the B / output prompts that
  share each step (chunked prefill); TTFT = prefill + the step in flight on arrival.
  The operating batch is the largest that the KV cache and --max-num-seqs hold and that
  keeps both SLOs.
- Tensor parallelism (-tp k): a rank holds 1/k of each layer's linears, its KV heads and
  ceil(V / k) rows (whole tiles of 32) of the embedding and the LM head, held as the
  worker holds a rank's slice (worker/parallel/shard.py, vocab.py; the norms whole), its
  KV cache the same budget as one device; a decode step adds 2 all-reduces a layer and the
  embedding's one, of [batch, hidden] (a ring's 2 (k - 1) / k of the bytes at the link, plus
  a fixed cost), and the gather of [batch, V] logits to rank 0 ((k - 1) / k of them at the
  link). A model that does not fit names the smallest k that does, with per-rank figures.
- Replicas for a QPS: Little's law, concurrency = QPS x (TTFT + output x TPOT), over the
  operating batch per replica; and the work bound, QPS x (prefill + output x step / batch)
  replica-seconds per second. The larger wins.

Not modelled: kernel efficiency (a roofline is a floor: measured steps are slower),
sampling, scheduling and launch overheads, prefix-cache hits, preemption, queueing beyond
the step in flight (replicas are sized so that every request finds a seat).

Peak figures: H100 SXM 80 GB 3.35 TB/s 989 TFLOP/s bf16 dense (67 float32), H200 141 GB
4.8 TB/s 989 (67), A100 80 GB 2.0 TB/s 312 (19.5), L40S 48 GB 864 GB/s 362 (91.6); `cpu`
measures this machine once per run (a read of 256 MiB, a 1024^3 matmul); `custom:MEM_GB,
BW_GBps,TFLOPS` describes any other accelerator.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcache.budget import GIB, fit_budget, kv_bytes_per_token
from ops.quant_records import TYPES
from ops.quantized_linear import ACTIVATIONS, held_bytes, resolve_activations, supports
from worker import memory
from worker.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    human_readable_int,
)
from worker.models.llama import LlamaConfig, fuse_shards, our_name
from worker.parallel import gguf_split
from worker.weights import default_model_path, dummy, gguf_file, hf_folder, hf_quantized
from worker.weights.gguf_load import lookup_supported
from worker.weights.quant_config import QuantFormat

CUDA_CONTEXT_BYTES = GIB // 2  # CUDA context + torch's allocator, taken before the KV budget
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HOW = ("roofline: decode step = max(bytes read / bandwidth, FLOPs / peak), bytes = weights + "
       "each sequence's KV at its mean context; TTFT = prefill + one step; replicas by Little's "
       "law (QPS x latency / batch) and by work; a floor: measured steps are slower")


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cuda" (any accelerator: KV from its free memory) | "cpu"
    memory_bytes: int
    bandwidth: float  # bytes/s
    flops: dict[str, float]  # dense FLOP/s by dtype
    note: str = ""
    # One direction of the link between two devices of a node (NVLink; PCIe where there is
    # none): what a tensor-parallel all-reduce moves at. 0: not modelled (the CPU).
    link_bandwidth: float = 0.0


_GB, _T = 10**9, 10**12
DEVICES = {  # vendors' figures: memory in GB, bandwidth, dense FLOP/s (bf16/fp16; float32 without TF32)
    # link: NVLink 4 (H100/H200 SXM) 900 GB/s, NVLink 3 (A100) 600 GB/s, both directions
    # together; L40S has none: PCIe 4.0 x16, 32 GB/s a direction.
    "h100": Device("h100", "cuda", 80 * _GB, 3.35 * _T, {"bfloat16": 989 * _T, "float32": 67 * _T},
                   link_bandwidth=450 * _GB),
    "h200": Device("h200", "cuda", 141 * _GB, 4.8 * _T, {"bfloat16": 989 * _T, "float32": 67 * _T},
                   link_bandwidth=450 * _GB),
    "a100-80g": Device("a100-80g", "cuda", 80 * _GB, 2.0 * _T, {"bfloat16": 312 * _T, "float32": 19.5 * _T},
                       link_bandwidth=300 * _GB),
    "l40s": Device("l40s", "cuda", 48 * _GB, 0.864 * _T, {"bfloat16": 362 * _T, "float32": 91.6 * _T},
                   link_bandwidth=32 * _GB),
}
# A collective's fixed cost (launch and synchronization), beside its bytes at the link.
ALL_REDUCE_LATENCY_S = 5e-6


@functools.cache
def measure_cpu(dtype: str = "float32") -> Device:
    """This machine, measured once per run: the best of 5 reads (a sum) of a 256 MiB tensor,
    and of 5 float32 (or `dtype`) 1024^3 matmuls, at torch's thread count."""
    import torch

    def best(fn: Any, n: int = 5) -> float:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    x = torch.ones(64 << 20)
    bandwidth = x.nbytes / best(x.sum)
    del x
    a = torch.randn(1024, 1024).to(getattr(torch, dtype))
    b = torch.randn(1024, 1024).to(getattr(torch, dtype))
    flops = 2 * 1024**3 / best(lambda: a @ b)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    note = f"measured: {bandwidth / _GB:.1f} GB/s read, {flops / 1e9:.0f} GFLOP/s {dtype}, {torch.get_num_threads()} threads"
    return Device("cpu", "cpu", memory, bandwidth, {dtype: flops}, note)


def parse_device(spec: str, dtype: str) -> Device:
    if spec in DEVICES:
        return DEVICES[spec]
    if spec == "cpu":
        return measure_cpu(dtype)
    if spec.startswith("custom:"):
        parts = spec.removeprefix("custom:").split(",")
        try:
            mem, bw, tf = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"--device {spec[:60]!r}: custom:MEM_GB,BW_GBps,TFLOPS expected, "
                             "e.g. custom:24,1008,165") from None
        if min(mem, bw, tf) <= 0:
            raise ValueError(f"--device {spec[:60]!r}: every figure must be > 0")
        return Device("custom", "cuda", int(mem * _GB), bw * _GB, {d: tf * _T for d in DTYPE_BYTES})
    raise ValueError(f"--device {spec[:60]!r}: choose {', '.join(DEVICES)}, cpu or custom:MEM_GB,BW_GBps,TFLOPS")


# ----- the model's shape and its weights, without loading them -----

@dataclass(frozen=True)
class Tensor:
    name: str  # this worker's module name, fused as the model fuses ("layers.0.self_attn.qkv_proj.weight")
    dtype: str  # as stored: "Q4_1", "F32", "BF16", ... (the --dtype for dummy weights); "mixed": parts'
    shape: tuple[int, ...]  # (out, in) for a matrix
    nbytes: int
    parts: tuple[Tensor, ...] = ()  # a fused weight's shards, in row order

    @property
    def pieces(self) -> tuple[Tensor, ...]:
        return self.parts or (self,)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str  # "gguf" | "safetensors" | "dummy"
    config: LlamaConfig
    stored: dict[str, int] = field(default_factory=dict)  # bytes by stored type (none for dummy)
    tensors: tuple[Tensor, ...] = ()  # by module name, fused as the model fuses them
    quantization: QuantFormat | None = None  # a pre-quantized folder's format


def read_model(spec: str) -> ModelInfo:
    """The config and the stored tensors' types and sizes of `spec` (as --model takes it)."""
    if spec.startswith("dummy:"):
        return ModelInfo(spec, "dummy", dummy.dummy_config(spec.removeprefix("dummy:")))
    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)[:200]} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{str(path)[:200]}: a model file must be .gguf (or give a Hugging Face folder)")
        reader = gguf_file.open_reader(path)
        cfg = gguf_file.config_from_gguf(reader, path)
        name = "SmolLM2-135M-Instruct" if spec == "default" else path.stem
        tensors = _gguf_tensors(reader)
        return ModelInfo(name, "gguf", cfg, _by_dtype(tensors), _fused(tensors))
    cfg = hf_folder.read_config(path)
    tensors = _safetensors_tensors(hf_folder.safetensors_files(path))
    return ModelInfo(path.name, "safetensors", cfg, _by_dtype(tensors), tuple(tensors),
                     hf_folder.read_quantization(path))


_SHARDS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
           "mlp.down_proj": ("mlp.down_proj",)}


def _cpu_records(model: ModelInfo) -> dict[str, tuple[str, int]]:
    """A pre-quantized folder's int4 / int8 linears as the CPU kernels' records hold them
    (hf_quantized.cpu_records: Q4_0 for symmetric int4 with fp16 scales, else Q4_G128 /
    Q4_G32 / Q8_CH): our name -> (record type, bytes); empty where none is (fp8)."""
    fmt = model.quantization
    if fmt is None or fmt.kind not in ("int4", "int8"):
        return {}
    scale = "scales" if fmt.layout in ("awq", "gptq") else "weight_scale"
    fp16 = all(t.dtype in ("F16", "BF16") for t in model.tensors if t.name.endswith("." + scale))

    def record(n: int, k: int) -> str | None:  # as the loader's supports() takes it
        qtype = hf_quantized.cpu_record_type(fmt.kind, fmt.symmetric, fmt.group_size, k, fp16)
        return qtype if qtype is not None and supports(qtype, (n, k)) else None

    def held(n: int, k: int) -> int:
        t = TYPES[record(32, k) or "Q8_0"]
        return n // 32 * (k // t.k_multiple) * t.record

    # The loader converts a fused set (shards sharing their inputs k) as one weight.
    cfg = model.config
    shapes = {**_linear_shapes(cfg), "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    return {name: (qtype, nbytes) for name, (_, nbytes) in _scaled_linears(model, held).items()
            if (qtype := record(*shapes[name])) is not None}


def _scaled_linears(model: ModelInfo, held_bytes: Any = None) -> dict[str, tuple[str, int]]:
    """A pre-quantized folder's linears as CUDA holds them (ScaledLinear, weights as stored):
    our name -> (kind, bytes; `held_bytes(n, k)` of each shard instead where given); empty
    for other sources. A fused set with a float shard is
    refused at load, so a set counts when its first shard is quantized."""
    fmt = model.quantization
    if fmt is None:
        return {}
    cfg = model.config
    names = {t.name for t in model.tensors}
    scale = hf_quantized.REQUIRED[fmt.layout][1]
    out: dict[str, tuple[str, int]] = {}
    groups = {f"layers.{i}.{ours}": [f"model.layers.{i}.{s}" for s in shards]
              for i in range(cfg.num_layers) for ours, shards in _SHARDS.items()}
    groups["lm_head"] = ["lm_head"]
    for ours, shards in groups.items():
        if f"{shards[0]}.{scale}" in names:
            shapes = [hf_quantized.linear_shape(cfg, s) for s in shards]
            held = held_bytes or (lambda n, k: hf_quantized.held_bytes(fmt, n, k))
            out[ours] = (fmt.kind, sum(held(*sh) for sh in shapes if sh))
    return out


def _by_dtype(tensors: list[Tensor]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tensors:
        out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
    return out


def _gguf_tensors(reader: Any) -> list[Tensor]:
    out = []
    arch = gguf_file.field(reader, "general.architecture")
    for t in reader.tensors:
        if t.name in gguf_file.CONFIG_TENSORS:
            continue
        ours = our_name(gguf_file.hf_name(t.name, arch))
        if ours is not None:
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
            out.append(Tensor(ours, t.tensor_type.name, shape, int(t.n_bytes)))
    return out


def _fused(tensors: list[Tensor]) -> tuple[Tensor, ...]:
    """q/k/v and gate/up joined as the model joins them, keeping their shards (`parts`); a set
    of several types gets type "mixed"."""
    def cat(ts: list[Tensor]) -> Tensor:
        kinds = {t.dtype for t in ts}
        return Tensor("", kinds.pop() if len(kinds) == 1 else "mixed",
                      (sum(t.shape[0] for t in ts), *ts[0].shape[1:]), sum(t.nbytes for t in ts), tuple(ts))

    unfinished: set[str] = set()
    fused = tuple(Tensor(n, t.dtype, t.shape, t.nbytes, t.parts) for n, t in fuse_shards(
        ((t.name, t) for t in tensors), cat, unfinished))
    if unfinished:
        raise ValueError(f"incomplete fused weights: {', '.join(sorted(unfinished))[:200]}")
    return fused


def _safetensors_tensors(files: list[Path]) -> list[Tensor]:
    """Names, dtypes and sizes from each file's JSON header (the weights are not read)."""
    out = []
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"{path.name}: a safetensors header of {n} bytes is not plausible")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                lo, hi = info["data_offsets"]
                out.append(Tensor(name, info["dtype"], tuple(info["shape"]), hi - lo))
    return out


# ----- what the worker holds and reads -----

@dataclass(frozen=True)
class Weights:
    stored: dict[str, int]  # bytes by stored type (for dummy weights: by --dtype)
    held: dict[str, int]  # bytes in memory by type, as the worker keeps them on this device
    read_per_step: int  # bytes a decode step reads (every weight once, not the embedding rows)
    matmul_params: int  # weights a token multiplies with (the linears and the head)
    head_params: int  # of those, the head's (vocab x hidden): prefill computes it for one row
    how: str
    layer_linear_bytes: int = 0  # of `held`, the layers' linears: what tensor parallelism splits
    vocab_bytes: int = 0  # of `held`, the embedding's and the LM head's (a rank's: its rows)


def _linear_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    per_layer = {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q),
                 "mlp.gate_up_proj": (2 * cfg.intermediate_size, h), "mlp.down_proj": (h, cfg.intermediate_size)}
    return {f"layers.{i}.{k}": v for i in range(cfg.num_layers) for k, v in per_layer.items()}


def weights(model: ModelInfo, device: Device, dtype: str, cpu_quantized: bool = True,
            cpu_activations: str = "auto", vocab_rows: int = 0) -> Weights:
    """`cpu_activations` as serve's --cpu-activations (auto: resolved on this machine).
    `vocab_rows`: the rows of the embedding and the LM head held (a vocab-parallel rank's,
    padding included: worker/parallel/vocab.py; 0: the vocabulary's)."""
    activations = resolve_activations(cpu_activations)
    cfg = model.config
    h, vocab = cfg.hidden_size, cfg.vocab_size
    rows = vocab_rows or vocab
    linears = _linear_shapes(cfg)
    head = rows * h
    matmul = sum(o * i for o, i in linears.values()) + head
    bias = cfg.num_layers * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim if cfg.attention_bias else 0
    norms = (2 * cfg.num_layers + 1) * h
    stored = dict(model.stored)
    size = DTYPE_BYTES[dtype]
    if not stored:
        whole = matmul - head + vocab * h
        stored = {dtype: (whole + bias + norms + (0 if cfg.tie_word_embeddings else vocab * h)) * size}
    on_cpu_f32 = device.kind == "cpu" and dtype == "float32"
    by_name = {t.name.removesuffix(".weight"): t for t in model.tensors}
    for name in ("embed_tokens", "lm_head"):  # a rank's rows of them, as the loader cuts them
        if name in by_name and rows != vocab:
            t = by_name[name]
            by_name[name] = Tensor(t.name, t.dtype, (rows, *t.shape[1:]), t.nbytes // vocab * rows)

    def quantized(name: str) -> tuple[Tensor, ...] | None:
        """The shards of a weight the loader holds on its blocks (gguf_load._Builder.native)."""
        t = by_name.get(name)
        if not (on_cpu_f32 and cpu_quantized and model.source == "gguf" and t is not None and len(t.shape) == 2):
            return None
        return t.pieces if all(supports(p.dtype, p.shape) for p in t.pieces) else None

    held: dict[str, int] = {}

    def hold(kind: str, nbytes: int) -> int:
        held[kind] = held.get(kind, 0) + nbytes
        return nbytes

    def hold_records(parts: tuple[Tensor, ...]) -> int:  # as repacked for the kernel of `activations`
        return sum(hold(p.dtype, held_bytes(p.dtype, p.nbytes, activations)) for p in parts)

    # A pre-quantized folder's linears on CUDA, as stored; on the CPU in float32 its int4 and
    # int8 ones as the kernels' records (_cpu_records); else dequantized to dtype.
    scaled = _scaled_linears(model) if device.kind == "cuda" else {}
    records = _cpu_records(model) if on_cpu_f32 and cpu_quantized else {}
    if records:
        scaled = records
    read = 0
    for name, (o, i) in linears.items():
        q = quantized(name)
        if name in scaled:
            read += hold(*scaled[name])
        else:
            read += hold_records(q) if q else hold(dtype, o * i * size)
    layer_linears = read
    read += hold(dtype, (bias + norms) * size)
    before_vocab = sum(held.values())
    embed = quantized("embed_tokens")
    lookup = embed is not None and lookup_supported(embed[0].dtype, embed[0].shape)
    if cfg.tie_word_embeddings:
        # The head multiplies with the embedding's weights: its GGUF blocks where the kernel
        # takes them (the lookup reads them too where it takes the type, else a table of its
        # own); else (CPU float32) a oneDNN-packed float32 copy and the table; else the table.
        if embed:
            read += hold_records(embed)
            if not lookup:
                hold(dtype, head * size)
        elif on_cpu_f32:
            read += hold(dtype, head * size)  # the packed head
            hold(dtype, head * size)  # the table
        else:
            read += hold(dtype, head * size)
    elif "lm_head" in scaled:
        read += hold(*scaled["lm_head"])
        hold(dtype, head * size)  # the embedding table
    else:
        lm = quantized("lm_head")
        read += hold_records(lm) if lm else hold(dtype, head * size)
        if embed and lookup:
            hold_records(embed)
        else:
            hold(dtype, head * size)
    kept = sorted(k for k in held if k != dtype)
    how = (f"CPU {dtype}: {'/'.join(kept)} linears kept quantized for the C kernels, the rest {dtype}"
           if kept else f"every weight in {dtype}")
    if records:
        assert model.quantization is not None
        kinds = "/".join(sorted({kind for kind, _ in records.values()}))
        how = f"{model.quantization.name}: linears as {kinds} records for the CPU kernels, the rest {dtype}"
    elif scaled:
        assert model.quantization is not None
        how = f"{model.quantization.name}: linears as stored (scales in float32), the rest {dtype}"
    elif model.quantization is not None:
        how = f"{model.quantization.name}: dequantized at load to {dtype} on the CPU"
    return Weights(stored, held, read, matmul, head, how, layer_linears, sum(held.values()) - before_vocab)


def per_rank(w: Weights, tp: int, vocab_rows: int = 0) -> Weights:
    """Rank 0's share under tensor parallelism (worker/parallel/shard.py) of `w`, the weights
    with a rank's `vocab_rows` of the embedding and head (`weights(vocab_rows=...)`): 1/tp
    of every layer's linears besides, and whole the norms."""
    if tp == 1:
        return w
    cut = w.layer_linear_bytes - w.layer_linear_bytes // tp
    held = {"rank 0": sum(w.held.values()) - cut}
    return Weights(w.stored, held, w.read_per_step - cut,
                   (w.matmul_params - w.head_params) // tp + w.head_params, w.head_params,
                   w.how + f"; a rank holds 1/{tp} of each layer's linears and {vocab_rows} vocab rows",
                   w.layer_linear_bytes // tp, w.vocab_bytes)


# ----- the plan -----

@dataclass(frozen=True)
class Workload:
    """One request's shape, the load to serve and its SLOs."""

    prompt_len: int
    output_len: int
    qps: float = 0.0
    ttft_slo: float = 0.0  # seconds; 0 = none
    tpot_slo: float = 0.0


@dataclass
class Plan:
    model: dict[str, Any]
    device: dict[str, Any]
    weights: dict[str, Any]
    kv_cache: dict[str, Any]
    decode: dict[str, Any]
    prefill: dict[str, Any]
    slo: dict[str, Any]
    replicas: dict[str, Any]
    parallel: dict[str, Any] = field(default_factory=dict)
    how: str = HOW
    notes: list[str] = field(default_factory=list)


class Roofline:
    """Step times of one replica: the arithmetic of this module's docstring."""

    def __init__(self, cfg: LlamaConfig, w: Weights, kv_per_token: int, device: Device, dtype: str,
                 req: Workload, chunk: int) -> None:
        self.cfg, self.w, self.kv, self.req, self.chunk = cfg, w, kv_per_token, req, chunk
        self.bw, self.peak = device.bandwidth, device.flops.get(dtype) or device.flops["bfloat16"]
        self.context = req.prompt_len + req.output_len / 2
        self.attn = cfg.num_layers * cfg.num_heads * cfg.head_dim  # per token of context
        self.tp, self.link = 1, device.link_bandwidth
        self.dtype_bytes = DTYPE_BYTES[dtype]

    def all_reduce(self, rows: int) -> float:
        """Seconds of a step's collectives under tensor parallelism (`cfg` is a rank's): two
        all-reduces a layer and the embedding's one, of [rows, hidden], a ring's 2 (k - 1) / k
        of the bytes each way at the link; then the gather of the rows' logits, the other
        ranks' (k - 1) / k of [rows, V], into rank 0 at the link."""
        if self.tp == 1 or not self.link:
            return 0.0
        k = self.tp
        nbytes = rows * self.cfg.hidden_size * self.dtype_bytes
        one = 2 * (k - 1) / k * nbytes / self.link + ALL_REDUCE_LATENCY_S
        gather = (k - 1) / k * rows * self.cfg.vocab_size * self.dtype_bytes / self.link + ALL_REDUCE_LATENCY_S
        return (2 * self.cfg.num_layers + 1) * one + gather

    def step(self, batch: int) -> tuple[float, float, float]:
        """(seconds, memory seconds, compute seconds) of one decode step of `batch` sequences."""
        mem = (self.w.read_per_step + batch * self.context * self.kv) / self.bw
        comp = batch * (2 * self.w.matmul_params + 4 * self.attn * self.context) / self.peak
        return max(mem, comp) + self.all_reduce(batch), mem, comp

    def prefill(self) -> tuple[float, float, float]:
        p = self.req.prompt_len
        flops = 2 * p * (self.w.matmul_params - self.w.head_params) + 2 * self.w.head_params \
            + 2 * self.attn * p * p
        mem = (math.ceil(p / self.chunk) * self.w.read_per_step + p * self.kv) / self.bw
        return max(mem, flops / self.peak), mem, flops / self.peak

    def tpot(self, batch: int) -> float:
        return self.step(batch)[0] + batch / self.req.output_len * self.prefill()[2]

    def ttft(self, batch: int) -> float:
        return self.prefill()[0] + self.step(batch)[0]

    def latency(self, batch: int) -> float:
        return self.ttft(batch) + self.req.output_len * self.tpot(batch)


@dataclass(frozen=True)
class RankFit:
    """What rank 0 of a tensor-parallel group of `tp` holds (tp = 1: the whole model), and
    whether it fits the device (`why`: None, or why not)."""

    tp: int
    config: LlamaConfig  # a rank's view: its heads, KV heads and MLP slice
    weights: Weights  # rank 0's
    held: int
    kv_per_token: int
    budget: Any  # kvcache.budget.KVBudget, or None where it does not fit
    why: str | None

    def describe(self) -> str:
        kv = (f"KV cache {self.budget.num_blocks} blocks ({_size(self.budget.budget_bytes)})"
              if self.budget else "no KV cache")
        return f"-tp {self.tp}: {_size(self.held)} of weights a rank, {kv}"


def fit_at(model: ModelInfo, device: Device, dtype: str, tp: int, max_model_len: int,
           cache: CacheConfig, sched: SchedulerConfig, cpu_activations: str = "auto") -> RankFit:
    """Rank 0's weights and KV blocks at `tp`, as the worker sizes them: under tensor
    parallelism a GGUF's rank holds its slices on the file's blocks as TP = 1 holds the
    whole (worker/parallel/gguf_split.py), and each rank's cache holds its KV heads only,
    in the same budget a device (ValueError where `tp` does not split the model)."""
    cfg = model.config
    rank_cfg, vocab_rows = cfg, 0
    if tp > 1:  # the worker's refusals: heads, the MLP, a GGUF's blocks where the kernels hold them
        quantized = device.kind == "cpu" and dtype == "float32" and model.source == "gguf"
        pieces = {t.name: [(p.dtype, p.shape) for p in t.pieces] for t in model.tensors}
        shard = gguf_split.check(cfg, tp, pieces, quantized)
        rank_cfg, vocab_rows = shard.config(cfg), shard.vocab(0).rows_per_rank
    w = per_rank(weights(model, device, dtype, cpu_activations=cpu_activations, vocab_rows=vocab_rows),
                 tp, vocab_rows)
    held = sum(w.held.values())
    kv = memory.kv_cache_dtype(cache.kv_cache_dtype, torch.device(device.kind), getattr(torch, dtype))
    per_token = kv_bytes_per_token(rank_cfg.num_layers, rank_cfg.num_kv_heads, rank_cfg.head_dim, kv.itemsize)
    if held >= device.memory_bytes:
        return RankFit(tp, rank_cfg, w, held, per_token, None,
                       f"the weights ({held / _GB:.1f} GB held a rank) do not fit in "
                       f"{device.name}'s {device.memory_bytes / _GB:.0f} GB")
    mem = None
    if device.kind == "cuda":  # as the engine sees it once the weights are loaded
        free = max(device.memory_bytes - held - CUDA_CONTEXT_BYTES, 0)
        mem = memory.DeviceMemory(total=device.memory_bytes, free=free, held=held)
    activations = memory.activation_reserve(rank_cfg, sched, max_model_len, DTYPE_BYTES[dtype])
    try:
        budget = fit_budget(memory.kv_cache_bytes(cache, mem, activations),
                            cache.block_size, per_token, max_model_len)
    except ValueError as e:
        return RankFit(tp, rank_cfg, w, held, per_token, None, str(e))
    return RankFit(tp, rank_cfg, w, held, per_token, budget, None)


TP_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tried for the smallest size that fits (and 3, 6 where they divide)


def smallest_fit(model: ModelInfo, device: Device, dtype: str, max_model_len: int,
                 cache: CacheConfig, sched: SchedulerConfig, cpu_activations: str = "auto"
                 ) -> tuple[list[RankFit], RankFit | None]:
    """Every size tried in increasing order up to the first that fits (the seed lesson's
    recipe: split only as far as the model needs), and that one (None: none up to 64)."""
    tried: list[RankFit] = []
    for k in sorted({*TP_SIZES, 3, 6}):
        try:
            fit = fit_at(model, device, dtype, k, max_model_len, cache, sched, cpu_activations)
        except ValueError:  # k does not split the heads
            continue
        tried.append(fit)
        if fit.why is None:
            return tried, fit
    return tried, None


def make_plan(model: ModelInfo, device: Device, req: Workload, dtype: str = "auto",
              max_model_len: int = 0, cache: CacheConfig | None = None,
              sched: SchedulerConfig | None = None, cpu_activations: str = "auto",
              tp: int = 1) -> Plan:
    """`tp`: a replica over that many devices (tensor parallelism); the figures are a rank's
    and a step's all-reduces cost their bytes at the device's link. A model that does not fit
    at `tp` is a ValueError naming the smallest size that does, with its per-rank figures."""
    cache, sched, cfg = cache or CacheConfig(), sched or SchedulerConfig(), model.config
    if dtype == "auto":  # as the engine resolves it
        dtype = "float32" if device.kind == "cpu" else "bfloat16"
    max_model_len = max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    if req.prompt_len < 1 or req.output_len < 1:
        raise ValueError("--prompt-len and --output-len must be >= 1")
    seq = req.prompt_len + req.output_len
    if seq > max_model_len:
        raise ValueError(f"--prompt-len + --output-len ({seq}) exceeds --max-model-len {max_model_len}")
    # what serve's cache would hold (refused alike)
    fit = fit_at(model, device, dtype, tp, max_model_len, cache, sched, cpu_activations)
    if fit.why is not None and fit.held < device.memory_bytes:
        raise ValueError(fit.why)  # the weights fit, the cache does not: as serve refuses it
    if fit.why is not None:
        tried, found = smallest_fit(model, device, dtype, max_model_len, cache, sched, cpu_activations)
        where = (f"the smallest --tensor-parallel-size that fits: {found.tp} ({found.describe()}, "
                 f"{found.tp} x {device.name} a replica)" if found else "no size up to 64 fits")
        raise ValueError(f"{model.name} does not fit at --tensor-parallel-size {tp} on "
                         f"{device.name}: {fit.why}. Per rank: "
                         + "; ".join(f.describe() for f in tried) + f". {where[0].upper()}{where[1:]}")
    w, held, per_token, budget = fit.weights, fit.held, fit.kv_per_token, fit.budget
    full = weights(model, device, dtype, cpu_activations=cpu_activations)
    blocks_per_seq = -(-seq // cache.block_size)
    kv_seqs = budget.num_blocks // blocks_per_seq
    max_batch = min(kv_seqs, sched.max_num_seqs)
    roof = Roofline(fit.config, w, per_token, device, dtype, req, sched.max_num_batched_tokens)
    roof.tp = tp

    def step_row(b: int) -> dict[str, Any]:
        t, mem, comp = roof.step(b)
        return {"batch": b, "step_s": t, "memory_s": mem, "compute_s": comp,
                "all_reduce_s": roof.all_reduce(b),
                "bound": "memory" if mem >= comp else "compute", "output_tokens_per_s": b / t,
                "tpot_s": roof.tpot(b)}

    # The operating batch: the largest the cache and --max-num-seqs hold within both SLOs.
    def holds(b: int) -> bool:
        return ((not req.tpot_slo or roof.tpot(b) <= req.tpot_slo)
                and (not req.ttft_slo or roof.ttft(b) <= req.ttft_slo))

    op = next((b for b in range(max_batch, 0, -1) if holds(b)), 0)
    slo: dict[str, Any] = {"ttft_slo_s": req.ttft_slo or None, "tpot_slo_s": req.tpot_slo or None,
                           "holds": op > 0, "operating_batch": op}
    if op:
        slo.update(ttft_s=roof.ttft(op), tpot_s=roof.tpot(op), latency_s=roof.latency(op),
                   output_tokens_per_s=op / roof.tpot(op))
    replicas: dict[str, Any] = {"qps": req.qps or None}
    if req.qps and op:
        by_latency = math.ceil(req.qps * roof.latency(op) / op - 1e-9)
        work = req.qps * (roof.prefill()[0] + req.output_len * roof.step(op)[0] / op)
        by_work = math.ceil(work - 1e-9)
        n = max(by_latency, by_work, 1)
        batch = float(op)
        for _ in range(50):  # each replica's batch at this load: b = QPS/n x latency(b)
            batch = min(float(op), req.qps / n * roof.latency(max(1, math.ceil(batch))))
        replicas.update(replicas=n, concurrency=req.qps * roof.latency(op), by_latency=by_latency,
                        by_work=by_work, work_replica_s_per_s=work, batch_per_replica=batch)
    elif req.qps:
        replicas["replicas"] = None
    notes = []
    if kv_seqs < sched.max_num_seqs:
        notes.append(f"the KV cache ({kv_seqs} sequences), not --max-num-seqs "
                     f"{sched.max_num_seqs}, limits the batch")
    elif kv_seqs > sched.max_num_seqs:
        notes.append(f"--max-num-seqs {sched.max_num_seqs}, not the KV cache ({kv_seqs} "
                     "sequences), limits the batch: raising it serves more per replica")
    return Plan(
        model={"name": model.name, "source": model.source, "layers": cfg.num_layers,
               "hidden": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
               "head_dim": cfg.head_dim, "vocab": cfg.vocab_size, "params": cfg.num_params,
               "tied_embeddings": cfg.tie_word_embeddings,
               "max_position_embeddings": cfg.max_position_embeddings},
        device={"name": device.name, "memory_bytes": device.memory_bytes,
                "bandwidth_bytes_per_s": device.bandwidth, "peak_flops": roof.peak, "dtype": dtype,
                "note": device.note},
        parallel={"tensor_parallel_size": tp, "devices_per_replica": tp,
                  "heads_per_rank": fit.config.num_heads, "kv_heads_per_rank": fit.config.num_kv_heads,
                  "all_reduces_per_step": 2 * cfg.num_layers + 1 if tp > 1 else 0,
                  "vocab_rows_per_rank": fit.weights.head_params // cfg.hidden_size,
                  "link_bytes_per_s": device.link_bandwidth,
                  "held_total_bytes_whole_model": sum(full.held.values())},
        weights={"stored_bytes": w.stored, "held_bytes": full.held if tp > 1 else w.held,
                 "held_total_bytes": held,
                 "read_per_step_bytes": w.read_per_step, "matmul_params": w.matmul_params,
                 "held_how": w.how},
        kv_cache={"bytes_per_token": per_token, "bytes_per_block": per_token * cache.block_size,
                  "block_size": cache.block_size, "budget_bytes": budget.budget_bytes,
                  "num_blocks": budget.num_blocks, "num_tokens": budget.num_tokens,
                  "max_model_len": max_model_len,
                  "max_concurrent_at_max_model_len": budget.max_concurrent_requests,
                  "sequence_tokens": seq, "blocks_per_sequence": blocks_per_seq,
                  "max_concurrent_sequences": kv_seqs, "max_num_seqs": sched.max_num_seqs,
                  "max_batch": max_batch},
        decode={"mean_context": roof.context, "batch_1": step_row(1), "max_batch": step_row(max_batch)},
        prefill={"prompt_len": req.prompt_len, "seconds": roof.prefill()[0]},
        slo=slo, replicas=replicas, notes=notes)


# ----- the command -----

def _size(n: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(s: float) -> str:
    ms = s * 1000
    return f"{ms:.3f} ms" if ms < 1 else f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms" if s < 1 else f"{s:.2f} s"


def _by_size(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {_size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))


def render(p: Plan) -> str:
    m, d, w, kv, dec = p.model, p.device, p.weights, p.kv_cache, p.decode
    note = f" ({d['note']})" if d["note"] else ""
    out = [f"plan: {m['name']} ({m['source']}) on {d['name']}{note}, {d['dtype']}",
           f"model     {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / {m['kv_heads']} KV "
           f"heads x {m['head_dim']}, vocab {m['vocab']}, {m['params'] / 1e6:.1f}M parameters",
           "weights   stored: " + _by_size(w["stored_bytes"]),
           "          held:   " + _by_size(w["held_bytes"])
           + (f" = {_size(w['held_total_bytes'])}" if p.parallel.get("tensor_parallel_size", 1) == 1
              else f"; rank 0 holds {_size(w['held_total_bytes'])}") + f" ({w['held_how']})",
           f"          read per decode step: {_size(w['read_per_step_bytes'])}",
           f"KV cache  {kv['bytes_per_token']} B/token, {_size(kv['bytes_per_block'])}/block of "
           f"{kv['block_size']}; budget {_size(kv['budget_bytes'])} = {kv['num_blocks']} blocks = "
           f"{kv['num_tokens']} tokens",
           f"          {kv['max_concurrent_at_max_model_len']} requests of --max-model-len "
           f"{kv['max_model_len']}; {kv['max_concurrent_sequences']} sequences of "
           f"{kv['sequence_tokens']} tokens ({kv['blocks_per_sequence']} blocks); max batch "
           f"{kv['max_batch']} (--max-num-seqs {kv['max_num_seqs']})"]
    par = p.parallel
    if par.get("tensor_parallel_size", 1) > 1:
        link = (f"{par['link_bytes_per_s'] / _GB:.0f} GB/s a direction" if par["link_bytes_per_s"]
                else "not modelled")
        out.insert(2, f"parallel  -tp {par['tensor_parallel_size']}: {par['heads_per_rank']} heads / "
                      f"{par['kv_heads_per_rank']} KV heads, {par['vocab_rows_per_rank']} vocab rows a "
                      f"rank; {par['all_reduces_per_step']} all-reduces and a gather of logits a step "
                      f"(link {link}); figures below are a rank's (a replica is "
                      f"{par['devices_per_replica']} devices)")
    for key in ("batch_1", "max_batch"):
        r = dec[key]
        ar = f", all-reduce {_ms(r['all_reduce_s'])}" if r.get("all_reduce_s") else ""
        out.append(f"decode    batch {r['batch']}: step {_ms(r['step_s'])} ({r['bound']}-bound; memory "
                   f"{_ms(r['memory_s'])}, compute {_ms(r['compute_s'])}{ar}), "
                   f"{r['output_tokens_per_s']:.0f} output tok/s; TPOT {_ms(r['tpot_s'])}")
    out.append(f"prefill   {p.prefill['prompt_len']} tokens: {_ms(p.prefill['seconds'])}")
    s = p.slo
    if s["holds"]:
        out.append(f"SLOs      hold at batch {s['operating_batch']}: TTFT {_ms(s['ttft_s'])}"
                   + (f" (<= {_ms(s['ttft_slo_s'])})" if s["ttft_slo_s"] else "")
                   + f", TPOT {_ms(s['tpot_s'])}"
                   + (f" (<= {_ms(s['tpot_slo_s'])})" if s["tpot_slo_s"] else "")
                   + f", {s['output_tokens_per_s']:.0f} output tok/s per replica")
    else:
        out.append("SLOs      cannot hold at any batch on this device")
    r = p.replicas
    if r["qps"] and r.get("replicas"):
        out.append(f"replicas  {r['replicas']} for {r['qps']:g} QPS (Little: concurrency "
                   f"{r['concurrency']:.1f} / batch {s['operating_batch']} -> {r['by_latency']}; "
                   f"work {r['work_replica_s_per_s']:.2f} replica-s/s -> {r['by_work']}); "
                   f"each at batch ~{r['batch_per_replica']:.1f}")
    elif r["qps"]:
        out.append(f"replicas  none can serve {r['qps']:g} QPS within the SLOs")
    out += [f"note      {n}" for n in p.notes]
    out.append(f"how this is estimated: {p.how}")
    return "\n".join(out)


def _run(args: argparse.Namespace) -> int:
    model = read_model(args.model)
    dtype = args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
    device = parse_device(args.device, dtype)
    cache = CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_free_memory_fraction=args.kv_cache_free_memory_fraction,
                        kv_cache_dtype=args.kv_cache_dtype)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    req = Workload(args.prompt_len, args.output_len, args.qps, args.ttft_slo, args.tpot_slo)
    if min(req.qps, req.ttft_slo, req.tpot_slo) < 0:
        raise ValueError("--qps, --ttft-slo and --tpot-slo must be >= 0")
    plan = make_plan(model, device, req, dtype, args.max_model_len, cache, sched,
                     args.cpu_activations, args.tensor_parallel_size)
    if args.compare_step:
        rows = compare_step(args.compare_step, model, device, dtype, args.model,
                            args.cpu_activations)
        if args.json:
            print(json.dumps({"plan": asdict(plan), "compare_step": rows}))
        else:
            print(render_comparison(rows, device))
        return 0
    print(json.dumps(asdict(plan)) if args.json else render(plan))
    return 0


def compare_step(path: str, model: ModelInfo, device: Device, dtype: str, spec: str,
                 cpu_activations: str = "auto") -> list[dict[str, Any]]:
    """The predicted decode step against `benchmarks.step --output-json`'s measured one, at
    the bench's batches and mean context (its prompt, +2 warm-up tokens, + half its timed steps)."""
    report = json.loads(Path(path).read_text())
    bench = report["info"]["args"]
    if bench["model"] != spec:
        raise ValueError(f"{path} measured --model {bench['model']!r}, not {spec!r}")
    cfg = model.config
    w = weights(model, device, dtype, cpu_activations=cpu_activations)
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, DTYPE_BYTES[dtype])
    context = bench["context"] + 2 + (bench["steps"] - 1) / 2
    roof = Roofline(cfg, w, per_token, device, dtype, Workload(bench["context"], 1), 1)
    roof.context = context
    first = report["rows"][0]["variant"]  # the default variant, quantized, comes first
    out = []
    for r in report["rows"]:
        if r["variant"] == first:
            t, mem, comp = roof.step(r["batch"])
            out.append({"variant": first, "batch": r["batch"], "context": context,
                        "predicted_ms": t * 1000, "memory_ms": mem * 1000, "compute_ms": comp * 1000,
                        "measured_ms": r["step_ms"], "measured_over_predicted": r["step_ms"] / (t * 1000)})
    return out


def render_comparison(rows: list[dict[str, Any]], device: Device) -> str:
    out = [f"decode step, predicted ({device.note or device.name}) against measured (benchmarks.step)",
           "", "| batch | mean context | predicted ms (memory / compute) | measured ms | measured / predicted |",
           "|---|---|---|---|---|"]
    out += [f"| {r['batch']} | {r['context']:.1f} | {r['predicted_ms']:.1f} ({r['memory_ms']:.1f} / "
            f"{r['compute_ms']:.1f}) | {r['measured_ms']:.1f} | **{r['measured_over_predicted']:.2f}** |"
            for r in rows]
    return "\n".join(out)


def add_parser(sub: Any) -> None:
    """`llm-worker plan`, on the CLI's subparsers."""
    m, c, s = ModelConfig(), CacheConfig(), SchedulerConfig()
    p = sub.add_parser("plan", help="capacity plan: weights, KV blocks, decode roofline, replicas "
                       "for a load (from the model's config; nothing is loaded)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=m.model, help="as `serve --model` takes it (default %(default)s)")
    p.add_argument("--device", default="cpu",
                   help=f"{', '.join(DEVICES)}, cpu (measured here) or custom:MEM_GB,BW_GBps,TFLOPS "
                   "(default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_BYTES),
                   help="auto = float32 on cpu, bfloat16 on a GPU")
    p.add_argument("--max-model-len", type=human_readable_int, default=m.max_model_len,
                   help="as serve's (0 = the model's own limit)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per request "
                   "(default %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request "
                   "(default %(default)s)")
    p.add_argument("--qps", type=float, default=0.0, help="requests per second to serve (all replicas)")
    p.add_argument("--ttft-slo", type=float, default=0.0, help="time to first token, seconds (0 = none)")
    p.add_argument("--tpot-slo", type=float, default=0.0, help="time per output token, seconds (0 = none)")
    p.add_argument("--block-size", type=int, default=c.block_size)
    p.add_argument("--kv-cache-memory", type=float, default=c.kv_cache_memory,
                   help="GiB, as serve's (0 = 1 GiB on cpu, else the GPU's free-memory share)")
    p.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=c.kv_cache_memory_bytes,
                   help="bytes, as serve's (4G = 4 GiB, 4g = 4e9)")
    p.add_argument("--gpu-memory-utilization", type=float, default=c.gpu_memory_utilization,
                   help="as serve's: the share of the GPU's total memory the worker may use")
    p.add_argument("--kv-cache-free-memory-fraction", type=float,
                   default=c.kv_cache_free_memory_fraction, help="as serve's")
    p.add_argument("--kv-cache-dtype", default=c.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="as serve's: float16 halves a token's KV bytes (a float32 model on cpu)")
    p.add_argument("--cpu-activations", default=m.cpu_activations,
                   choices=("auto", *ACTIVATIONS),
                   help="as serve's: the CPU kernels' activation arithmetic (auto: int16 with "
                   "AVX-512 VNNI, else float32; resolved on this machine)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="as serve's: a replica over N devices; a rank's weights and KV blocks, "
                   "the all-reduces' cost at the device's link (a model that does not fit says "
                   "the smallest N that does)")
    p.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the text")
    p.add_argument("--compare-step", metavar="JSON",
                   help="compare the predicted decode step with a `python -m benchmarks.step "
                   "--output-json` file of the same --model (a markdown table)")
    p.set_defaults(func=_run)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="llm-worker")
    add_parser(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args()
    sys.exit(a.func(a))

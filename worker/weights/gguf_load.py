"""A model built from a GGUF file one tensor at a time, with no float copy of what the CPU
kernels compute on.

The model is constructed on the `meta` device (shapes, no memory); then each tensor goes
from the file's map to what the model keeps, and the map's pages it was read through are
given back (`GGUFFile.release`: touched pages of a mapped file count in the process's
resident memory):

- a linear weight (q/k/v and gate/up fused as the model fuses them) of a type the CPU kernels
  take (`ops.quantized_linear.supports`), when the load is for them (`LinearPolicy`): a
  `QuantLinear` repacked from the file's blocks, held at the file's size (`held_bytes`); a
  fused set of several such types (Q4_K_M's Q6_K attn_v beside Q4_K q and k) a
  `StackedLinear` of one per type; the token embedding the tied head's records, looked up in
  them (`QuantEmbedding`) where the lookup takes the type;
- anything else (norms, biases, a type no kernel takes, every tensor on CUDA or without the
  kernels, --no-cpu-quantized-linear) dequantized alone to the model's dtype on its device.

`Held` records each tensor as it is held, for the start-up log (`describe_held`) and the
capacity planner's check (worker/plan.py computes the same figures without loading).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import _type_traits
from torch import nn

from ops import huge_pages, quantized_linear
from ops.quantized_linear import (
    QuantEmbedding,
    QuantizedWeight,
    QuantLinear,
    activations_for,
    supports,
)
from ops.stacked_linear import StackedLinear
from worker.models.gemma import GemmaConfig, GemmaForCausalLM
from worker.models.llama import (
    Embedding,
    Linear,
    LlamaConfig,
    LlamaForCausalLM,
    fuse_shards,
    our_name,
)
from worker.parallel.gguf_split import GGUFSplit
from worker.weights import gguf_file
from worker.weights.gguf_piece import Piece
from worker.weights.gguf_reader import GGUFFile

_MiB = 1 << 20
# Types held as elements (gguf.dequantize reads them itself); the block types it reads are
# its _type_traits.
_FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class LinearPolicy:
    """How a load holds a GGUF's linear layers: on the file's blocks for the CPU kernels
    (`quantized`, multiplying in `activations`, resolved), or dequantized to the model's
    dtype. Part of the load: an engine with another policy needs a load of its own."""

    quantized: bool
    activations: str = ""

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype, cpu_quantized_linear: bool,
           cpu_activations: str) -> LinearPolicy:
        """The policy serve's --cpu-quantized-linear and --cpu-activations ask for here: the
        kernels run on the CPU in float32 where they compile."""
        activations = quantized_linear.resolve_activations(cpu_activations)  # checks the name
        on = (cpu_quantized_linear and device.type == "cpu" and dtype == torch.float32
              and quantized_linear.available())
        return cls(True, activations) if on else cls(False)

    def describe(self) -> str:
        return f"quantized, {self.activations} activations" if self.quantized else "dequantized"


@dataclass(frozen=True)
class Held:
    """One GGUF tensor as a load holds it: `how` is "QTYPE records" (the kernels' layout of
    its blocks) or a dtype (dequantized), with why in `note`."""

    name: str
    qtype: str  # as stored
    file_bytes: int
    held_bytes: int
    how: str
    note: str = ""


def readable(qtype: str) -> bool:
    """Whether a tensor of this stored type can be read at all (natively or dequantized)."""
    from gguf import GGMLQuantizationType

    return qtype in _FLOAT_TYPES or GGMLQuantizationType[qtype] in _type_traits


def lookup_supported(qtype: str, shape: tuple[int, int]) -> bool:
    """Whether `QuantEmbedding` looks rows up in a weight of this type (its records shared
    with a tied head's `QuantLinear`): every type `supports` takes (ops/quantized_linear.py's
    interface)."""
    return supports(qtype, shape)


def _rows(shards: list[Piece]) -> int:
    return sum(s.shape[0] for s in shards)


def _quantized_weight(shards: list[Piece]) -> QuantizedWeight:
    """The shards' blocks stacked by rows (one copy; none for a lone shard in place)."""
    if len(shards) == 1:
        blocks = shards[0].blocks()
    else:
        blocks = None
        row = 0
        for s in shards:  # one piece's blocks at a time (a view of the map, or a rank's slice)
            part = s.blocks()
            if blocks is None:
                blocks = np.empty((_rows(shards), part.shape[1]), dtype=part.dtype)
            blocks[row : row + part.shape[0]] = part
            row += part.shape[0]
    return QuantizedWeight(shards[0].qtype, blocks, (_rows(shards), shards[0].shape[1]))


def _floats(shards: list[Piece], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The shards dequantized one at a time into one tensor of `dtype` on `device`."""
    out = torch.empty((_rows(shards), *shards[0].shape[1:]), dtype=dtype, device=device)
    row = 0
    for s in shards:
        w = s.floats()
        with warnings.catch_warnings():  # a read-only view of the map: only read from here
            warnings.simplefilter("ignore", UserWarning)
            out[row : row + w.shape[0]].copy_(torch.from_numpy(w))
        row += w.shape[0]
    return out


class _Builder:
    """One load: the meta model's modules and parameters replaced by real ones."""

    def __init__(self, reader: GGUFFile, model: LlamaForCausalLM, device: torch.device,
                 dtype: torch.dtype, policy: LinearPolicy) -> None:
        self.reader, self.model, self.device, self.dtype, self.policy = reader, model, device, dtype, policy
        self.held: list[Held] = []

    def native(self, shards: list[Piece]) -> bool:
        return self.policy.quantized and all(supports(s.qtype, s.shape) for s in shards)

    def why_float(self, shards: list[Piece]) -> str:
        if any(len(s.shape) == 1 for s in shards):
            return "norms and biases"
        if self.device.type != "cpu":
            return f"no GGUF kernels on {self.device.type}: dequantized at load"
        if not self.policy.quantized:
            if self.dtype != torch.float32:
                return f"the CPU kernels take float32 loads: dequantized at load to {str(self.dtype)[6:]}"
            return "--no-cpu-quantized-linear" if quantized_linear.available() else "no CPU kernels built"
        return "no native kernel for this type"

    def hold_records(self, shards: list[Piece], records: torch.Tensor, note: str = "") -> None:
        """Account `records` (the kernel's layout of these shards) to the shards by file bytes."""
        total = sum(s.n_bytes for s in shards)  # a rank's slices: their bytes (gguf_piece.py)
        for s in shards:
            share = records.nbytes * s.n_bytes // total
            self.held.append(Held(s.tensor.name, s.qtype, s.tensor.n_bytes, share,
                                  f"{s.qtype} records", note or self.policy.activations))

    def hold_floats(self, shards: list[Piece], note: str = "", count_file: bool = True) -> None:
        size = torch.empty((), dtype=self.dtype).element_size()
        for s in shards:
            why = note or self.why_float([s])
            if not note and self.policy.quantized and supports(s.qtype, s.shape):
                why = "fused with a type no native kernel takes"
            self.held.append(Held(s.tensor.name, s.qtype, s.tensor.n_bytes if count_file else 0,
                                  int(np.prod(s.shape)) * size, str(self.dtype).removeprefix("torch."), why))

    def release(self, shards: list[Piece]) -> None:
        for s in shards:
            self.reader.release(s.tensor.offset, s.tensor.n_bytes)

    # ----- the model's parts -----

    def parameter(self, name: str, shards: list[Piece]) -> None:
        """A bare parameter (a norm) or a linear's bias."""
        path, _, attr = name.rpartition(".")
        owner = self.model.get_submodule(path)
        old = getattr(owner, attr, None)
        if not isinstance(old, nn.Parameter):
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
        # Gemma's norms (1 + w, as the file stores them) stay float32 whatever the model's dtype.
        gemma_norm = isinstance(self.model, GemmaForCausalLM) and name.endswith("norm")
        value = _floats(shards, torch.float32 if gemma_norm else self.dtype, self.device)
        _check_shape(name, value.shape, old.shape)
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))
        self.hold_floats(shards)

    def linear(self, path: str, shards: list[Piece]) -> None:
        meta = self.model.get_submodule(path)
        _check_shape(f"{path}.weight", (_rows(shards), *shards[0].shape[1:]), meta.weight.shape)
        bias = meta.bias
        if bias is not None and bias.is_meta:
            raise ValueError(f"weights missing from the checkpoint: {path}.bias")
        parent, _, child = path.rpartition(".")
        setattr(self.model.get_submodule(parent), child, self._linear(shards, bias))

    def _linear(self, shards: list[Piece], bias: torch.Tensor | None) -> nn.Module:
        if not self.native(shards):
            layer = Linear(shards[0].shape[1], _rows(shards), bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(_floats(shards, self.dtype, self.device), requires_grad=False)
            layer.bias = bias if bias is None else nn.Parameter(bias, requires_grad=False)
            self.hold_floats(shards)
            return layer
        runs: list[list[Piece]] = []  # consecutive shards of one type
        for s in shards:
            if runs and runs[-1][0].qtype == s.qtype:
                runs[-1].append(s)
            else:
                runs.append([s])
        parts, row = [], 0
        for run in runs:
            qw = _quantized_weight(run)
            part_bias = None if bias is None else bias[row : row + qw.shape[0]]
            part = QuantLinear(qw, part_bias, activations_for(qw, self.policy.activations))
            self.hold_records(run, part.packed)
            parts.append(part)
            row += qw.shape[0]
        return parts[0] if len(parts) == 1 else StackedLinear(parts)

    def embedding(self, shards: list[Piece]) -> None:
        (s,) = shards
        model, cfg = self.model, self.model.config
        rows = model.embed_tokens.num_embeddings  # the vocabulary, or a rank's rows of it
        _check_shape("embed_tokens.weight", s.shape, (rows, cfg.hidden_size))
        lookup: nn.Module | None = None
        if self.native(shards):
            qw = _quantized_weight(shards)
            if cfg.tie_word_embeddings:
                head = QuantLinear(qw, None, activations_for(qw, self.policy.activations))
                model.tied_head = head
                if lookup_supported(s.qtype, s.shape):
                    lookup = QuantEmbedding.of_head(head, qw)
                    note = f"{head.activations}; the tied head's, the embedding lookup reads them too"
                else:
                    note = f"{head.activations}; the tied head's"
                self.hold_records(shards, head.packed, note)
            elif lookup_supported(s.qtype, s.shape):
                lookup = QuantEmbedding(qw)
                self.hold_records(shards, lookup.packed, "the embedding lookup's")
        if lookup is None:
            table = nn.Embedding(rows, cfg.hidden_size, device="meta")
            table.weight = nn.Parameter(_floats(shards, self.dtype, self.device), requires_grad=False)
            lookup = table
            held = bool(model.tied_head is not None)
            self.hold_floats(shards, "the embedding lookup's table" if held else "", count_file=not held)
        model.embed_tokens = lookup


def _check_shape(name: str, got: tuple[int, ...] | torch.Size, want: tuple[int, ...] | torch.Size) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"tensor {name!r} has shape {tuple(got)}, the config implies {tuple(want)}")


def _groups(reader: GGUFFile, cfg: LlamaConfig, arch: str) -> dict[str, list[Piece]]:
    """Every model tensor of the file by this model's name, fused sets as their shards in
    row order (fuse_shards' order), in the order the file completes them."""
    def named() -> Iterator[tuple[str, Piece]]:
        for t in reader.tensors:
            if t.name in gguf_file.CONFIG_TENSORS:
                continue
            ours = our_name(gguf_file.hf_name(t.name, arch))
            if ours is not None:
                yield ours, Piece(t, gguf_file.permuted_heads(t.name, cfg, arch))

    unfinished: set[str] = set()
    groups = {name: (s if isinstance(s, list) else [s])
              for name, s in fuse_shards(named(), list, unfinished)}
    if unfinished:
        raise ValueError(f"weights missing from the checkpoint: {', '.join(sorted(unfinished))[:500]}")
    return groups


def check_types(reader: GGUFFile) -> None:
    """Refuse, before anything is built, a tensor of a type this worker cannot read."""
    for t in reader.tensors:
        if not readable(t.tensor_type.name):
            known = sorted(q.name for q in GGML_QUANT_SIZES if readable(q.name))
            raise ValueError(f"tensor {t.name[:100]!r} has type {t.tensor_type.name}, which this worker "
                             f"cannot read (it reads {', '.join(known)})")


def load_gguf(reader: GGUFFile, cfg: LlamaConfig, arch: str, device: torch.device, dtype: torch.dtype,
              policy: LinearPolicy, split: tuple[int, int] | None = None) -> tuple[LlamaForCausalLM, list[Held]]:
    """The model of `reader` on `device`, its linears held as `policy` says, and how each
    tensor is held. `split` (world, rank): only that tensor-parallel rank's slices are read
    and held (worker/parallel/gguf_split.py), in a model of the rank's heads and MLP slice
    (a ValueError, before anything is built, where the split does not divide) and of its
    vocabulary rows of the embedding and an untied head (worker/parallel/vocab.py)."""
    check_types(reader)
    groups = _groups(reader, cfg, arch)
    model_cfg = cfg
    if split is not None:
        cut = GGUFSplit.of(cfg, *split, groups, policy.quantized)
        groups, model_cfg = cut.apply(groups), cut.plan.config(cfg)
    with torch.device("meta"):
        model = (GemmaForCausalLM if isinstance(cfg, GemmaConfig) else LlamaForCausalLM)(model_cfg)
    if split is not None:  # the rank's table (and untied head): its rows, padded to whole tiles
        rows = cut.plan.vocab(split[1]).rows_per_rank
        with torch.device("meta"):
            model.embed_tokens = Embedding(rows, cfg.hidden_size)
            if model.lm_head is not None:
                model.lm_head = Linear(cfg.hidden_size, rows, bias=False)
    build = _Builder(reader, model, device, dtype, policy)
    modules = dict(model.named_modules())
    if "lm_head.weight" in groups and model.lm_head is None:
        del groups["lm_head.weight"]  # tied checkpoints sometimes still ship it
    # Norms and biases first: a linear takes its bias when it is built.
    later = []
    for name, shards in groups.items():
        path, _, attr = name.rpartition(".")
        module = modules.get(path)
        if attr == "weight" and isinstance(module, (nn.Linear, nn.Embedding)):
            later.append((path, module, shards))
            continue
        build.parameter(name, shards)
        build.release(shards)
    for path, module, shards in later:
        if isinstance(module, nn.Embedding):
            build.embedding(shards)
        else:
            build.linear(path, shards)
        build.release(shards)
    with torch.device(device):
        model.make_rope_tables()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    missing += [f"{n}.weight" for n, m in model.named_modules()
                if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.is_meta]
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {', '.join(sorted(set(missing)))[:500]}")
    huge_pages.trim_heap()  # the repacking's freed temporaries: not the process's to keep
    return model.eval().requires_grad_(False), build.held


class GGUFWeights(Mapping[str, QuantizedWeight]):
    """A load's linear weights as the file stores them (rows unpermuted, fused as the model
    fuses them; a fused set of one type the kernels take), read from the file when asked for
    (nothing is kept): module name ("layers.0.self_attn.qkv_proj", "embed_tokens") ->
    `QuantizedWeight`. For tests and kernel checks."""

    def __init__(self, reader: GGUFFile, cfg: LlamaConfig, arch: str) -> None:
        self._reader = reader
        self._groups = {name.removesuffix(".weight"): shards
                        for name, shards in _groups(reader, cfg, arch).items()
                        if name.endswith(".weight") and len(shards[0].shape) == 2
                        and len({s.qtype for s in shards}) == 1
                        and supports(shards[0].qtype, (_rows(shards), shards[0].shape[1]))}

    def __getitem__(self, name: str) -> QuantizedWeight:
        qw = _quantized_weight(self._groups[name])
        return QuantizedWeight(qw.qtype, np.array(qw.blocks), qw.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)


def describe_held(held: list[Held]) -> str:
    """One line: per stored type and way of holding, how many tensors and their bytes in the
    file and in memory."""
    rows: dict[tuple[str, str, str], list[int]] = {}
    for h in held:
        row = rows.setdefault((h.qtype, h.how, h.note), [0, 0, 0])
        row[0] += 1
        row[1] += h.file_bytes
        row[2] += h.held_bytes
    parts = [f"{q} x{n}: {f / _MiB:.1f} MiB in the file -> {b / _MiB:.1f} MiB as {how} ({note})"
             for (q, how, note), (n, f, b) in sorted(rows.items(), key=lambda kv: -kv[1][2])]
    file_total = sum(h.file_bytes for h in held)
    held_total = sum(h.held_bytes for h in held)
    return (f"GGUF tensors held: {'; '.join(parts)}; in all {file_total / _MiB:.1f} MiB in the file, "
            f"{held_total / _MiB:.1f} MiB held")

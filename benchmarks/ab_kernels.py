"""The kernel workloads of `benchmarks.ab` (native, linear): every side in one process, its
kernels built from its own checkout's sources with this machine's flags.

- `native`: the fused CPU decoder's one native call a step (`cpu_decoder_decode`). An engine
  of this checkout, with the side's settings (`--cpu-activations`, `--kv-cache-dtype`,
  `--no-cpu-huge-pages`), captures one decode step's arguments (a verification step with
  `--drafts K`, the prompts' prefill with `--prefill`); each measurement calls the side's
  build of `ops/cpu_kernels/decoder.c` with them `--calls` times. The other checkout's
  `model_desc`/`step_desc` layouts must be this one's. A side's logits must equal the first
  side's of the same settings (its hidden states for a prefill): `same_output`.
  `--breakdown` times three more calls a measurement: without the LM head (its logits not
  asked for), with a build whose matmuls only zero their outputs, and with one whose
  matmuls read their tiles' records as a plain sum does (`LLMWORKER_READ_ONLY_MATMULS`: the
  weights read in the call's order, shares and waits, without their arithmetic); and a
  plain sum's time for the records' bytes (ReadFloor's probe).
- `linear`: one quantized linear's kernel (`--weight`, a tensor of the default GGUF, or a
  type's random blocks with `--shape NxK`: benchmarks/gguf_blocks.py). Each
  side repacks it with its own checkout's `ops/quantized_linear.py` and `ops/quant_records.py`
  (so a change of the records' layout is measured) and multiplies with its own build of
  `quant_matmul_int8.c` (`quant_matmul.c` for float32 activations); a 64 MB write before
  each call makes the weight come from memory, as in a decode step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from benchmarks.ab import stats
from benchmarks.ab_engine import worker_config
from ops import cpu_decoder, cpu_kernels, huge_pages
from ops.quantized_linear import ACTIVATIONS, QuantizedWeight, QuantLinear, resolve_activations
from scheduler.request import SamplingParams
from worker.config import NgramSpeculation, SpeculativeConfig
from worker.engine import Engine
from worker.weights import default_model_path


def read_gbps(mb: int = 100, repeats: int = 10) -> dict[str, float]:
    """A plain read (a float32 sum) of `mb` MB, best of `repeats`, in 4 KB and in 2 MB pages."""
    n = mb << 18  # floats
    plain = torch.ones(n)
    huge = huge_pages.arena(n * 4).view(torch.float32)
    huge.fill_(1.0)
    out = {}
    for name, t in (("4k", plain), ("huge", huge)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            t.sum()
            best = min(best, time.perf_counter() - t0)
        out[name] = t.numel() * 4 / best / 1e9
    return out


def _decoder_lib(folder: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    if not cpu_kernels.build(folder / "decoder.c", out, extra_flags):
        raise SystemExit(f"cannot build {folder / 'decoder.c'}")
    lib = ctypes.CDLL(str(out))
    lib.cpu_decoder_decode.argtypes = [ctypes.POINTER(cpu_decoder._Model), ctypes.POINTER(cpu_decoder._Step)]
    lib.cpu_decoder_decode.restype = cpu_decoder._i32
    return lib


class _Timed:
    """Stands in for the decoder's library: times each native call (without asking for the
    LM head's logits when `no_head`)."""

    def __init__(self, lib: ctypes.CDLL, times: list[float], no_head: bool = False) -> None:
        self.lib, self.times, self.no_head = lib, times, no_head

    def cpu_decoder_decode(self, m, s) -> int:
        if self.no_head:
            step = cpu_decoder._Step.from_buffer_copy(s._obj)
            step.logits = step.argmax = None  # the greedy tokens are found in the logits
            s = ctypes.byref(step)
        t0 = time.perf_counter()
        rc = self.lib.cpu_decoder_decode(m, s)
        self.times.append((time.perf_counter() - t0) * 1e3)
        return rc


def _captured_step(flags: list[str], batch: int, context: int, drafts: int, prefill: bool):
    """An engine mid-decode with the side's settings, its decoder, and the arguments of one
    decode step (`drafts` drafted tokens a request: a verification step), or with `prefill`
    of the prompts' prefill (every prompt whole, one step)."""
    spec = (SpeculativeConfig(NgramSpeculation(num_speculative_tokens=drafts, prompt_lookup_min=1,
                                                prompt_lookup_max=1, disable_by_batch_size=batch))
            if drafts else SpeculativeConfig())
    conf = worker_config(flags, cache={"kv_cache_memory": 0.5},
                         scheduler={"max_num_seqs": batch, "max_num_batched_tokens": max(8192, batch * context)})
    engine = Engine(dataclasses.replace(conf, speculative=spec))
    if drafts:  # the drafts' values do not matter, only that every request has them
        engine.proposer.propose = lambda ids: list(ids[:drafts])
    if engine.runner.cpu_decoder is None:
        raise SystemExit("no fused C decoder here (no gcc, or no AVX2)")
    for i in range(batch):
        engine.submit(engine.make_request([(7 * j + 13 * i) % 40000 + 100 for j in range(context)],
                                          SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)))
    if not prefill:
        engine.step()
        engine.step()
    decoder, captured = engine.runner.cpu_decoder, {}
    decode = decoder.decode

    def capture(*a, **k):
        captured["args"] = (a, k)
        return decode(*a, **k)

    decoder.decode = capture
    engine.step()
    decoder.decode = decode
    rows, want = len(captured["args"][0][0]), batch * (context if prefill else drafts + 1)
    if rows != want:
        raise SystemExit(f"the captured step has {rows} rows, not {want}")
    return engine, decoder, captured["args"]


class _SumProbe:
    """A plain read's time for `step_bytes`: torch's float32 sum over 128 MB in huge pages on
    this process's threads (ReadFloor's probe), scaled to the step's bytes."""

    def __init__(self, step_bytes: int, megabytes: int = 128) -> None:
        self.step_bytes = step_bytes
        self.arena = huge_pages.arena(megabytes << 20).view(torch.float32)
        self.arena.fill_(1.0)
        self.arena.sum()

    def times(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.arena.sum()
            out.append((time.perf_counter() - t0) * 1e3 * self.step_bytes / (self.arena.numel() * 4))
        return out


class Native:
    """The `native` workload over the sides (name, checkout root, flags)."""

    def __init__(self, sides: list[Any], o: dict[str, Any], tmp: Path) -> None:
        self.o = o
        self.engines: dict[tuple[str, ...], Any] = {}
        libs: dict[Path, ctypes.CDLL] = {}
        self.sides: dict[str, tuple[tuple[str, ...], ctypes.CDLL]] = {}
        for side in sides:
            key = tuple(side.flags)
            if key not in self.engines:
                self.engines[key] = _captured_step(side.flags, o["batch"], o["context"], o["drafts"], o["prefill"])
            if side.root not in libs:
                libs[side.root] = _decoder_lib(side.root / "ops" / "cpu_kernels", tmp / f"{len(libs)}.so")
            self.sides[side.name] = (key, libs[side.root])
        folder = sides[0].root / "ops" / "cpu_kernels"
        self.bare = _decoder_lib(folder, tmp / "bare.so", ("-DLLMWORKER_SKIP_MATMULS",)) if o["breakdown"] else None
        self.reads = (_decoder_lib(folder, tmp / "reads.so", ("-DLLMWORKER_READ_ONLY_MATMULS",))
                      if o["breakdown"] else None)
        self.probe = _SumProbe(self._weight_bytes(next(iter(self.engines)))) if o["breakdown"] else None
        self.ratios: dict[str, list[float]] = {}
        self.reference: dict[tuple[str, ...], torch.Tensor] = {}
        self.same: dict[str, bool] = {}
        self.kernels = {name: self.engines[key][0].runner.describe_kernels() for name, (key, _) in self.sides.items()}

    def _calls(self, key: tuple[str, ...], lib: ctypes.CDLL, no_head: bool = False) -> tuple[list[float], Any]:
        _, decoder, (a, k) = self.engines[key]
        own, times = decoder._lib, []
        decoder._lib = _Timed(lib, times, no_head)
        try:
            for _ in range(self.o["calls"]):
                hidden, logits = decoder.decode(*a, **k)
        finally:
            decoder._lib = own
        return times, hidden if logits is None else logits  # a prefill's hidden states

    def measure(self, name: str, r: int = 0) -> dict[str, list[float]]:
        key, lib = self.sides[name]
        times, out = self._calls(key, lib)
        first = self.reference.setdefault(key, out.clone())
        self.same[name] = self.same.get(name, True) and bool(torch.equal(out, first))
        metrics = {"call_ms": times}
        if self.bare is not None and name == next(iter(self.sides)):
            metrics["call_ms no LM head"] = self._calls(key, lib, no_head=True)[0]
            metrics["call_ms no matmuls"] = self._calls(key, self.bare)[0]
            metrics["call_ms reads only"] = self._calls(key, self.reads)[0]
            metrics["sum_ms of the weights' bytes"] = self.probe.times(self.o["calls"])
            if r >= 0:  # not a warm-up round
                med = {k: statistics.median(v) for k, v in metrics.items()}
                call, reads, plain = med["call_ms"], med["call_ms reads only"], med["sum_ms of the weights' bytes"]
                for ratio, x in (("call over reads only", call / reads), ("reads only over sum", reads / plain),
                                 ("call over sum", call / plain)):
                    self.ratios.setdefault(ratio, []).append(x)
        return metrics

    def _weight_bytes(self, key: tuple[str, ...]) -> int:
        """The bytes of the records a step's matmuls read (the LM head's included)."""
        model = self.engines[key][0].runner.model
        packed = {m.packed.data_ptr(): m.packed for m in model.modules() if isinstance(m, QuantLinear)}
        return sum(t.numel() * t.element_size() for t in packed.values())

    def report(self) -> dict[str, Any]:
        out = {"same_output": self.same, "kernels": self.kernels, "read_gbps": read_gbps()}
        if self.probe is not None:  # each a round's medians' ratio (the same moment's bandwidth)
            out["breakdown_ratios"] = {k: stats(v) for k, v in self.ratios.items()}
            out["weight_bytes"] = self.probe.step_bytes
        return out


def gguf_weight(name: str) -> QuantizedWeight:
    """The default GGUF's tensor `name` as the file stores it (no row permutation: a
    kernel's speed does not depend on the rows' order)."""
    from gguf import GGUFReader

    for t in GGUFReader(default_model_path()).tensors:
        if t.name == name:
            blocks = np.asarray(t.data)
            return QuantizedWeight(t.tensor_type.name, blocks, (blocks.shape[0], int(t.shape[0])))
    raise SystemExit(f"the default GGUF has no tensor {name!r}")


def random_gguf_weight(qtype: str, shape: str) -> QuantizedWeight:
    """Random blocks of GGUF type `qtype`, shape "NxK" (a kernel's speed depends on its type
    and shape, not on the values)."""
    from benchmarks.gguf_blocks import random_weight
    from ops.quant_records import TYPES

    if qtype not in TYPES:
        raise SystemExit(f"--shape needs --weight to be one of {', '.join(TYPES)}, not {qtype[:40]!r}")
    try:
        n, k = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shape is NxK, e.g. 2048x2048, not {shape[:40]!r}") from None
    return random_weight(qtype, n, k, seed=0)


def _their_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _their_quantized_linear(checkout: Path, tag: str) -> ModuleType:
    """`checkout`'s ops/quantized_linear.py as a module of its own, packing with the same
    checkout's ops/quant_records.py where it has one (what writes the records since they
    moved there); it imports this checkout's `ops.cpu_kernels`, whose API it only uses to
    find and build libraries."""
    records = checkout / "ops" / "quant_records.py"
    if not records.is_file():
        return _their_module(checkout / "ops" / "quantized_linear.py", f"_ab_linear_{tag}")
    ours = sys.modules.get("ops.quant_records")
    sys.modules["ops.quant_records"] = _their_module(records, f"_ab_records_{tag}")
    try:
        return _their_module(checkout / "ops" / "quantized_linear.py", f"_ab_linear_{tag}")
    finally:
        if ours is None:
            del sys.modules["ops.quant_records"]
        else:
            sys.modules["ops.quant_records"] = ours


class _LinearSide:
    """One checkout's records of the weight and its kernel, called through ctypes."""

    def __init__(self, checkout: Path, tag: str, weight: QuantizedWeight, planes: int, build_dir: Path) -> None:
        ql = _their_quantized_linear(checkout, tag)
        self.packed = ql.repack_int8(weight) if planes else ql.repack(weight)
        source = checkout / "ops" / "cpu_kernels" / ("quant_matmul_int8.c" if planes else "quant_matmul.c")
        so = build_dir / f"{tag}.so"
        if not cpu_kernels.build(source, so):
            raise SystemExit(f"cannot build {source}")
        self.fn = getattr(ctypes.CDLL(str(so)), f"{weight.qtype.lower()}{'_i8' if planes else ''}_matmul")
        self.planes = planes
        self.N, self.K = weight.shape

    def __call__(self, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
        args = [ctypes.c_void_p(x.data_ptr()), x.shape[0], self.K, ctypes.c_void_p(self.packed.data_ptr()),
                self.N, ctypes.c_void_p(y.data_ptr()), threads]
        if self.planes:
            args.append(self.planes)
        if self.fn(*args):
            raise RuntimeError("the kernel refused its arguments")


class Linear:
    """The `linear` workload: a side's `--cpu-activations` picks its kernel (int8 planes or float32)."""

    def __init__(self, sides: list[Any], o: dict[str, Any], tmp: Path) -> None:
        if cpu_kernels.isa() is None:
            raise SystemExit("no C kernels here (no gcc, or no AVX2)")
        self.o, self.threads = o, torch.get_num_threads()
        weight = gguf_weight(o["weight"]) if not o.get("shape") else random_gguf_weight(o["weight"], o["shape"])
        self.sides: dict[str, tuple[_LinearSide, torch.Tensor]] = {}
        self.info: dict[str, dict[str, Any]] = {}
        for i, side in enumerate(sides):
            activations = resolve_activations(worker_config(side.flags).model.cpu_activations)
            self.sides[side.name] = (_LinearSide(side.root, f"s{i}", weight, ACTIVATIONS[activations], tmp),
                                     torch.empty(o["rows"], weight.shape[0]))
            self.info[side.name] = {"activations": activations, "packed_bytes": self.sides[side.name][0].packed.numel()}
        torch.manual_seed(0)
        self.x = torch.randn(o["rows"], weight.shape[1])
        self.scrub = torch.ones(64 * 2**20 // 4)
        self.qtype, self.shape = weight.qtype, list(weight.shape)

    def measure(self, name: str, r: int = 0) -> dict[str, list[float]]:
        kernel, y = self.sides[name]
        times = []
        for _ in range(self.o["calls"]):
            self.scrub.add_(1.0)
            t0 = time.perf_counter()
            kernel(self.x, y, self.threads)
            times.append((time.perf_counter() - t0) * 1e3)
        return {"call_ms": times}

    def report(self) -> dict[str, Any]:
        first = next(iter(self.sides.values()))[1]
        return {"qtype": self.qtype, "shape": self.shape, "threads": self.threads, "sides": self.info,
                "same_output": {n: bool(torch.equal(y, first)) for n, (_, y) in self.sides.items()}}

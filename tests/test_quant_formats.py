"""quantization_config detection (worker/weights/quant_config.py) and the checks at load
(worker/weights/hf_quantized.py): formats this worker does not serve are refused naming the
format; bad checkpoints are refused naming the tensor and the format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests import quant_checkpoints as qc
from worker.weights import ModelLoadError, load_model
from worker.weights.quant_config import QuantFormat, UnsupportedQuantization, detect

FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True}}}}


def _ct(**over) -> dict:
    cfg = json.loads(json.dumps(FP8_DYNAMIC))
    group = cfg["config_groups"]["group_0"]
    for key, value in over.items():
        where, _, field = key.partition("__")
        if not field:
            cfg[where] = value
        elif value is None:
            group[where].pop(field, None) if isinstance(group[where], dict) else None
        else:
            group[where][field] = value
    return {"quantization_config": cfg}


def test_no_quantization_config_is_float() -> None:
    assert detect({"architectures": ["LlamaForCausalLM"]}) is None


def test_the_formats_of_the_table() -> None:
    fmt = detect(_ct())
    assert fmt == QuantFormat("compressed-tensors", "ct-float", "fp8", "channel", act="token", ignore=("lm_head",))
    block = detect(_ct(weights__strategy="block", weights__block_structure=[128, 128],
                       input_activations__strategy="group", input_activations__group_size=128))
    assert (block.strategy, block.block, block.act, block.act_group) == ("block", (128, 128), "group", 128)
    native = detect({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}})
    assert native.name == "fp8 FP8 128x128 block weights, dynamic per-group (128) activations"
    fb = detect({"quantization_config": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                         "modules_to_not_convert": ["lm_head"]}})
    assert (fb.act, fb.act_scale_ub, fb.quantizes("lm_head"), fb.quantizes("model.layers.0.mlp.up_proj")) == \
        ("token", 1200.0, False, True)
    awq = detect({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                          "version": "gemm"}})
    assert (awq.kind, awq.group_size, awq.symmetric) == ("int4", 128, False)
    gptq = detect({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
                                           "sym": True}})
    assert gptq.gptq_v1 and gptq.trivial_g_idx_only
    assert fmt.quantizes("model.layers.3.self_attn.q_proj") and not fmt.quantizes("lm_head")
    regex = detect(_ct(ignore=["re:.*down_proj"]))
    assert not regex.quantizes("model.layers.1.mlp.down_proj") and regex.quantizes("model.layers.1.mlp.up_proj")


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
     "nvfp4-pack-quantized.*NVFP4"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "config_groups": {}}, "MXFP4"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4"),
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with 8 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static activation"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    ("not an object", "must be an object"),
])
def test_formats_not_served_are_refused_naming_them(config, match) -> None:
    with pytest.raises(UnsupportedQuantization, match=match):
        detect({"quantization_config": config})


@pytest.mark.parametrize("over, match", [
    (dict(input_activations__dynamic=False), "static activation scales"),
    (dict(weights__num_bits=4), "float 4-bit channel weights"),
    (dict(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity"),
    (dict(input_activations__strategy="tensor"), "dynamic 'tensor' activations"),
])
def test_compressed_tensors_schemes_not_served(over, match) -> None:
    with pytest.raises(UnsupportedQuantization, match=match):
        detect(_ct(**over))


# ----- bad checkpoints, refused at load -----

@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    src = qc.tiny_llama(root / "float")
    return {"fp8": qc.compressed_tensors(root / "fp8", "FP8_DYNAMIC", src),
            "w4": qc.compressed_tensors(root / "w4", "W4A16", src),
            "w8": qc.compressed_tensors(root / "w8", "W8A16", src),
            "block": qc.native_fp8(root / "block", src), "src": src}


def _tampered(made: dict, kind: str, tmp_path: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path / kind
    shutil.copytree(made[kind], out)
    state = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    edit(state, cfg)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


Q = "model.layers.1.self_attn.q_proj"


def _set(name: str, value):
    def edit(state, cfg):
        state[name] = value(state[name]) if callable(value) else value
    return edit


@pytest.mark.parametrize("kind, edit, match", [
    ("fp8", _set(f"{Q}.weight_scale", lambda s: s[:-1]),
     rf"compressed-tensors FP8 per-channel weights, dynamic per-token activations: tensor {Q}.weight_scale has "
     r"shape \(255, 1\); this linear needs \(256, 1\)"),
    ("fp8", _set(f"{Q}.weight_scale", lambda s: s.index_fill(0, torch.tensor([7]), float("nan"))),
     rf"tensor {Q}.weight_scale holds NaN or infinite scales"),
    ("block", _set(f"{Q}.weight_scale_inv", lambda s: s.index_fill(1, torch.tensor([1]), float("inf"))),
     rf"fp8 FP8 128x128 block weights.*tensor {Q}.weight_scale_inv holds NaN or infinite"),
    ("block", _set(f"{Q}.weight_scale_inv", lambda s: s[:, :1]),
     rf"tensor {Q}.weight_scale_inv has shape \(2, 1\); this linear needs \(2, 2\)"),
    ("fp8", _set(f"{Q}.weight", lambda w: w.to(torch.bfloat16)),
     rf"tensor {Q}.weight is bfloat16; this format stores float8_e4m3fn"),
    ("w4", _set(f"{Q}.weight_packed", lambda p: p[:, :-1].contiguous()),
     rf"W4A16 groups of 128, symmetric: tensor {Q}.weight_packed has shape \(256, 31\); this linear needs "
     r"\(256, 32\)"),
    ("w4", lambda state, cfg: cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=96),
     r"W4A16 groups of 96, symmetric: tensor model.layers.0.mlp.down_proj.weight_scale cannot be read: "
     r"group_size 96 does not divide the linear's 512 inputs"),
    ("w8", _set(f"{Q}.weight_packed", lambda p: p[:, :-1].contiguous()),
     rf"W8A16 INT8 groups of 128 weights: tensor {Q}.weight_packed has shape \(256, 63\); this linear needs "
     r"\(256, 64\)"),
    ("w8", _set(f"{Q}.weight_scale", lambda s: s.index_fill(1, torch.tensor([1]), float("nan"))),
     rf"W8A16 INT8 groups of 128 weights: tensor {Q}.weight_scale holds NaN or infinite scales"),
    ("fp8", lambda state, cfg: state.pop(f"{Q}.weight_scale"),
     rf"tensor {Q}.weight_scale is missing"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor_and_the_format(made, tmp_path, kind, edit, match) -> None:
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(_tampered(made, kind, tmp_path, edit)))


def test_a_reordering_g_idx_is_refused(made, tmp_path) -> None:
    """GPTQ's desc_act: a g_idx that is not k // group_size reorders the inputs."""
    def edit(state, cfg):
        perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
        state[f"{Q}.weight_g_idx"] = (perm // 128).to(torch.int32)
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"

    with pytest.raises(ModelLoadError, match=rf"tensor {Q}.weight_g_idx reorders the inputs"):
        load_model(str(_tampered(made, "w4", tmp_path, edit)))

    def trivial(state, cfg):
        state[f"{Q}.weight_g_idx"] = (torch.arange(256) // 128).to(torch.int32)

    assert load_model(str(_tampered(made, "w4", tmp_path / "ok", trivial))).quantization is not None


def test_bad_patterns_are_refused() -> None:
    with pytest.raises(UnsupportedQuantization, match=r"ignore entry 're:\(' is not a regular expression"):
        detect(_ct(ignore=["re:("]))
    with pytest.raises(UnsupportedQuantization, match="targets must be a list of module names"):
        detect(_ct(**{"config_groups": {"g": {**FP8_DYNAMIC["config_groups"]["group_0"], "targets": "Linear"}}}))


def test_kv_cache_scales_from_the_checkpoint(made, tmp_path) -> None:
    """A compressed-tensors kv_cache_scheme: each layer's k_scale / v_scale go to its
    attention (for --kv-cache-dtype fp8); bad ones are refused naming the tensor."""
    def edit(state, cfg):
        cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
        for i in range(2):
            state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25 + i)
            state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.5 + i])

    loaded = load_model(str(_tampered(made, "fp8", tmp_path, edit)))
    attn = [layer.self_attn for layer in loaded.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [(0.25, 0.5), (1.25, 1.5)]

    def bad(state, cfg):
        edit(state, cfg)
        state["model.layers.1.self_attn.v_scale"] = torch.tensor(float("nan"))

    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.1\.self_attn\.v_scale must be one positive finite"):
        load_model(str(_tampered(made, "fp8", tmp_path / "bad", bad)))

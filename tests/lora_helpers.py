"""Random PEFT LoRA adapters for the default model, made and saved by peft itself."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# (rank, target_modules, use_rslora) of the adapters the tests make: ranks 8 and 16,
# attention only, MLP only, everything, a subset of q/k/v (a fused layer adapted in part).
SPECS: list[tuple[int, list[str], bool]] = [
    (8, ["q_proj", "v_proj"], False),
    (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    (16, ["gate_proj", "down_proj"], True),
    (8, ["k_proj", "o_proj", "up_proj"], False),
]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Scale of the random B matrices: enough to change greedy tokens, not to wreck the model.
B_SCALE = 0.15


def hf_base_model(hf_model):
    """A private copy (peft wraps it) of transformers' own load of the default GGUF, float32:
    the session's `hf_model` copied, not loaded again (each load took ~30 s)."""
    model = copy.deepcopy(hf_model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # a GGUF-loaded model refuses save_pretrained
    return model.eval()


@torch.no_grad()
def make_adapters(base, folder: Path, specs: list[tuple[int, list[str], bool]], seed: int = 0):
    """A PeftModel over `base` holding one random adapter per spec, named a0, a1, ...; each
    saved with save_pretrained under folder/<name>. Returns (peft model, {name: path})."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = None
    paths: dict[str, Path] = {}
    for i, (rank, targets, rslora) in enumerate(specs):
        name = f"a{i}"
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                         use_rslora=rslora, init_lora_weights=False)
        if peft_model is None:
            peft_model = get_peft_model(base, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
        for module_name, p in peft_model.named_parameters():
            if f"lora_B.{name}." in module_name:
                p.mul_(B_SCALE)
        paths[name] = folder / name
    assert peft_model is not None
    peft_model.save_pretrained(str(folder))  # one subfolder per adapter name
    peft_model.eval()
    return peft_model, paths


@torch.inference_mode()
def our_last_logits(engine, name: str | None, ids: list[int], block_size: int = 16,
                    fused: bool = False) -> torch.Tensor:
    """Our model's last-position logits for one prompt, through the engine's runner (its
    linears, its LoRA slots) with adapter `name` (None: the base model): op by op, or
    through the runner's fused CPU decoder when `fused` (LoRA in its C layers)."""
    from worker.models.llama import AttentionMetadata

    runner = engine.runner
    model = runner.model
    cfg = model.config
    adapter = engine.loras.acquire(engine.loras.key(name)) if name else None
    try:
        lora = None
        if adapter is not None:
            slot = runner.lora.assign([adapter])[adapter.uid]
            lora = runner.lora.step([slot] * len(ids))
        n = len(ids)
        nblk = (n + block_size - 1) // block_size
        kv = [(torch.zeros(nblk, block_size, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(nblk, block_size, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.arange(nblk, dtype=torch.int32)[None],
            seq_lens=torch.tensor([n]), query_start_loc=torch.tensor([0, n]), max_query_len=n,
            max_seq_len=n, lora=lora)
        forward = runner.cpu_decoder if fused else model
        assert forward is not None, "no fused decoder in this runner"
        hidden = forward(torch.tensor(ids), torch.arange(n), meta, kv)
        return model.compute_logits(hidden[-1:])[0]
    finally:
        if adapter is not None:
            engine.loras.release(adapter)


@torch.inference_mode()
def peft_last_logits(peft_model, name: str | None, ids: list[int]) -> torch.Tensor:
    if name is None:
        with peft_model.disable_adapter():
            return peft_model(torch.tensor([ids])).logits[0, -1].float()
    peft_model.set_adapter(name)
    return peft_model(torch.tensor([ids])).logits[0, -1].float()


@torch.inference_mode()
def peft_greedy(peft_model, name: str | None, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers + peft greedy continuation under adapter `name` (None: the base)."""
    from tests.helpers import hf_greedy

    if name is None:
        with peft_model.disable_adapter():
            return hf_greedy(peft_model, ids, max_new_tokens)
    peft_model.set_adapter(name)
    return hf_greedy(peft_model, ids, max_new_tokens)

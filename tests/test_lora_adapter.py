"""LoRA adapters as files and as host-memory state: bad folders give clear errors naming the
problem, the registry's LRU and reference counts, the device slots, the gathered op against
a per-row loop, the prefix-cache key, the scheduler's --max-loras cap, and the flags."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvcache.block_hash import hash_block
from kvcache.manager import KVCacheManager
from ops.lora import LoraRows, lora_add_ref
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from worker.config import LoraConfig
from worker.lora.adapter import LoraAdapterError, load_adapter, module_shapes
from worker.lora.registry import LoraInUseError, LoraRegistry, UnknownLoraError
from worker.lora.slots import LoraSlots
from worker.models.llama import LlamaConfig

CFG = LlamaConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                  rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True)
PREFIX = "base_model.model.model.layers"


def write_adapter(folder: Path, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                  seed: int = 0, **config) -> Path:
    """A PEFT-format adapter for CFG, named as peft's save_pretrained names its tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(CFG)
    tensors = {}
    for layer in range(CFG.num_layers):
        for proj in targets:
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            n_in, n_out = shapes[proj]
            tensors[f"{PREFIX}.{layer}.{block}.{proj}.lora_A.weight"] = torch.randn(rank, n_in, generator=g)
            tensors[f"{PREFIX}.{layer}.{block}.{proj}.lora_B.weight"] = torch.randn(n_out, rank, generator=g)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
           "use_rslora": False, "bias": "none", "use_dora": False, **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


# ----- bad files: clear errors -----

def test_a_good_adapter_loads(tmp_path) -> None:
    a = load_adapter("x", write_adapter(tmp_path / "x"), CFG, max_rank=16)
    assert a.rank == 4 and a.scale == 2.0 and len(a.weights) == 2 * CFG.num_layers
    rs = load_adapter("y", write_adapter(tmp_path / "y", rank=16, use_rslora=True), CFG, 16)
    assert rs.scale == pytest.approx(32 / 4)  # alpha / sqrt(r)


def _tamper(path: Path, drop: str | None = None, reshape: str | None = None) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:, :-1].contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize(("case", "message"), [
    ("missing key", r"missing tensor base_model\.model\.model\.layers\.1\.self_attn\.v_proj\.lora_B\.weight"),
    ("wrong shape", r"layers\.0\.self_attn\.q_proj\.lora_A\.weight has shape \(4, 31\); rank 4 .* needs \(4, 32\)"),
    ("rank too high", r"rank 32 exceeds --max-lora-rank 16"),
    ("pickle only", r"only adapter_model\.bin \(a pickle, which this worker never loads\)"),
    ("no config", r"no adapter_config\.json"),
    ("dora", r"use_dora=True is not supported"),
    ("unknown module", r"target_modules lm_head not supported"),
    ("not safetensors", r"not a valid safetensors file"),
    ("extra layer", r"layer 7, the base model has 2"),
    # each of these escaped as its own exception before (UNKNOWN, with a traceback, session 27)
    ("name too long", r"cannot be read: File name too long"),
    ("path too long", r"the path is 5005 characters; at most 4096"),
    ("config nested too deep", r"adapter_config\.json is not JSON \(maximum recursion depth"),
    ("bad regex", r"target_modules '\(q_proj' is not a regex"),
    ("alpha past float", r"lora_alpha must be a finite number"),
    ("nan weights", r"layers\.1\.mlp\.up_proj\.lora_B\.weight holds NaN or infinite values"),
])
def test_bad_adapters_are_clear_errors(tmp_path, case: str, message: str) -> None:
    path = write_adapter(tmp_path / "a", rank=32 if case == "rank too high" else 4)
    if case == "missing key":
        _tamper(path, drop=f"{PREFIX}.1.self_attn.v_proj.lora_B.weight")
    elif case == "wrong shape":
        _tamper(path, reshape=f"{PREFIX}.0.self_attn.q_proj.lora_A.weight")
    elif case == "pickle only":
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    elif case == "no config":
        (path / "adapter_config.json").unlink()
    elif case == "dora":
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    elif case == "unknown module":
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_head"]}))
    elif case == "not safetensors":
        (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    elif case == "extra layer":
        from safetensors.torch import load_file
        t = load_file(str(path / "adapter_model.safetensors"))
        t[f"{PREFIX}.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 32)
        save_file(t, str(path / "adapter_model.safetensors"))
    elif case == "name too long":
        path = path / ("x" * 300)
    elif case == "path too long":
        path = Path("/" + "a" * 5004)
    elif case == "config nested too deep":
        (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif case in ("bad regex", "alpha past float"):
        cfg = json.loads((path / "adapter_config.json").read_text())
        change = {"target_modules": "(q_proj"} if case == "bad regex" else {"lora_alpha": 10**400}
        (path / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    elif case == "nan weights":
        write_adapter(path, targets=("q_proj", "up_proj"))
        from safetensors.torch import load_file
        t = load_file(str(path / "adapter_model.safetensors"))
        t[f"{PREFIX}.1.mlp.up_proj.lora_B.weight"][3, 1] = float("nan")
        save_file(t, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match=message) as e:
        load_adapter("a", path, CFG, max_rank=16)
    assert len(str(e.value)) < 600


# ----- the registry: names, LRU in host memory, reference counts -----

def test_registry_lru_refcounts_and_unload(tmp_path) -> None:
    reg = LoraRegistry(CFG, max_lora_rank=16, max_cpu_loras=2)
    for i in range(3):
        reg.load(f"a{i}", str(write_adapter(tmp_path / f"a{i}", seed=i)))
    resident = {i.name for i in reg.infos() if i.resident}
    assert resident == {"a1", "a2"}  # a0, least recently used, was dropped from host memory
    with pytest.raises(UnknownLoraError, match=r"unknown LoRA adapter 'nope' \(loaded: a0, a1, a2\)"):
        reg.key("nope")
    loads = reg.num_loads
    a0 = reg.acquire(reg.key("a0"))  # read again from disk
    assert reg.num_loads == loads + 1
    a1 = reg.acquire(reg.key("a1"))
    assert {i.name for i in reg.infos() if i.resident} == {"a0", "a1"}
    a2 = reg.acquire(reg.key("a2"))  # three in use, limit two: none dropped under a request
    assert all(i.resident for i in reg.infos())
    with pytest.raises(LoraInUseError, match=r"'a1' is in use by 1 request"):
        reg.unload("a1")
    gone = weakref.ref(a1)
    reg.release(a1)
    del a1
    reg.release(a0)
    gc.collect()
    assert gone() is None, "an idle adapter past --max-cpu-loras kept its tensors"
    assert {i.name for i in reg.infos() if i.resident} == {"a0", "a2"}
    reg.release(a2)
    key = reg.key("a2")
    reg.unload("a2")
    with pytest.raises(UnknownLoraError):
        reg.acquire(key)
    reg.load("a2", str(write_adapter(tmp_path / "other", seed=9)))
    assert reg.key("a2") != key  # a new registration: never shares the old one's KV blocks
    with pytest.raises(ValueError, match="already loaded"):
        reg.load("a2", str(tmp_path / "other"))
    assert [i.num_requests for i in reg.infos()] == [1, 1, 0]


# ----- the op and the slots -----

def test_gathered_lora_equals_a_loop_over_rows() -> None:
    """Rows of 3 adapters and the base, shuffled, rank 4 padded to 8 slots wide, a fused
    layer of 2 slices: the one gathered computation equals each row's own delta, base rows
    untouched to the bit."""
    torch.manual_seed(0)
    slots, r, n_in, outs = 4, 8, 24, (16, 8)
    a = torch.randn(slots, 2 * r, n_in)
    bs = [torch.randn(slots, o, r) for o in outs]
    a[:, 4:8] = 0  # rank 4 in slice 0: its padding rows are zeros
    token_slots = [2, -1, 0, 2, 2, -1, 3, 0]
    x = torch.randn(len(token_slots), n_in)
    y0 = torch.randn(len(token_slots), sum(outs))
    for which in (token_slots, [s if s != 3 else 1 for s in token_slots]):  # all slots, or some
        rows = LoraRows.build(which, slots, torch.device("cpu"))
        assert rows is not None and (rows.slots is None) == (sorted(set(which) - {-1}) == [0, 1, 2, 3])
        got = lora_add_ref(y0.clone(), x, a, bs, rows)
        for t, s in enumerate(which):
            if s < 0:
                assert torch.equal(got[t], y0[t])
                continue
            want = torch.cat([x[t] @ a[s, i * r:(i + 1) * r].T @ b[s].T for i, b in enumerate(bs)])
            torch.testing.assert_close(got[t], y0[t] + want, rtol=1e-5, atol=1e-5)
    assert LoraRows.build([-1, -1], slots, torch.device("cpu")) is None


def test_slots_keep_resident_adapters_and_zero_what_is_not_targeted(tmp_path) -> None:
    reg = LoraRegistry(CFG, 16, 4)
    for i, targets in enumerate([("q_proj", "v_proj"), ("gate_proj", "down_proj"), ("o_proj",)]):
        reg.load(f"a{i}", str(write_adapter(tmp_path / f"a{i}", seed=i, targets=targets)))
    ads = [reg.acquire(reg.key(f"a{i}")) for i in range(3)]
    slots = LoraSlots(CFG, max_loras=2, max_rank=8, device=torch.device("cpu"), dtype=torch.float32)
    first = slots.assign(ads[:2])
    assert slots.num_writes == 2 and sorted(first.values()) == [0, 1]
    assert slots.assign(ads[1:2]) == {ads[1].uid: first[ads[1].uid]} and slots.num_writes == 2
    third = slots.assign([ads[1], ads[2]])  # a2 takes a0's slot, a1 stays put
    assert third[ads[1].uid] == first[ads[1].uid] and third[ads[2].uid] == first[ads[0].uid]
    s = third[ads[2].uid]
    qkv = slots.layers[0]["qkv_proj"]
    assert not qkv.a[s].any() and not any(b[s].any() for b in qkv.bs)  # a2 targets o_proj only
    a_w, b_w = ads[2].weights[0, "o_proj"]
    o = slots.layers[0]["o_proj"]
    assert torch.equal(o.a[s, :4], a_w) and not o.a[s, 4:].any()
    torch.testing.assert_close(o.bs[0][s, :, :4], b_w * ads[2].scale)


# ----- prefix cache and scheduler -----

def test_block_hash_keys_by_adapter() -> None:
    root, toks = bytes(32), list(range(16))
    base = hash_block(root, toks)
    assert hash_block(root, toks, lora_key=None) == base  # base-model hashes unchanged
    assert hash_block(root, toks, lora_key="a#1") == hash_block(root, toks, lora_key="a#1")
    assert len({base, hash_block(root, toks, lora_key="a#1"), hash_block(root, toks, lora_key="b#2"),
                hash_block(root, toks, "salt", "a#1"), hash_block(root, toks, "salt")}) == 5


def test_scheduler_caps_adapters_per_step_fcfs_without_starving() -> None:
    """max_loras 2, adapters arriving a, b, c, a, b...: c waits until a or b has no running
    request, and nothing behind c is admitted meanwhile (FCFS, so c cannot starve)."""
    kv = KVCacheManager(num_blocks=256, block_size=4)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64,
                      max_loras=2)
    keys = ["a", "b", "c", "a", None, "b"]
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2 + 4 * (k == "a")),
                    lora_key=k, arrival_time=float(i)) for i, k in enumerate(keys)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule(now=10.0)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]  # c blocks; r3..r5 wait behind
    admitted_at: dict[str, int] = {}
    for step in range(20):
        for s in out.scheduled:
            admitted_at.setdefault(s.request_id, step)
        assert len({s.request.lora_key for s in out.scheduled} - {None}) <= 2
        if not out.scheduled:
            break
        sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.will_sample})
        out = sched.schedule(now=11.0 + step)
    assert set(admitted_at) == {r.request_id for r in reqs}
    assert admitted_at["r2"] <= min(admitted_at[f"r{i}"] for i in (3, 4, 5))
    assert not sched.has_unfinished_requests()


# ----- configuration -----

def test_lora_flags_and_variables(monkeypatch) -> None:
    import argparse

    from worker.config import add_arguments, from_args

    monkeypatch.setenv("LLMWORKER_MAX_LORAS", "4")
    monkeypatch.setenv("LLMWORKER_LORA_MODULES", "a=/x b=/y")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = parser.format_help()
    for flag in ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
                 "LLMWORKER_MAX_CPU_LORAS"):
        assert flag in help_text
    conf = from_args(parser.parse_args(["--enable-lora", "--max-lora-rank", "8"]))
    assert conf.lora == LoraConfig(enable_lora=True, lora_modules=("a=/x", "b=/y"), max_loras=4,
                                   max_lora_rank=8)
    conf = from_args(parser.parse_args(["--enable-lora", "--lora-modules", "c=/z", "d=/w"]))
    assert conf.lora.lora_modules == ("c=/z", "d=/w") and conf.lora.cpu_loras == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "nopath"])
    with pytest.raises(ValueError, match=r"--max-cpu-loras .* must be >= --max-loras"):
        LoraConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_a_step_skips_linears_its_adapters_do_not_target(tmp_path) -> None:
    reg = LoraRegistry(CFG, 16, 4)
    reg.load("attn", str(write_adapter(tmp_path / "attn", targets=("q_proj",))))
    reg.load("mlp", str(write_adapter(tmp_path / "mlp", targets=("down_proj",), seed=1)))
    attn, mlp = (reg.acquire(reg.key(n)) for n in ("attn", "mlp"))
    slots = LoraSlots(CFG, max_loras=2, max_rank=4, device=torch.device("cpu"), dtype=torch.float32)
    slot_of = slots.assign([attn, mlp])
    step = slots.step([slot_of[attn.uid], -1])
    assert step is not None and set(step.layers[0]) == {"qkv_proj"}
    step = slots.step([slot_of[mlp.uid], slot_of[attn.uid]])
    assert step is not None and set(step.layers[1]) == {"qkv_proj", "down_proj"}


def test_the_request_span_names_its_adapter() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from worker import telemetry

    exp = InMemorySpanExporter()
    assert telemetry.configure_tracing(exporter=exp)
    try:
        for lora in ("sql-tuned", None):
            telemetry.GenerationTrace("m", "r", max_tokens=1, temperature=None, top_p=None,
                                      top_k=None, lora_name=lora).finish("stop", 1, 1)
        tuned, base = exp.get_finished_spans()
        assert tuned.attributes["llm_worker.request.lora_name"] == "sql-tuned"
        assert "llm_worker.request.lora_name" not in base.attributes
    finally:
        telemetry.shutdown_tracing()

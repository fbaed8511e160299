"""A tensor-parallel follower: `python -m worker.parallel.follower`, started by rank 0
(leader.py) with its spec in LLMWORKER_TP_FOLLOWER. It loads the same model, keeps its
shard (its heads, MLP slice and vocabulary rows), allocates its KV cache (its heads only;
rank 0's block count) and, with
--enable-lora, its adapter slots (filled by rank 0's LORA messages), says `loaded`, joins
the group, and then runs each step rank 0 sends until STOP. It exits at once when rank 0
dies (its stdin pipe ends) and exits 1 when a step fails: rank 0's next collective then
fails too, and the worker stops.

For tests, LLMWORKER_TP_TEST_FAULT makes one rank fail: "R:load" (its load raises) or
"R:step:N" (its N-th step raises).
"""

from __future__ import annotations

import json
import os
import sys
import threading

FAULT_ENV = "LLMWORKER_TP_TEST_FAULT"


def _watch_parent() -> None:
    """Exit as soon as rank 0 is gone: its end of our stdin closes (even on SIGKILL)."""
    def read() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=read, name="parent-watch", daemon=True).start()


def _fault(rank: int) -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV, "")
    parts = spec.split(":")
    if not spec or parts[0] != str(rank):
        return None
    return parts[1], int(parts[2]) if len(parts) > 2 else 0


def main() -> int:
    _watch_parent()
    spec = json.loads(os.environ["LLMWORKER_TP_FOLLOWER"])
    rank = int(spec["rank"])
    fault = _fault(rank)
    try:
        import torch

        from worker.parallel import lora as tp_lora
        from worker.parallel import messages
        from worker.parallel.group import Collectives

        collectives = Collectives()
        runner, model_cfg = _load(spec, fault, collectives)
    except Exception as e:  # the load's error goes to rank 0, which exits with it
        line = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {line}", flush=True)
        return 1
    print("loaded", flush=True)
    collectives.join(rank, int(spec["world"]), int(spec["port"]), runner.device, float(spec["timeout_s"]))
    steps = 0
    try:
        while True:
            head = collectives.receive_header()
            n = messages.payload_len(head)
            if int(head[0]) == messages.STOP:
                return 0
            if int(head[0]) == messages.LORA:  # an adapter for a slot (worker/parallel/lora.py)
                slot, adapter = tp_lora.unpack(head, collectives.receive_payload(n, torch.float32), model_cfg)
                if runner.lora is None:
                    raise ValueError("a LoRA adapter sent to a rank started without --enable-lora")
                runner.lora.write(slot, adapter)
                continue
            payload = collectives.receive_payload(n)
            if int(head[0]) == messages.MOVES:
                runner.move_blocks(messages.unpack_moves(head, payload))
                continue
            steps += 1
            if fault is not None and fault == ("step", steps):
                raise RuntimeError(f"injected fault in rank {rank}'s step {steps} ({FAULT_ENV})")
            _forward(runner, messages.unpack_forward(head, payload))
    except Exception as e:  # any failure ends this rank; rank 0 sees the group break
        print(f"llm-worker tensor parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def _load(spec: dict, fault: tuple[str, int] | None, collectives):
    import torch

    import ops
    from worker.config import ModelConfig
    from worker.engine import resolve_dtype
    from worker.model_runner import ModelRunner
    from worker.parallel.leader import rank_device
    from worker.parallel.shard import ShardPlan, shard_model
    from worker.weights import load_model

    rank, world = int(spec["rank"]), int(spec["world"])
    mc = ModelConfig(**spec["model"])
    if spec["threads"]:
        torch.set_num_threads(int(spec["threads"]))
    base = torch.device("cuda" if mc.device == "auto" and torch.cuda.is_available() else
                        ("cpu" if mc.device == "auto" else mc.device))
    device = rank_device(base, rank)
    if fault is not None and fault[0] == "load":
        raise ValueError(f"injected load failure on rank {rank} ({FAULT_ENV})")
    loaded = load_model(mc.model, device, resolve_dtype(mc.dtype, device), mc.cpu_quantized_linear,
                        mc.cpu_activations, (world, rank))
    plan = ShardPlan.of(loaded.config, world)
    shard_model(loaded.model, plan, rank, collectives.all_reduce, collectives.gather,
                sliced=loaded.split is not None)
    # What this rank holds (its slices, on the file's blocks where TP = 1's are), on rank 0's stderr.
    print(f"tensor parallel rank {rank}: {loaded.describe_weights()}", file=sys.stderr, flush=True)
    ops.set_backend(mc.kernels)
    lora = None
    if spec["lora"] is not None:  # its slots: this rank's share of what rank 0 writes
        from worker.lora.slots import LoraSlots

        max_loras, max_rank = spec["lora"]
        lora = LoraSlots(loaded.model.config, int(max_loras), int(max_rank), device, loaded.dtype,
                         plan.lora_slicer(rank))
    runner = ModelRunner(loaded.model, int(spec["num_blocks"]), int(spec["block_size"]), device,
                         loaded.dtype, kv_dtype=getattr(torch, spec["kv_dtype"]),
                         num_cpu_blocks=int(spec["num_cpu_blocks"]),
                         cpu_packed_linear=mc.cpu_packed_linear, lora=lora)
    return runner, loaded.config


def _forward(runner, a) -> None:
    """The step's layers, then its logits passes: this rank's slice of each, gathered by
    rank 0 (the result here is dropped)."""
    import torch

    from worker.models.llama import AttentionMetadata

    with torch.inference_mode():
        meta = AttentionMetadata(
            slot_mapping=runner._host(a.slot_mapping), block_tables=runner._host(a.block_tables),
            seq_lens=runner._host(a.seq_lens), query_start_loc=runner._host(a.query_start_loc),
            max_query_len=a.max_query_len, max_seq_len=a.max_seq_len,
            lora=None if a.lora_slots is None else runner.lora.step(a.lora_slots.tolist()))
        hidden = runner.model(runner._host(a.input_ids), runner._host(a.positions), meta, runner.kv_caches)
        for rows in a.logits:
            runner.model.compute_logits(hidden.index_select(0, runner._host(rows)))


if __name__ == "__main__":
    sys.exit(main())

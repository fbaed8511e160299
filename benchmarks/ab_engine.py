"""The engine's workloads of `benchmarks.ab` (step, prefill, offline), for one side.

In the A/B tool's own process (sides that are settings of this checkout) or as a warm child
process of a side's checkout (its code first on the path), run as

    python -c "import runpy; runpy.run_path('benchmarks/ab_engine.py', run_name='__main__')" JSON

from the side's root: it loads the model, says `AB READY`, then answers each line of stdin
(one measurement's JSON) with `AB {metrics}`. So this file imports only what every checkout
of the engine has had since issue 18 (`worker.config`'s flags, `Engine.make_request`,
`submit`, `step`, `generate`), and nothing of `benchmarks/`, which in a child is the
other checkout's.

A side's settings are `llm-worker serve` flags (`--kv-cache-dtype float16`), read by the
side's own `worker.config`; a workload then sets what it must control itself (the batch,
the token budget, the KV cache's size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any


def worker_config(flags: list[str], **overrides: dict[str, Any]) -> Any:
    """`llm-worker serve FLAGS` as a WorkerConfig, then `overrides` ({section: {field: value}})."""
    from worker import config as cfgmod

    parser = argparse.ArgumentParser()
    cfgmod.add_arguments(parser)
    conf = cfgmod.from_args(parser.parse_args(flags))
    return dataclasses.replace(conf, **{section: dataclasses.replace(getattr(conf, section), **fields)
                                        for section, fields in overrides.items()})


class EngineSide:
    """One side's engines (one per shape a workload asks for), over one loaded model."""

    def __init__(self, model: str, flags: list[str], threads: int = 0, loaded: Any = None) -> None:
        import torch

        from worker.weights import load_model

        if threads:
            torch.set_num_threads(threads)
        self.flags = flags
        self.loaded = loaded or load_model(model)
        self.engines: dict[tuple, Any] = {}
        self.kernels = ""
        self.n = 0  # measurements so far: keeps prompts distinct from one to the next

    def engine(self, seqs: int, budget: int, max_len: int = 0) -> Any:
        from worker.engine import Engine

        key = (seqs, budget, max_len)
        if key not in self.engines:
            model = {"max_model_len": max_len} if max_len else {}
            conf = worker_config(self.flags, model=model, cache={"kv_cache_memory": 0.5},
                                 scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": budget})
            self.engines[key] = Engine(conf, loaded=self.loaded)
            self.kernels = self.engines[key].runner.describe_kernels()
        return self.engines[key]

    def prompt(self, length: int, i: int) -> list[int]:
        return [(7 * j + 13 * i + 1009 * self.n) % 40000 + 100 for j in range(length)]

    def measure(self, workload: str, o: dict[str, Any]) -> dict[str, list[float]]:
        from scheduler.request import SamplingParams

        self.n += 1
        out: dict[str, list[float]] = {}
        if workload == "step":
            for b in o["batch_sizes"]:
                e = self.engine(b, max(8192, b * o["context"]))
                params = SamplingParams(**{"temperature": 0, **o["sampling"]}, max_tokens=o["steps"] + 4,
                                        ignore_eos=True)
                reqs = [e.make_request(self.prompt(o["context"], i), params) for i in range(b)]
                for r in reqs:
                    e.submit(r)
                e.step()  # the prefill
                e.step()
                times = []
                for _ in range(o["steps"]):
                    t0 = time.perf_counter()
                    e.step()
                    times.append((time.perf_counter() - t0) * 1e3)
                e.abort([r.request_id for r in reqs])
                while e.has_work():
                    e.step()
                out[f"step_ms b={b}"] = times
                out[f"decode_tok_s b={b}"] = [b * 1e3 / t for t in times]
        elif workload == "prefill":  # each prompt whole in one step, one output token
            for p in o["prompts"]:
                e = self.engine(1, p, max_len=p + 16)
                params = SamplingParams(temperature=0, max_tokens=1,
                                        prompt_logprobs=o["prompt_logprobs"] or None)
                req = e.make_request(self.prompt(p, 0), params)
                t0 = time.perf_counter()
                e.generate([req])
                out[f"prefill_s p={p}"] = [time.perf_counter() - t0]
        elif workload == "offline":  # Engine.generate of the whole set, as `llm-worker generate`
            e = self.engine(o["max_num_seqs"], 512)
            params = SamplingParams(temperature=0, max_tokens=o["max_tokens"], ignore_eos=True)
            reqs = [e.make_request(self.prompt(o["context"], i), params) for i in range(o["num_requests"])]
            t0 = time.perf_counter()
            done = e.generate(reqs)
            wall = time.perf_counter() - t0
            out["output_tok_s"] = [sum(len(c.token_ids) for c in done) / wall]
        else:
            raise ValueError(f"unknown engine workload {workload!r}")
        return out


def child_main() -> None:
    """A side in a process of its own: the protocol in the module's docstring."""
    setup = json.loads(sys.argv[1])
    side = EngineSide(setup["model"], setup["flags"], setup["threads"])
    print("AB READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        work = json.loads(line)
        result = side.measure(work["workload"], work["options"])
        print("AB " + json.dumps({"metrics": result, "kernels": side.kernels}), flush=True)


if __name__ == "__main__":
    child_main()

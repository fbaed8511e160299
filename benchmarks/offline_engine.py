"""The offline side of `benchmarks.served_vs_offline`, in a process of its own, as
`llm-worker generate` runs the engine:

    python -m benchmarks.offline_engine '{"model": "default"}'   # ModelConfig fields (JSON)

The process takes `llm-worker generate`'s process settings before torch loads (the OpenMP
wait policy: worker.openmp_env), loads the model, and answers on stdout: first one JSON
line with the prompt's tokens, the kernels and the OpenMP wait policy; then, for each line
on stdin (a round's ``max_tokens``), one greedy chat request decoded by `Engine.generate`
and a JSON line with the output's arrival times and token counts. An empty line or end of
input ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from benchmarks.stream_client import PROMPT, answer_rounds
from worker import openmp_env


def offline_round(engine: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One request through `engine.generate`: each output's arrival time and token count
    (the first time is the request's start), as `stream_client.stream_round` gives them."""
    from scheduler.request import SamplingParams

    req = engine.make_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                  ignore_eos=True))
    times, counts = [time.perf_counter()], [0]

    def on_output(outs: list[Any]) -> None:
        n = sum(len(o.new_token_ids) for o in outs)
        if n:
            times.append(time.perf_counter())
            counts.append(n)

    (done,) = engine.generate([req], on_output=on_output)
    assert len(done.token_ids) == max_tokens, len(done.token_ids)
    return {"times": times, "counts": counts}


def main() -> None:
    fields = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    from worker.config import CacheConfig, ModelConfig, WorkerConfig

    model = ModelConfig(**fields)
    openmp_env.set_default_wait_policy(model.kernels, model.device)  # as the CLI does
    import torch

    from worker.engine import Engine
    from worker.weights import load_model

    loaded = load_model(model.model, "cpu", torch.float32)
    engine = Engine(WorkerConfig(model=model, cache=CacheConfig(enable_prefix_caching=False)),
                    loaded=loaded)
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    offline_round(engine, ids, 8)  # warm-up
    print(json.dumps({"prompt_tokens": len(ids), "kernels": engine.runner.describe_kernels(),
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}), flush=True)
    answer_rounds(lambda max_tokens: offline_round(engine, ids, max_tokens))


if __name__ == "__main__":
    main()

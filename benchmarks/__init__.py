"""In-process benchmarks and harness pieces: they import the engine (worker/, scheduler/,
kvcache/, ops/) and run it in this process, unlike `clients/`, which speaks only the wire.

    python -m benchmarks.ab WORKLOAD --side NAME=PATH[,...]   # the A/B tool: checkouts or settings
    python -m benchmarks.offline      # offline throughput: continuous vs static vs transformers
    python -m benchmarks.step         # decode step time against batch size, CPU kernel variants
    python -m benchmarks.scheduling   # priority and prefix-caching figures on the engine
    python -m benchmarks.cpu_ops      # CPU linear-layer and KV-gather measurements
    python -m benchmarks.gpu          # GPU copy bandwidth, attention kernel, decode step
    python -m benchmarks.peer         # transformers static batching (llm-worker-bench --peer)
    python -m benchmarks.faulty_worker TRIGGER_FILE [serve flags]   # the fault scenario's worker

Every JSON they write carries the environment (`clients.bench.environment`: date, CPU,
commit, the command relative to the repo root) and the engine's configuration.
"""

"""``llm-worker-bench``: a load generator and latency-throughput benchmark (cli.py).

One concept a file: datasets (lengths.py, chat.py, dataset.py), arrivals (arrival.py),
backends (backend_grpc.py; backend_openai.py on http.py and sse.py), what a request did
(record.py), the metrics (metrics.py), a run and a sweep (runner.py, knee.py, plot.py),
the transformers peer (peer.py, which runs `python -m benchmarks.peer` as a child process),
the model's tokenizer fetched over the wire (tokenizer.py), where it ran (environment.py),
markdown from results (report.py) and the command line (args.py, cli.py). Speaks the wire
only: it imports nothing of the worker, scheduler, kvcache or ops.
"""

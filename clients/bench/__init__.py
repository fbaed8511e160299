"""``llm-worker-bench``: a load generator and latency-throughput benchmark (cli.py).

One concept a file: datasets (lengths.py, chat.py, dataset.py), arrivals (arrival.py),
backends (backend_grpc.py; backend_openai.py on http.py and sse.py), what a request did
(record.py), the metrics (metrics.py), a run and a sweep (runner.py, knee.py, plot.py),
the transformers peer (peer.py, peer_transformers.py), where it ran (environment.py),
markdown from results (report.py) and the command line (args.py, cli.py). Imports the
worker only for the peer and to render chats or ids as text client-side (tokenizer.py).
"""

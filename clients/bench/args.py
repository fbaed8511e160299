"""The command line of ``llm-worker-bench``: subcommands ``run`` (the default) and ``report``,
every option with its default in its help, and the checks argparse cannot express."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from clients.bench import dataset as ds
from clients.bench import vllm_result as vr
from clients.bench.knee import DEFAULT_FACTOR
from clients.bench.lengths import LengthDist, parse_lengths
from clients.bench.metrics import parse_slo
from clients.bench.peer import PEERS

SUBCOMMANDS = ("run", "report")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma list of rates: {text!r}") from e
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError("rates must be > 0 (inf: all at once)")
    return sorted(rates)


def _lengths(text: str) -> LengthDist:
    try:
        return parse_lengths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _slo(text: str) -> dict[str, float]:
    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _percentile_metrics(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in vr.PERCENTILE_METRICS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"not metrics: {', '.join(bad)[:80] or text[:80]!r}; use {','.join(vr.PERCENTILE_METRICS)}")
    return names


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma list of percentiles: {text[:80]!r}") from e
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise argparse.ArgumentTypeError("percentiles must be in (0, 100]")
    return ps


def _metadata(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--metadata takes KEY=VALUE, got {pair[:80]!r}")
        out[key.strip()] = value.strip()
    return out


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-worker-bench", description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="'run' is the default subcommand; every option of both follows.",
    )
    sub = p.add_subparsers(dest="command", metavar="{run,report}")
    # Defaults are spelled out in each help (a formatter would print a token from the env).
    r = sub.add_parser("run", help="benchmark a server (the default)")

    g = r.add_argument_group("server")
    g.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="our WorkerService over gRPC (default), or an OpenAI-compatible HTTP endpoint")
    g.add_argument("--target", default=None,
                   help="gRPC HOST:PORT (default $LLMWORKER_TARGET or 127.0.0.1:50051)")
    g.add_argument("--token", default=os.environ.get("LLMWORKER_TOKEN"),
                   help="gRPC bearer token (default $LLMWORKER_TOKEN)")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="OpenAI server root, for /v1/chat/completions and /v1/completions "
                        "(default http://127.0.0.1:8000)")
    g.add_argument("--model", default=None,
                   help="OpenAI 'model' field (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="OpenAI bearer key (default $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=None, help="per-request deadline, seconds (default none)")

    g = r.add_argument_group("workload")
    g.add_argument("--dataset", choices=ds.KINDS, default="chat",
                   help="random token ids, the built-in chats (default), or chats mixed with long "
                        "prompts")
    g.add_argument("--num-requests", type=int, default=64, help="requests per run (default 64)")
    g.add_argument("--input-len", type=_lengths, default=parse_lengths("256"),
                   help="random: prompt lengths, N, uniform:LO:HI or lognormal:MEDIAN:SIGMA[:MAX] "
                        "(default 256)")
    g.add_argument("--output-len", type=_lengths, default=None,
                   help="output lengths, same specs plus longtail[:MAX] "
                        "(default: 128 for random, longtail for chat and mixed)")
    g.add_argument("--long-fraction", type=float, default=0.1,
                   help="mixed: fraction of requests that are long random prompts (default 0.1)")
    g.add_argument("--long-input-len", type=int, default=2000, help="mixed: long prompt length (default 2000)")
    g.add_argument("--long-output-len", type=int, default=16, help="mixed: output tokens of a long request (default 16)")
    g.add_argument("--chat-input", choices=("messages", "text"), default="messages",
                   help="send chats as messages (default; the server applies the template) or as text "
                        "rendered here with the model's template (OpenAI: /v1/completions)")
    g.add_argument("--ids-input", choices=("ids", "text"), default="ids",
                   help="send random token-id prompts as ids (default) or decoded to text here "
                        "(for servers whose /v1/completions takes no ids, e.g. SMG)")
    g.add_argument("--tokenizer", default=None,
                   help="the model's tokenizer, for --chat-input/--ids-input text and the peer's "
                        "prompt ids: grpc://HOST:PORT of a worker (its GetTokenizer), a .zip of "
                        "that, a Hugging Face folder or a tokenizer.json (default: from --target "
                        "over the wire; required with --backend openai)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="random ids below this (default: the server's model info, else 32000)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --output-len tokens per request (equal work)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling's top_p, sent when below 1 (default 1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's presence_penalty, sent when not 0 (default 0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's frequency_penalty, sent when not 0 (default 0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's repetition_penalty (the logits of the prompt's and output's "
                        "tokens divided by it), sent when not 1 (default 1: off); not an OpenAI "
                        "field, so an OpenAI server without it ignores or refuses it")
    g.add_argument("--seed", type=int, default=0, help="same seed, same requests and arrivals (default 0)")

    g = r.add_argument_group("load")
    g.add_argument("--request-rate", type=_rates, default=[math.inf],
                   help="Poisson arrivals in req/s; 'inf' = all at once (burst); a comma list "
                        "(e.g. 0.5,1,2,4) is a sweep, one run per rate, with a plot (default inf)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (with rate inf: a fixed concurrency; default no cap)")
    g.add_argument("--warmup", type=int, default=2, help="uncounted requests sent first (default 2)")
    g.add_argument("--slo", type=_slo, default={},
                   help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2el=10s (all must hold)")
    g.add_argument("--knee-factor", type=float, default=DEFAULT_FACTOR,
                   help="sweep knee: last rate before p99 TTFT exceeds this x its lowest-rate value "
                        "(default 3)")

    g = r.add_argument_group("peer")
    g.add_argument("--peer", choices=PEERS, default=None,
                   help="also run this system on the same requests; report our/their output tok/s "
                        "(implies --ignore-eos)")
    g.add_argument("--peer-batch-size", type=int, default=8, help="peer static batch size (default 8)")
    g.add_argument("--peer-threads", type=int, default=None,
                   help="torch threads for the peer (default: the CPU count)")
    g.add_argument("--peer-model", default="default",
                   help="the peer's model: 'default' (the embedded GGUF, float32, CPU) or dummy:SHAPE "
                        "(random weights of a worker dummy shape; bfloat16 on CUDA when present), "
                        "matching the worker's --model (default: default)")

    g = r.add_argument_group("output")
    g.add_argument("--name", "--label", default=None,
                   help="title of this result in reports (default: backend and dataset); "
                        "vLLM's --label in --save-result files")
    g.add_argument("--output-json", type=Path, default=None,
                   help="result file (default bench-results/bench-<UTC time>.json)")
    g.add_argument("--plot", type=Path, default=None,
                   help="sweep plot PNG (default: the result file with .png)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    g = r.add_argument_group("vLLM's result file (vllm bench serve --save-result)")
    g.add_argument("--save-result", action="store_true",
                   help="also write each run (each rate) as vllm bench serve writes its result: "
                        "request_throughput, output_throughput, mean_ttft_ms, p99_tpot_ms, ... "
                        "(clients/bench/vllm_result.py), named as vLLM names it, "
                        "{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    g.add_argument("--append-result", action="store_true",
                   help="append each run to the file, one JSON a line (implies --save-result)")
    g.add_argument("--save-detailed", action="store_true",
                   help="add the per-request lists: input_lens, output_lens, start_times, ttfts, "
                        "itls, errors")
    g.add_argument("--result-dir", type=Path, default=None,
                   help="folder of the result files (default: the current directory)")
    g.add_argument("--result-filename", default=None,
                   help="the result file's name (one run, or with --append-result; default: "
                        "vLLM's name)")
    g.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                   help="KEY=VALUE pairs written into the result file (e.g. commit=abc tp=1)")
    g.add_argument("--percentile-metrics", type=_percentile_metrics,
                   default=vr.DEFAULT_PERCENTILE_METRICS,
                   help=f"metrics given mean/median/std/percentiles, a comma list of "
                        f"{', '.join(vr.PERCENTILE_METRICS)} (default "
                        f"{','.join(vr.DEFAULT_PERCENTILE_METRICS)})")
    g.add_argument("--metric-percentiles", type=_percentiles, default=vr.DEFAULT_PERCENTILES,
                   help="percentiles of those, a comma list, e.g. 50,90,99 (default 99)")

    rep = sub.add_parser("report", help="render result files as markdown tables")
    rep.add_argument("results", nargs="+", type=Path, help="result JSON files")
    rep.add_argument("--output", type=Path, default=None, help="write here instead of stdout")
    rep.add_argument("--compare", action="store_true",
                     help="two files, BASE NEW: their runs side by side, with ratios")
    return p


def needs_tokenizer(args: argparse.Namespace) -> bool:
    """Text modes render here; the peer needs prompt ids for anything but random ids."""
    return "text" in (args.chat_input, args.ids_input) or (
        bool(args.peer) and args.dataset != "random")


def parse_args(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    """Parsed `argv` (default sys.argv[1:]); `description` heads the top-level --help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    parser = build_parser(description)
    if argv in (["-h"], ["--help"]):  # every option in one --help: the top, then each command
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        print(parser.format_help())
        for name, sub in subs.choices.items():
            print(f"---- llm-worker-bench {name} ----\n{sub.format_help()}")
        raise SystemExit(0)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given, "run" made explicit, for the result file
    if args.command == "run":
        for name in ("num_requests", "long_input_len", "long_output_len", "peer_batch_size"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= args.long_fraction <= 1:
            parser.error("--long-fraction must be in [0, 1]")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            parser.error("--max-concurrency must be >= 1")
        if args.output_len is None:
            args.output_len = parse_lengths("128" if args.dataset == "random" else "longtail")
        if args.peer:
            args.ignore_eos = True  # the peer generates exactly output_len: equal work
        if args.append_result:
            args.save_result = True
        vllm_only = [flag for flag, on in (("--save-detailed", args.save_detailed),
                                           ("--result-dir", args.result_dir),
                                           ("--result-filename", args.result_filename),
                                           ("--metadata", args.metadata)) if on]
        if vllm_only and not args.save_result:
            parser.error(f"{', '.join(vllm_only)}: for vLLM's result file, with --save-result")
        if args.result_filename and len(args.request_rate) > 1 and not args.append_result:
            parser.error(f"--result-filename names one file and the sweep has "
                         f"{len(args.request_rate)} runs: leave it out (vLLM's names carry the "
                         "rate) or add --append-result")
        try:
            args.metadata = _metadata(args.metadata)
        except ValueError as e:
            parser.error(str(e))
        if needs_tokenizer(args) and args.backend == "openai" and args.tokenizer is None:
            parser.error("--chat-input/--ids-input text and --peer need --tokenizer with "
                         "--backend openai (grpc://HOST:PORT of a worker, a folder, a .zip or a "
                         "tokenizer.json)")
    return args

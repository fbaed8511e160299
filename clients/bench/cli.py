"""``llm-worker-bench``: the worker's latency-throughput figures, reproducible from one command.

    llm-worker-bench                                    # 64 chats, all at once, 127.0.0.1:50051
    llm-worker-bench run --request-rate 0.5,1,2,4 --num-requests 64 --slo ttft=500ms,tpot=50ms
    llm-worker-bench run --dataset random --input-len 256 --output-len 64 --max-concurrency 8
    llm-worker-bench run --dataset mixed --long-fraction 0.1 --long-input-len 2000
    llm-worker-bench run --ignore-eos --peer transformers --peer-batch-size 8
    llm-worker-bench run --backend openai --base-url http://127.0.0.1:8000 --dataset chat
    llm-worker-bench run --save-result --result-dir results --metric-percentiles 50,90,99
    llm-worker-bench report bench-results/*.json > table.md

``run`` (the default subcommand) writes one JSON file (config, server, dataset, environment,
each run's summary and per-request records, and for a sweep the knee and a PNG plot) and
prints a summary. The JSON is written as soon as the measurements end, before the optional
parts (plot, peer), and rewritten as each one adds to it; what the install lacks for them
(the ``bench`` extra: matplotlib, transformers) is said before the first request.
With --save-result it also writes each run as ``vllm bench serve --save-result`` does, its
keys and their meanings (vllm_result.py), for tools that read vLLM's results.
``report`` renders result files as markdown tables for BENCHMARKS.md.
Metrics are those of ``vllm bench serve``: see clients/bench/metrics.py. Exit status: 0;
1 when the server cannot be reached or a request failed; 2 for usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

from clients.bench import dataset as ds
from clients.bench import extras, vllm_result
from clients.bench.args import needs_tokenizer, parse_args
from clients.bench.environment import environment, recorded
from clients.bench.knee import find_knee
from clients.bench.lengths import LengthDist
from clients.bench.record import Backend
from clients.bench.report import render_comparison, render_files
from clients.bench.runner import rate_value, run_once, warm_up
from clients.client import default_target


def penalties(args: argparse.Namespace) -> dict[str, float]:
    """The penalties asked for, by their request field names; those left off are not sent."""
    asked = {"presence_penalty": (args.presence_penalty, 0.0), "frequency_penalty": (args.frequency_penalty, 0.0),
             "repetition_penalty": (args.repetition_penalty, 1.0)}
    return {name: value for name, (value, off) in asked.items() if value != off}


def make_backend(args: argparse.Namespace) -> Backend:
    if args.backend == "grpc":
        from clients.bench.backend_grpc import GrpcBackend

        return GrpcBackend(args.target or default_target(), ignore_eos=args.ignore_eos,
                           temperature=args.temperature, top_p=args.top_p, penalties=penalties(args),
                           token=args.token, timeout=args.timeout)
    from clients.bench.backend_openai import OpenAIBackend

    return OpenAIBackend(args.base_url, ignore_eos=args.ignore_eos, temperature=args.temperature,
                         top_p=args.top_p, penalties=penalties(args), model=args.model, api_key=args.api_key,
                         timeout=args.timeout)


def make_dataset(args: argparse.Namespace, vocab_size: int,
                 tokenizer: Any = None) -> list[ds.BenchRequest]:
    """The requests; `tokenizer` (a `load_tokenizer` result) renders them as text where the
    --chat-input / --ids-input modes ask for it."""
    n, seed = args.num_requests, args.seed
    if args.dataset == "random":
        reqs = ds.random_dataset(n, args.input_len, args.output_len, vocab_size, seed)
    elif args.dataset == "chat":
        reqs = ds.chat_dataset(n, args.output_len, seed)
    else:
        reqs = ds.mixed_dataset(
            n, args.output_len, seed, long_fraction=args.long_fraction,
            long_input_len=args.long_input_len, long_output_len=args.long_output_len,
            vocab_size=vocab_size,
        )
    if "text" in (args.chat_input, args.ids_input):
        from clients.bench.tokenizer import as_text, ids_as_text

        assert tokenizer is not None, "text modes need the tokenizer"
        if args.chat_input == "text":
            reqs = [as_text(r, tokenizer) for r in reqs]
        if args.ids_input == "text":
            reqs = [ids_as_text(r, tokenizer) for r in reqs]
    return reqs


def client_tokenizer(args: argparse.Namespace) -> Any:
    """The model's tokenizer: --tokenizer, else over the wire from the gRPC target."""
    from clients.bench.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer, target=args.target or default_target(),
                          token=args.token)


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        if isinstance(v, LengthDist):
            v = v.spec
        elif isinstance(v, Path):
            v = recorded(v)
        elif k == "request_rate":
            v = ["inf" if math.isinf(x) else x for x in v]
        elif k == "argv":
            continue  # environment.command has it
        elif k in ("token", "api_key") and v:
            v = "<set>"  # never write a secret into a result file
        out[k] = v
    return out


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    backend = make_backend(args)
    try:
        server = await backend.describe()
        vocab = args.vocab_size or server.get("vocab_size") or 32000
        tok = await asyncio.to_thread(client_tokenizer, args) if needs_tokenizer(args) else None
        reqs = make_dataset(args, vocab, tok)
        warm = await warm_up(backend, reqs, args.warmup)
        if bad := [r.error for r in warm if not r.success]:
            print(f"warning: {len(bad)} of {len(warm)} warm-up requests failed: {bad[0]}",
                  file=sys.stderr)
        runs = []
        for rate in args.request_rate:
            label = f"rate {rate:g}" if len(args.request_rate) > 1 else ""
            run = await run_once(backend, reqs, request_rate=rate,
                                 max_concurrency=args.max_concurrency, seed=args.seed,
                                 slo=args.slo, progress=not args.no_progress, label=label)
            runs.append(run)
    finally:
        await backend.close()
    return {"server": server, "dataset": {"kind": args.dataset, **ds.describe(reqs)},
            "runs": runs, "_requests": reqs, "_tokenizer": tok}


def print_summary(result: dict[str, Any]) -> None:
    for run in result["runs"]:
        s = run["summary"]
        t, p, i, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2el_ms"]

        def ms(d: dict[str, float | None]) -> str:
            return " / ".join("–" if d[k] is None else f"{d[k]:.1f}"
                              for k in ("mean", "median", "p90", "p99"))

        print(f"== rate {run['request_rate']} req/s, max concurrency "
              f"{run['max_concurrency'] or '–'} ==")
        print(f"requests: {s['completed']} ok, {s['failed']} failed"
              + (f" {s['errors']}" if s["failed"] else "") + f"; {s['duration_s']:.2f} s; "
              f"peak in flight {s['max_in_flight']}")
        print(f"throughput: {s['request_throughput']:.2f} req/s, input "
              f"{s['input_throughput']:.1f} tok/s, output {s['output_throughput']:.1f} tok/s")
        print(f"TTFT ms (mean/median/p90/p99): {ms(t)}")
        print(f"TPOT ms: {ms(p)}")
        print(f"ITL  ms: {ms(i)}")
        print(f"E2EL ms: {ms(e)}")
        for kind, k in s.get("by_kind", {}).items():
            print(f"  {kind}: {k['completed']} ok; TTFT ms {ms(k['ttft_ms'])}; "
                  f"TPOT ms {ms(k['tpot_ms'])}")
        if "request_goodput" in s:
            print(f"goodput: {s['request_goodput']:.2f} req/s ({s['num_good']} met {s['slo_ms']})")
    if knee := result.get("knee"):
        print(f"knee: {knee['request_rate']} req/s "
              f"({'reached' if knee['reached'] else 'not reached; sweep higher'})")
    if peer := result.get("peer"):
        print(f"peer transformers: {peer['output_throughput']:.1f} output tok/s; "
              f"ours / theirs = {peer['ratio']:.2f}x")


def _write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)  # a reader never sees half a file


def save_vllm_results(args: argparse.Namespace, result: dict[str, Any],
                      raws: list[tuple[list[Any], list[float]]]) -> list[Path]:
    """Each run as `vllm bench serve --save-result` writes it; the paths written."""
    model = result["server"].get("model") or args.model or ""
    paths = []
    for run, (records, queue_s) in zip(result["runs"], raws, strict=True):
        setup = vllm_result.setup_keys(
            backend=args.backend, label=args.name, model_id=model,
            tokenizer_id=str(args.tokenizer or model), num_prompts=args.num_requests,
            metadata=args.metadata)
        s = run["summary"]
        data = vllm_result.vllm_result(
            records, queue_s, duration_s=s["duration_s"], setup=setup,
            request_rate=rate_value(run), max_concurrency=args.max_concurrency,
            num_good=s.get("num_good"), percentile_metrics=args.percentile_metrics,
            percentiles=args.metric_percentiles, detailed=args.save_detailed)
        name = args.result_filename or vllm_result.default_filename(
            label=args.name, backend=args.backend, request_rate=rate_value(run),
            max_concurrency=args.max_concurrency, model_id=model, date=setup["date"])
        path = (args.result_dir or Path()) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a" if args.append_result else "w", encoding="utf-8") as f:
            if args.append_result and f.tell():
                f.write("\n")  # vLLM's --append-result: one JSON a line
            json.dump(data, f)
        paths.append(path)
    return paths


def run_command(args: argparse.Namespace) -> int:
    can = extras.check(args)
    for line in can.errors:
        print(f"error: {line}", file=sys.stderr)
    if can.errors:
        return 2
    for line in can.notes:
        print(f"note: {line}", file=sys.stderr, flush=True)
    env = environment(["llm-worker-bench", *args.argv])
    try:
        measured = asyncio.run(_measure(args))
    except Exception as e:  # the server is unreachable or refused describe(): say so, exit 1
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    reqs, tok = measured.pop("_requests"), measured.pop("_tokenizer")
    raws = [run.pop("_raw") for run in measured["runs"]]
    result: dict[str, Any] = {
        "name": args.name or f"{args.backend} {args.dataset}",
        "config": config_of(args),
        **measured,
        "environment": env,
    }
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.output_json or Path("bench-results") / f"bench-{stamp}.json"
    if len(result["runs"]) > 1:
        result["knee"] = find_knee(result["runs"], args.knee_factor)
    _write(out, result)  # the measurements are safe before anything optional runs
    print(f"wrote {out}", flush=True)
    if args.save_result:
        for path in save_vllm_results(args, result, raws):
            print(f"wrote {path} (vllm bench serve's result)", flush=True)
    status = 1 if any(r["summary"]["failed"] for r in result["runs"]) else 0
    if len(result["runs"]) > 1 and can.can_plot:
        from clients.bench.plot import plot_sweep

        plot = args.plot or out.with_suffix(".png")
        title = f"{result['server'].get('model', '')} — {result['name']}"
        try:
            result["plot"] = recorded(plot_sweep(result["runs"], result["knee"], plot, title))
        except Exception as e:  # a plot is optional: the figures are in the JSON already
            print(f"warning: no plot ({type(e).__name__}: {e}); {out} has the results",
                  file=sys.stderr)
        else:
            _write(out, result)
            print(f"wrote {result['plot']}")
    if args.peer:
        from clients.bench.peer import run_peer

        result["peer"] = run_peer(
            args.peer, reqs, batch_size=args.peer_batch_size, threads=args.peer_threads,
            tokenizer=tok,
            ours_output_throughput=result["runs"][0]["summary"]["output_throughput"],
            model=args.peer_model,
        )
        _write(out, result)
    print_summary(result)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__ or "")
    if args.command == "report":
        if args.compare:
            if len(args.results) != 2:
                print("report --compare takes two files: BASE NEW", file=sys.stderr)
                return 2
            text = render_comparison(*args.results)
        else:
            text = render_files(args.results)
        if args.output:
            args.output.write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

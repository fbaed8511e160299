"""``llm-worker-cli``: talk to a running llm-worker over gRPC.

    llm-worker-cli generate "Why is the sky blue?" --stream --max-tokens 64 --temperature 0
    llm-worker-cli generate --token-ids 1,2,3 --max-tokens 8 --raw-json
    llm-worker-cli chat "Write a haiku" --system "You are a poet." --stream
    llm-worker-cli model-info | load | status | drain
    llm-worker-cli abort REQUEST_ID [REQUEST_ID ...]
    llm-worker-cli health [--service NAME]
    llm-worker-cli --target 10.0.0.7:50051 --timeout 30 load

Generated text goes to stdout (with ``--stream`` chunk by chunk as it arrives, flushed;
otherwise all at once at the end), followed by one newline; a stats line goes to stderr:
``tokens=N prompt_tokens=P cached_tokens=C finish=REASON ttft_ms=T total_ms=T ...``.
``--raw-json`` prints every ``GenerateResponse`` instead, one JSON object a line.

Admin replies are printed as JSON the way grpcurl prints them (lowerCamelCase names,
64-bit integers as strings, enums by name), except that fields with default values are
included (grpcurl's ``-emit-defaults``), so ``numRunning: 0`` is there to read.
``health`` prints ``{"status": "SERVING"}`` and exits 0 only when serving.

Global options (before or after the subcommand): ``--target HOST:PORT`` (default
``$LLMWORKER_TARGET`` or 127.0.0.1:50051), ``--timeout SECONDS`` (the call's deadline),
``--token`` (``$LLMWORKER_TOKEN``; sent as ``authorization: Bearer ...``), ``--tls`` and
``--root-cert PEM``, ``--no-retry`` (a refused Generate is otherwise retried by gRPC as the
client's service config says: RESOURCE_EXHAUSTED or UNAVAILABLE before any output, after
the worker's ``grpc-retry-pushback-ms``). ``generate`` and ``chat`` take ``--traceparent``
(default ``$TRACEPARENT``, OpenTelemetry's environment carrier) to join a caller's trace.

Exit status: 0 on success; 1 when the call fails (``error: <CODE>: <details>`` on
stderr, e.g. ``error: INVALID_ARGUMENT: ...``) or a generation ends with finish reason
error or abort; 2 for usage errors; 130 when interrupted (the request is cancelled).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from clients.client import (
    CompletionBuilder,
    IncompleteStreamError,
    WorkerClient,
    default_target,
)


class UsageError(Exception):
    """Bad command-line arguments found after parsing (exit status 2)."""


def _to_json(msg: Message, *, indent: int | None = 2) -> str:
    return json_format.MessageToJson(msg, indent=indent, always_print_fields_with_no_presence=True)


def _client(args: argparse.Namespace) -> WorkerClient:
    return WorkerClient(
        args.target or default_target(),
        secure=args.tls,
        root_certificates=args.root_cert,
        token=args.token,
        timeout=args.timeout,
        retry=not args.no_retry,
    )


# ---------------------------------------------------------------- generation


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id,
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
        "top_logprobs": args.top_logprobs,
        "priority": args.priority,
        "request_id": args.request_id,
        "cache_salt": args.cache_salt,
        "include_special_tokens": args.include_special_tokens,
        "traceparent": args.traceparent,
    }


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise UsageError(f"--token-ids: expected integers separated by commas, got {text!r}") from e


def _run_generation(args: argparse.Namespace, **input_kwargs: Any) -> int:
    out = sys.stdout
    with _client(args) as client:
        try:
            call = client.generate(**input_kwargs, **_sampling_kwargs(args))
        except ValueError as e:
            raise UsageError(str(e)) from e
        acc = CompletionBuilder()
        try:
            for resp in call:
                acc.add(resp)
                if args.raw_json:
                    out.write(_to_json(resp, indent=None) + "\n")
                    out.flush()
                elif args.stream and resp.HasField("chunk") and resp.chunk.text:
                    out.write(resp.chunk.text)
                    out.flush()
        except KeyboardInterrupt:
            call.cancel()  # type: ignore[attr-defined]
            raise
        result = acc.result()

    if not args.raw_json:
        if not args.stream:
            out.write(result.text)
        out.write("\n")
        out.flush()
    stats = [
        f"tokens={result.usage['completion_tokens']}",
        f"prompt_tokens={result.usage['prompt_tokens']}",
        f"cached_tokens={result.usage['cached_tokens']}",
        f"finish={result.finish_reason}",
        f"ttft_ms={result.ttft_ms:.1f}",
        f"total_ms={result.total_time_ms:.1f}",
        f"request_id={result.request_id}",
    ]
    if result.spec_draft_tokens:  # a worker with --speculative-config drafted for it
        stats.append(f"spec_accepted={result.spec_accepted_tokens}/{result.spec_draft_tokens}")
    if result.stop_reason:
        stats.append(f"stop_reason={json.dumps(result.stop_reason, ensure_ascii=False)}")
    print(" ".join(stats), file=sys.stderr)
    if result.finish_reason == "error":
        print(f"error: generation failed: {result.error_message}", file=sys.stderr)
        return 1
    if result.finish_reason == "abort":
        print("error: generation aborted", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.token_ids is None):
        raise UsageError("generate takes a prompt or --token-ids (exactly one)")
    if args.token_ids is not None:
        return _run_generation(args, token_ids=_parse_token_ids(args.token_ids))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return _run_generation(args, prompt=prompt)


def cmd_chat(args: argparse.Namespace) -> int:
    messages = []
    if args.system is not None:
        messages.append({"role": "system", "content": args.system})
    message = sys.stdin.read() if args.message == "-" else args.message
    messages.append({"role": "user", "content": message})
    return _run_generation(args, messages=messages)


# ---------------------------------------------------------------- admin


def _print(msg: Message) -> int:
    print(_to_json(msg))
    return 0


def cmd_model_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _print(client.model_info())


def cmd_load(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _print(client.load())


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _print(client.status())


def cmd_abort(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _print(client.abort(*args.request_ids))


def cmd_drain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _print(client.drain())


def cmd_health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.health(args.service)
    print(json.dumps({"status": status}, indent=2))
    return 0 if status == "SERVING" else 1


# ---------------------------------------------------------------- parser


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # On subcommands the defaults are suppressed so that an option given before the
    # subcommand is not overwritten by the subcommand's default.
    def d(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    g = parser.add_argument_group("connection")
    g.add_argument(
        "--target",
        default=d(None),
        metavar="HOST:PORT",
        help="the worker (default: $LLMWORKER_TARGET or 127.0.0.1:50051)",
    )
    g.add_argument(
        "--timeout", type=float, default=d(None), metavar="SECONDS", help="deadline of the call"
    )
    g.add_argument(
        "--token",
        default=d(os.environ.get("LLMWORKER_TOKEN") or None),
        help="bearer token (default: $LLMWORKER_TOKEN)",
    )
    g.add_argument("--tls", action="store_true", default=d(False), help="connect with TLS")
    g.add_argument(
        "--root-cert", default=d(None), metavar="PEM", help="CA certificate file (implies --tls)"
    )
    g.add_argument(
        "--no-retry",
        action="store_true",
        default=d(False),
        help="do not retry a Generate refused before any output (RESOURCE_EXHAUSTED, "
        "UNAVAILABLE); by default gRPC retries it after the worker's grpc-retry-pushback-ms",
    )


def _generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument(
        "--raw-json", action="store_true", help="print each GenerateResponse as a JSON line"
    )
    s = parser.add_argument_group("sampling and stopping (unset: the worker's defaults)")
    s.add_argument("--max-tokens", type=int, default=None)
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument(
        "--stop", action="append", default=None, metavar="STRING", help="stop string (repeatable)"
    )
    s.add_argument(
        "--stop-token-id", action="append", type=int, default=None, metavar="ID", help="repeatable"
    )
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", action="store_true", help="logprob of each token (--raw-json)")
    s.add_argument("--top-logprobs", type=int, default=None, metavar="N")
    s.add_argument("--priority", type=int, default=0, help="lower runs first")
    s.add_argument("--request-id", default=None)
    s.add_argument("--cache-salt", default=None)
    s.add_argument("--include-special-tokens", action="store_true")
    parser.add_argument(
        "--traceparent",
        default=os.environ.get("TRACEPARENT") or None,
        metavar="00-TRACEID-SPANID-FLAGS",
        help="W3C trace context to join (default: $TRACEPARENT)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-worker-cli",
        description="Talk to a running llm-worker over gRPC.",
        epilog="Exit status: 0 ok; 1 a failed call (error: CODE: details) or an aborted or "
        "failed generation; 2 usage.",
    )
    _global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Any, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _global_options(p, suppress=True)
        p.set_defaults(func=func)
        return p

    p = add("generate", cmd_generate, "generate from a text prompt (sent as is)")
    p.add_argument("prompt", nargs="?", default=None, help='the prompt ("-" reads stdin)')
    p.add_argument("--token-ids", default=None, metavar="1,2,3", help="send token ids instead")
    _generation_options(p)

    p = add("chat", cmd_chat, "generate a chat reply (the model's chat template)")
    p.add_argument("message", help='the user message ("-" reads stdin)')
    p.add_argument("--system", default=None, help="a system message before it")
    _generation_options(p)

    add("model-info", cmd_model_info, "the model: name, architecture, vocabulary, limits")
    add("load", cmd_load, "running and waiting requests, KV cache usage, tokens/s")
    add("status", cmd_status, "uptime, configuration, versions, counters")
    p = add("abort", cmd_abort, "abort requests by id")
    p.add_argument("request_ids", nargs="+", metavar="ID")
    add("drain", cmd_drain, "stop taking new work; in-flight requests finish")
    p = add("health", cmd_health, "grpc.health.v1 check (exit 0 only when SERVING)")
    p.add_argument("--service", default="", help='service name ("" = the whole server)')
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on usage errors
    try:
        return args.func(args)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        print(f"error: {name}: {details}", file=sys.stderr)
        return 1
    except (UsageError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except IncompleteStreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. an unreadable --root-cert, or stdout closed
        if isinstance(e, BrokenPipeError):  # `| head`: stop quietly, no flush error at exit
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            return 1
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

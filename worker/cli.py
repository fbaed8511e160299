"""`llm-worker`: the worker's command line.

    llm-worker serve                                serve gRPC on 127.0.0.1:50051
    llm-worker generate "Why is the sky blue?"      stream one answer to the terminal
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from worker import config as cfgmod
from worker import openmp_env


def _generate(args: argparse.Namespace) -> int:
    from scheduler.request import SamplingParams
    from worker.engine import Engine

    conf = cfgmod.from_args(args)
    t0 = time.monotonic()
    engine = Engine(conf)
    print(f"# loaded {engine.loaded.name} ({engine.loaded.source}, {engine.loaded.device}, "
          f"{engine.loaded.dtype}) in {time.monotonic() - t0:.1f}s; {engine.budget.describe()}",
          file=sys.stderr)
    tok = engine.tokenizer
    if tok is None:
        print("error: this model has no tokenizer; text prompts need one", file=sys.stderr)
        return 2
    text = args.prompt
    if not args.raw:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed, stop=tuple(args.stop or ()),
    )
    request = engine.make_request(tok.encode(text), params)

    def show(outputs: list) -> None:
        for o in outputs:
            sys.stdout.write(o.new_text)
            sys.stdout.flush()

    t0 = time.monotonic()
    (done,) = engine.generate([request], on_output=show)
    dt = time.monotonic() - t0
    print(f"\n# {len(done.token_ids)} tokens in {dt:.2f}s ({len(done.token_ids) / dt:.1f} tok/s), "
          f"finish_reason={done.finish_reason}", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from worker.server import serve

    return asyncio.run(serve(cfgmod.from_args(args)))


def build_parser(with_plan: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate one answer offline and stream it to stdout")
    gen.add_argument("prompt", help="the user message (chat-templated unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    cfgmod.add_arguments(gen, skip=("server", "kv_transfer"))
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="serve the gRPC API (llmworker.v1.WorkerService)")
    cfgmod.add_arguments(srv)
    srv.set_defaults(func=_serve)
    if with_plan:
        # llm-worker plan: capacity planning from the model's config (it imports torch)
        from worker import plan

        plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    # serve and generate parse without `plan`'s subparser, whose module loads torch: their
    # OpenMP settings are chosen before torch loads (worker.openmp_env).
    args = build_parser(with_plan=argv[:1] not in (["serve"], ["generate"])).parse_args(argv)
    try:
        if args.func in (_serve, _generate):  # before anything loads torch (worker.openmp_env)
            model = cfgmod.from_args(args).model
            openmp_env.set_default_wait_policy(model.kernels, model.device)
        return args.func(args)
    except ValueError as e:  # bad input or a model that cannot load: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # generate, or serve before its own handlers: as llm-worker-cli
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

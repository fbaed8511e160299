"""Every command BENCHMARKS.md and RELIABILITY.md quote runs: its module (ours, or the
console script that names it) exists, its `--help` works, and every flag the command passes is
one that help lists. A module folded into another, or a flag renamed, fails here rather than
in the hands of whoever re-measures."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("BENCHMARKS.md", "RELIABILITY.md")
OURS = ("benchmarks.", "clients.", "worker.")
SCRIPTS = {"llm-worker": "worker.cli", "llm-worker-bench": "clients.bench.cli"}


def quoted_commands(text: str) -> list[str]:
    """Each backticked or fenced command line that runs one of our modules or scripts."""
    spans = re.findall(r"`([^`\n]+)`", text) + [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                                              for line in block.splitlines()]
    out = []
    for span in spans:
        words = span.split()
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
            words = words[1:]
        ours = words[:2] == ["python", "-m"] and len(words) > 2 and words[2].startswith(OURS)
        if ours or (words and words[0] in SCRIPTS):
            out.append(" ".join(words))
    return out


def module_and_args(command: str) -> tuple[str, list[str]]:
    words = shlex.split(command.replace("<", "'<").replace(">", ">'"))
    if words[0] == "python":
        return words[2], words[3:]
    return SCRIPTS[words[0]], words[1:]


def help_text(module: str, args: list[str]) -> str:
    """`python -m module SUBCOMMANDS --help`, in this process."""
    subcommands = []
    for a in args:
        if a.startswith("-"):
            break
        subcommands.append(a)
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, *subcommands, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv
    assert done.value.code in (0, None), f"{module} {' '.join(subcommands)} --help exited {done.value.code}"
    return out.getvalue()


def commands() -> list[tuple[str, str]]:
    return [(doc, c) for doc in DOCS for c in quoted_commands((ROOT / doc).read_text(encoding="utf-8"))]


def test_the_reports_quote_commands_and_the_extraction_finds_them() -> None:
    found = quoted_commands("run `LLMWORKER_COMMIT=x python -m benchmarks.ab step --rounds 2` or `python -m pytest -q`;\n"
                            "```bash\nllm-worker-bench run --dataset chat\n```\n`--side a=.`")
    assert found == ["python -m benchmarks.ab step --rounds 2", "llm-worker-bench run --dataset chat"]
    assert module_and_args("python -m benchmarks.llamacpp_side_by_side --llama-server <llama-server built> --rounds 2") == (
        "benchmarks.llamacpp_side_by_side", ["--llama-server", "<llama-server built>", "--rounds", "2"])
    modules = {module_and_args(c)[0] for _, c in commands()}
    assert {"benchmarks.ab", "benchmarks.spec_decode", "clients.bench.cli"} <= modules


@pytest.mark.parametrize("command", sorted({c for _, c in commands()}))
def test_each_quoted_command_exists_and_takes_its_flags(command: str) -> None:
    module, args = module_and_args(command)
    spec = importlib.util.find_spec(module)
    # in this checkout (an editable install of another one can still resolve a module gone here)
    assert spec is not None and spec.origin and Path(spec.origin).is_relative_to(ROOT), f"no module {module} here"
    if not args:  # a module named in a sentence (benchmarks.faulty_worker takes a trigger file first)
        return
    text = help_text(module, args)
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text))
    assert not missing, f"{module} takes no {', '.join(missing)} (its --help)"

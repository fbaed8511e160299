"""Where and how a result was measured: date, machine, CPU, versions, git commit, and the
command, written relative to the repo root (no machine's absolute paths in a record)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's marketing name where the OS tells it (Linux), else platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str | None:
    """Without importing torch when it is not loaded already (it takes seconds)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _relative(arg: str) -> str:
    """An absolute path made relative to the repo root; one outside it keeps only its name,
    so that no record carries a machine's directories."""
    key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    path = Path(value)
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    return f"{key}{eq}{rel or '.'}"


def recorded(value: Any) -> Any:
    """A value for a record: paths (and absolute path strings) relative to the repo root as
    `_relative` makes them, inside lists and dicts too (e.g. ``vars(args)``)."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return _relative(value) if os.path.isabs(value) else value
    if isinstance(value, dict):
        return {k: recorded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [recorded(v) for v in value]
    return value


def command(argv: list[str]) -> str:
    """`argv` as a command to run from the repo root: a module run with ``python -m`` (whose
    argv[0] is its file's absolute path) named as ``python -m pkg.mod``, a console script by
    its name, absolute paths in the arguments relative to the root (see `_relative`)."""
    if not argv:
        return ""
    first, rest = argv[0], [_relative(a) for a in argv[1:]]
    head = [first]
    path = Path(first)
    if path.is_absolute() and path.suffix == ".py":
        if path.is_relative_to(ROOT):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            head = ["python", "-m", module.removesuffix(".__main__")]
        elif path.name == "__main__.py":  # an installed package run with -m (e.g. pytest)
            head = ["python", "-m", path.parent.name]
        else:
            head = ["python", path.name]
    elif path.is_absolute():  # a console script: its name is how one runs it
        head = [path.name]
    return shlex.join(head + rest)


def git_commit() -> str | None:
    """The commit ``LLMWORKER_COMMIT`` names, if set (a copy on another machine, whose .git
    may be missing or older than its files: the device tool's copies carry the .git of the
    session's start), else HEAD's."""
    return os.environ.get("LLMWORKER_COMMIT") or _git("rev-parse", "HEAD") or None


def environment(argv: list[str] | None = None) -> dict[str, Any]:
    # Unknown for a copy named by LLMWORKER_COMMIT: its .git need not describe its files.
    status = None if os.environ.get("LLMWORKER_COMMIT") else _git("status", "--porcelain", "--untracked-files=no")
    argv = sys.argv if argv is None else argv
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch_version(),
        "git_commit": git_commit(),
        "git_dirty": None if status is None else bool(status),
        "command": command(argv),  # relative to the repo root, runnable from it
    }

"""Where and how a result was measured: date, machine, CPU, versions, git commit, command."""

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


def environment(argv: list[str] | None = None) -> dict[str, Any]:
    status = _git("status", "--porcelain", "--untracked-files=no")
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
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "command": shlex.join(argv),
    }

"""A scenario's record: parameters, counts, and named checks that held or not."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.bench.environment import command

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Record:
    scenario: str
    params: dict[str, Any]
    counts: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    worker_flags: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: object = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": str(detail)})
        return bool(ok)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c["ok"] for c in self.checks)

    def failed(self) -> list[str]:
        return [f"{c['name']}: {c['detail']}" for c in self.checks if not c["ok"]]

    def to_json(self, seconds: float) -> dict[str, Any]:
        return {"scenario": self.scenario, "ok": self.ok, "params": self.params,
                "worker_flags": self.worker_flags, "counts": self.counts,
                "figures": self.figures, "checks": self.checks,
                "seconds": round(seconds, 1), "environment": environment()}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict[str, Any]:
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:  # the client side needs no torch
        torch_version = ""
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "python": platform.python_version(),
        "torch": torch_version,
        "commit": _git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else ""),
        "command": command(["python", "-m", "clients.reliability", *sys.argv[1:]]),
    }

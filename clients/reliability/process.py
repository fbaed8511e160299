"""One worker process for a scenario: start, wait until ready, sample its resources, stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


class WorkerProcess:
    """`python -m worker.cli serve --port 0 FLAGS` (or the fault launcher), stderr kept.

    ``fault_file``: run through `benchmarks.faulty_worker` instead (a child process; nothing
    of it is imported here), which fails one model step each time that file appears (and
    removes it); `env` adds to its environment (the launcher's leak, for one).
    """

    def __init__(self, *flags: str, fault_file: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        if fault_file is None:
            cmd = [sys.executable, "-m", "worker.cli", "serve"]
        else:
            cmd = [sys.executable, "-m", "benchmarks.faulty_worker", str(fault_file)]
        cmd += ["--port", "0", "--host", "127.0.0.1", "--log-format", "json", *flags]
        self.cmd = cmd
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        m = self.wait_for(r"listening on (\S+):(\d+)")
        self.address = f"{m.group(1)}:{m.group(2)}"
        self.wait_for(r"llm-worker: serving ")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = "\n".join(self.lines[-20:])
                    raise RuntimeError(f"worker: no line matching {pattern!r}; stderr:\n{tail}")
                self._cond.wait(min(left, 0.5))

    def resources(self) -> dict[str, int]:
        """RSS (KiB), open file descriptors and threads of the worker, from /proc."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {
            "rss_kib": int(fields["VmRSS"].split()[0]),
            "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
            "threads": int(fields["Threads"]),
        }

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

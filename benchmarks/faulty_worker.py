"""`llm-worker serve` with a fault trigger, for the `fault` scenario only.

    python -m benchmarks.faulty_worker TRIGGER_FILE [serve flags...]

Each time TRIGGER_FILE exists when a model step starts, that step raises (as a device
error would) and the file is removed: one failed step per trigger, at a moment the
scenario picks, in a real server process under real load. The production code has no
such hook; this wraps `ModelRunner.execute` from outside before the server starts.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    trigger = Path(sys.argv[1])
    from worker import cli
    from worker.model_runner import ModelRunner

    real = ModelRunner.execute

    def execute(self, sched):  # type: ignore[no-untyped-def]
        try:
            trigger.unlink()
        except FileNotFoundError:
            return real(self, sched)
        ids = ",".join(s.request_id for s in sched.scheduled)
        raise RuntimeError(f"injected fault (requests {ids})")

    ModelRunner.execute = execute  # type: ignore[method-assign]
    return cli.main(["serve", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())

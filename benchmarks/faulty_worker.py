"""`llm-worker serve` with a fault trigger, for the `fault` scenario only.

    python -m benchmarks.faulty_worker TRIGGER_FILE [serve flags...]

Each time TRIGGER_FILE exists when a model step starts, that step raises (as a device
error would) and the file is removed: one failed step per trigger, at a moment the
scenario picks, in a real server process under real load. The production code has no
such hook; this wraps `ModelRunner.execute` from outside before the server starts.

With FAULTY_WORKER_LEAK_PER_REQUEST=F in the environment it also leaks: every request it
serves after the first FAULTY_WORKER_LEAK_AFTER (default 0) joins a list that each later
step scans, at F times the step's own cost per entry (so the slowdown is the same on a
fast or a loaded machine): steps slow down steadily with the requests served, as with a
per-request leak, and the soak's check must call that a slowdown.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> int:
    trigger = Path(sys.argv[1])
    from worker import cli
    from worker.model_runner import ModelRunner

    real = ModelRunner.execute
    leak = float(os.environ.get("FAULTY_WORKER_LEAK_PER_REQUEST", "0"))
    after = int(os.environ.get("FAULTY_WORKER_LEAK_AFTER", "0"))
    seen: dict[str, None] = {}  # the leak: never emptied

    def execute(self, sched):  # type: ignore[no-untyped-def]
        try:
            trigger.unlink()
        except FileNotFoundError:
            pass
        else:
            ids = ",".join(s.request_id for s in sched.scheduled)
            raise RuntimeError(f"injected fault (requests {ids})")
        if not leak:
            return real(self, sched)
        seen.update(dict.fromkeys(s.request_id for s in sched.scheduled))
        t0 = time.perf_counter()
        out = real(self, sched)
        time.sleep((time.perf_counter() - t0) * leak * max(0, len(seen) - after))
        return out

    ModelRunner.execute = execute  # type: ignore[method-assign]
    return cli.main(["serve", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())

"""Helpers of the prefill/decode tests (tests/test_kv_transfer.py, tests/test_smg_pd.py):
the roles' flags, the workers' own P/D figures, and the graceful stop that checks a worker's
block accounting."""

from __future__ import annotations

import re
import signal
import socket

from llmworker.v1 import worker_pb2 as pb

from tests.test_server import Worker, blocks_all_free, wait_until

LEASE_S = 3.0
PRODUCER = ("--kv-transfer-config", '{"kv_connector": "GrpcConnector", "kv_role": "kv_producer"}',
            "--kv-transfer-lease-s", str(LEASE_S))
CONSUMER = ("--kv-transfer-config", '{"kv_connector": "GrpcConnector", "kv_role": "kv_consumer"}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_and_check(*ws: Worker) -> None:
    """Stop the workers gracefully (all at once); each one's own check of its block
    accounting must pass with every block free and nothing pinned (worker.server: the stop
    line)."""
    for w in ws:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in ws:
        w.proc.wait(60)
        m = w.wait_for(r"KV cache at stop: (.*)", timeout=5)
        assert re.match(r"integrity ok; 0 of \d+ blocks in use, 0 pinned", m.group(1)), m.group(1)
        w.close()


def status(w: Worker) -> pb.GetServerStatusResponse:
    return w.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10)


def figures(w: Worker) -> dict[str, int]:
    st = status(w)
    k = st.kv_transfer
    out = {f"fallback:{r}": n for r, n in k.fallbacks.items()}
    out |= {f"source:{s}": n for s, n in st.prompt_tokens_by_source.items()}
    for name in ("pulls", "pulled_blocks", "skipped", "pulls_aborted", "handoffs",
                 "handoffs_refused", "pins_pulled", "pins_released", "pins_expired"):
        out[name] = getattr(k, name)
    return out


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def settled(*ws: Worker) -> None:
    """Every block free (pins included) and nothing running, on each worker."""
    for w in ws:
        wait_until(lambda w=w: blocks_all_free(w) and status(w).kv_transfer.pinned_blocks == 0,
                   20, f"{w.address}: every block free")



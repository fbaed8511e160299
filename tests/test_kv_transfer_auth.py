"""The KV transfer behind the prefill's credentials: a prefill serving mutual TLS with a
Generate token; a decode that presents a CA-signed client certificate and the token pulls;
one without the certificate, or with a wrong token, falls back (counted), its output still
the prompt's. Dummy weights (the same on every worker), certificates made by openssl."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tests.pd_helpers import CONSUMER, PRODUCER, delta, figures
from tests.test_auth import GEN_TOKEN, certs  # noqa: F401 (certs: a fixture)
from tests.test_server import Worker

pytestmark = pytest.mark.slow

DUMMY = ("--model", "dummy:smollm2-135m")
TAG = '{"do_remote_decode":true,"do_remote_prefill":false}'
BEARER = (("authorization", f"Bearer {GEN_TOKEN}"),)


@pytest.fixture(scope="module")
def pd(certs: Path) -> Iterator[tuple[Worker, dict[str, Worker], grpc.Channel]]:  # noqa: F811
    p = Worker(*DUMMY, *PRODUCER, "--tls-cert", str(certs / "server.pem"), "--tls-key",
               str(certs / "server.key"), "--tls-client-ca", str(certs / "ca.pem"),
               "--auth-token", GEN_TOKEN)
    started = [p]
    try:
        m = p.wait_for(r"listening on (\S+):(\d+)")
        peer = ("--kv-transfer-peers", f"{m.group(1)}:{m.group(2)}", "--kv-transfer-peer-ca",
                str(certs / "ca.pem"))
        cert = ("--kv-transfer-peer-cert", str(certs / "client.pem"), "--kv-transfer-peer-key",
                str(certs / "client.key"))
        decodes = {
            "ok": Worker(*DUMMY, *CONSUMER, *peer, *cert, "--kv-transfer-peer-token", GEN_TOKEN),
            "no_cert": Worker(*DUMMY, *CONSUMER, *peer, "--kv-transfer-peer-token", GEN_TOKEN),
            "bad_token": Worker(*DUMMY, *CONSUMER, *peer, *cert,
                                "--kv-transfer-peer-token", "not-the-token"),
        }
        started += decodes.values()
        for w in started:
            w.wait_ready()
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(),
                                             (certs / "client.key").read_bytes(),
                                             (certs / "client.pem").read_bytes())
        channel = grpc.secure_channel(p.address, creds)
        yield p, decodes, channel
        channel.close()
    finally:
        for w in started:
            w.close()


def generate(stub, ids: list[int], max_tokens: int, kv: str | None = None, md=()):
    req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids), stream=False,
                              sampling_params=vpb.SamplingParams(temperature=0.0,
                                                                 max_tokens=max_tokens,
                                                                 ignore_eos=True))
    if kv is not None:
        req.kv_transfer_params_json = kv
    return list(stub.Generate(req, timeout=120, metadata=md))[-1].complete


@pytest.mark.parametrize(("name", "outcome"), [
    ("ok", "pulls"), ("no_cert", "fallback:peer_unavailable"),
    ("bad_token", "fallback:unauthenticated")])
def test_the_pull_needs_the_prefills_credentials(pd, name: str, outcome: str) -> None:
    _, decodes, channel = pd
    prefill = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    ids = [(i * 37) % 4000 + 10 for i in range(45)]
    alone = list(generate(prefill, ids, 6, md=BEARER).output_ids)
    h = generate(prefill, ids, 1, TAG, BEARER).kv_transfer_params_json
    d = decodes[name]
    before = figures(d)
    assert list(generate(d.vllm, ids, 6, h).output_ids) == alone
    assert delta(figures(d), before).get(outcome) == 1, delta(figures(d), before)
    status = worker_pb2_grpc.WorkerServiceStub(channel).GetServerStatus(
        pb.GetServerStatusRequest(), timeout=10, metadata=BEARER)
    assert status.kv_transfer.handoffs >= 1

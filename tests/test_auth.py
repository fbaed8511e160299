"""Authentication: bearer tokens, TLS, mutual TLS and the plaintext health port, each on a
real `llm-worker serve` process (dummy weights) spoken to over loopback.

Certificates are made per session with the `openssl` command line tool: a test CA, a server
certificate for 127.0.0.1, a client certificate signed by the CA, and a client certificate
signed by an unknown CA.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from tests.test_server import GREEDY, ROOT, SERVING, Worker, code_of, grpcurl_bin

GEN_TOKEN = "gen-token-6d1f0c9e7b"
ADMIN_TOKEN = "admin-token-a83be51d42"
DUMMY = ("--model", "dummy:smollm2-135m", "--max-num-seqs", "2")
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _generate(stub: worker_pb2_grpc.WorkerServiceStub, metadata=None) -> pb.GenerateComplete:
    req = pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[1, 2, 3]), sampling=GREEDY,
                             stopping=pb.StoppingCriteria(max_tokens=2))
    done = None
    for resp in stub.Generate(req, timeout=60, metadata=metadata):
        if resp.HasField("complete"):
            done = resp.complete
    assert done is not None
    return done


# Every WorkerService RPC, as a call taking the stub and the metadata.
ADMIN_RPCS: dict[str, Callable] = {
    "Abort": lambda s, md: s.Abort(pb.AbortRequest(request_ids=["nope"]), timeout=10, metadata=md),
    "GetModelInfo": lambda s, md: s.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                                 metadata=md),
    "GetLoad": lambda s, md: s.GetLoad(pb.GetLoadRequest(), timeout=10, metadata=md),
    "GetServerStatus": lambda s, md: s.GetServerStatus(pb.GetServerStatusRequest(), timeout=10,
                                                       metadata=md),
    "Drain": lambda s, md: s.Drain(pb.DrainRequest(), timeout=10, metadata=md),
    "ResetPrefixCache": lambda s, md: s.ResetPrefixCache(pb.ResetPrefixCacheRequest(),
                                                         timeout=10, metadata=md),
}
ALL_RPCS: dict[str, Callable] = {"Generate": _generate, **ADMIN_RPCS}


# ----- certificates ------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _make_leaf(d: Path, name: str, ca: str, usage: str) -> None:
    ext = d / f"{name}.ext"
    ext.write_text("basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   f"extendedKeyUsage={usage}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name, cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A test dependency: its absence is a failure, never a skip.
    assert shutil.which("openssl"), "the openssl command line tool is needed for these tests"
    d = tmp_path_factory.mktemp("certs")
    _make_ca(d, "ca")
    _make_ca(d, "rogue-ca")
    _make_leaf(d, "server", "ca", "serverAuth")
    _make_leaf(d, "client", "ca", "clientAuth")
    _make_leaf(d, "rogue-client", "rogue-ca", "clientAuth")
    return d


def _pem(d: Path, name: str) -> bytes:
    return (d / name).read_bytes()


# ----- workers -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workers(certs: Path) -> Iterator[dict[str, Worker]]:
    """Three workers started side by side: tokens (+ health port), TLS, and mutual TLS."""
    health_port = _free_port()
    tls = ("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"))
    flags = {
        "tokens": (*DUMMY, "--auth-token", GEN_TOKEN, "--admin-token", ADMIN_TOKEN,
                   "--health-port", str(health_port)),
        "tls": (*DUMMY, *tls, "--no-reflection"),
        "mtls": (*DUMMY, *tls, "--tls-client-ca", str(certs / "ca.pem"), "--no-reflection"),
    }
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(Worker, *f) for name, f in flags.items()}
        started: dict[str, Worker] = {}
        try:
            for name, fut in futures.items():
                started[name] = fut.result()
            for w in started.values():
                w.wait_ready()
            started["tokens"].health_port = health_port  # type: ignore[attr-defined]
            yield started
        finally:
            for fut in futures.values():
                if fut.done() and fut.exception() is None:
                    fut.result().close()


@pytest.fixture(scope="module")
def tokens(workers: dict[str, Worker]) -> Worker:
    return workers["tokens"]


def _tls_channel(w: Worker, certs: Path, client: str | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=_pem(certs, "ca.pem"),
        private_key=_pem(certs, f"{client}.key") if client else None,
        certificate_chain=_pem(certs, f"{client}.pem") if client else None,
    )
    return grpc.secure_channel(w.address, creds)


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


# ----- bearer tokens -----------------------------------------------------------------------


@pytest.mark.parametrize("rpc", list(ALL_RPCS))
@pytest.mark.parametrize("token", [None, "wrong-token", "", ADMIN_TOKEN + "x"])
def test_every_rpc_without_a_valid_token_is_unauthenticated(tokens: Worker, rpc: str,
                                                            token: str | None) -> None:
    md = None if token is None else _bearer(token)
    assert code_of(lambda: ALL_RPCS[rpc](tokens.stub, md)) == UNAUTHENTICATED


def test_not_a_bearer_scheme_is_unauthenticated(tokens: Worker) -> None:
    md = (("authorization", f"Basic {GEN_TOKEN}"),)
    assert code_of(lambda: _generate(tokens.stub, md)) == UNAUTHENTICATED
    md = (("authorization", ADMIN_TOKEN),)
    assert code_of(lambda: ADMIN_RPCS["GetLoad"](tokens.stub, md)) == UNAUTHENTICATED


def test_generate_works_with_the_generate_token_and_the_admin_token(tokens: Worker) -> None:
    for token in (GEN_TOKEN, ADMIN_TOKEN):
        done = _generate(tokens.stub, _bearer(token))
        assert done.usage.completion_tokens == 2


@pytest.mark.parametrize("rpc", list(ADMIN_RPCS))
def test_admin_rpcs_refuse_the_generate_token(tokens: Worker, rpc: str) -> None:
    assert code_of(lambda: ADMIN_RPCS[rpc](tokens.stub, _bearer(GEN_TOKEN))) == PERMISSION_DENIED


def test_admin_rpcs_work_with_the_admin_token(tokens: Worker) -> None:
    md = _bearer(ADMIN_TOKEN)
    assert ADMIN_RPCS["GetLoad"](tokens.stub, md).num_total_blocks > 0
    assert ADMIN_RPCS["GetModelInfo"](tokens.stub, md).max_model_len > 0
    assert ADMIN_RPCS["Abort"](tokens.stub, md) is not None
    assert ADMIN_RPCS["ResetPrefixCache"](tokens.stub, md) is not None
    assert not ADMIN_RPCS["GetServerStatus"](tokens.stub, md).draining
    # Drain is not called with the right token: it would stop the shared worker.


def test_health_needs_no_token(tokens: Worker) -> None:
    for service in ("", "llmworker.v1.WorkerService"):
        resp = tokens.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == SERVING


def test_tokens_are_not_in_config_json_or_logs(tokens: Worker) -> None:
    status = ADMIN_RPCS["GetServerStatus"](tokens.stub, _bearer(ADMIN_TOKEN))
    assert GEN_TOKEN not in status.config_json and ADMIN_TOKEN not in status.config_json
    server = json.loads(status.config_json)["server"]
    assert server["auth_token"] == server["admin_token"] == "<set>"
    logs = "\n".join(tokens.lines)
    assert "<set>" in logs  # the config line is there, redacted
    assert GEN_TOKEN not in logs and ADMIN_TOKEN not in logs


def test_reflection_needs_the_admin_token(tokens: Worker) -> None:
    def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([grpcurl_bin(), "-plaintext", *args, tokens.address, "list"],
                              capture_output=True, text=True, timeout=60)

    refused = grpcurl()
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    assert grpcurl("-H", f"authorization: Bearer {GEN_TOKEN}").returncode != 0
    ok = grpcurl("-H", f"authorization: Bearer {ADMIN_TOKEN}")
    assert ok.returncode == 0 and "llmworker.v1.WorkerService" in ok.stdout, ok.stderr


def test_health_port_answers_plaintext_without_auth(tokens: Worker) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{tokens.health_port}") as ch:  # type: ignore[attr-defined]
        assert _health(ch) == SERVING
        # Only health there: the worker service is not served on that port.
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert code_of(lambda: stub.GetLoad(pb.GetLoadRequest(), timeout=10,
                                            metadata=_bearer(ADMIN_TOKEN))
                       ) == grpc.StatusCode.UNIMPLEMENTED


# ----- TLS and mutual TLS ------------------------------------------------------------------


def test_tls_client_trusting_the_ca_connects(workers: dict[str, Worker], certs: Path) -> None:
    with _tls_channel(workers["tls"], certs) as ch:
        assert _health(ch) == SERVING
        assert _generate(worker_pb2_grpc.WorkerServiceStub(ch)).usage.completion_tokens == 2


def test_tls_plaintext_client_fails(workers: dict[str, Worker]) -> None:
    assert code_of(lambda: _health(workers["tls"].channel)) == grpc.StatusCode.UNAVAILABLE


def test_tls_client_not_trusting_the_ca_fails(workers: dict[str, Worker], certs: Path) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=_pem(certs, "rogue-ca.pem"))
    with grpc.secure_channel(workers["tls"].address, creds) as ch:
        assert code_of(lambda: _health(ch)) == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_a_ca_signed_cert_works(workers: dict[str, Worker], certs: Path) -> None:
    with _tls_channel(workers["mtls"], certs, client="client") as ch:
        assert _health(ch) == SERVING
        assert _generate(worker_pb2_grpc.WorkerServiceStub(ch)).usage.completion_tokens == 2


@pytest.mark.parametrize("client", [None, "rogue-client"])
def test_mtls_refuses_clients_without_a_trusted_cert(workers: dict[str, Worker], certs: Path,
                                                     client: str | None) -> None:
    with _tls_channel(workers["mtls"], certs, client=client) as ch:
        assert code_of(lambda: _health(ch)) == grpc.StatusCode.UNAVAILABLE


def test_mtls_plaintext_client_fails(workers: dict[str, Worker]) -> None:
    assert code_of(lambda: _health(workers["mtls"].channel)) == grpc.StatusCode.UNAVAILABLE


# ----- start-up errors ---------------------------------------------------------------------


def test_bad_tls_flags_are_one_clear_line(certs: Path, tmp_path: Path) -> None:
    not_pem = tmp_path / "bad.pem"
    not_pem.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    cases = {
        "only --tls-cert": (("--tls-cert", str(certs / "server.pem")), "without --tls-key"),
        "only --tls-key": (("--tls-key", str(certs / "server.key")), "without --tls-cert"),
        "client CA alone": (("--tls-client-ca", str(certs / "ca.pem")), "without --tls-cert"),
        "missing file": (("--tls-cert", str(tmp_path / "nope.pem"),
                          "--tls-key", str(certs / "server.key")), "nope.pem: no such file"),
        # read by gRPC only at bind time, these said "cannot listen ... Failed to bind"
        "not a certificate": (("--tls-cert", str(not_pem), "--tls-key", str(certs / "server.key")),
                              "--tls-cert/--tls-key: not a certificate and its private key"),
        "key of another cert": (("--tls-cert", str(certs / "server.pem"),
                                 "--tls-key", str(certs / "ca.key")),
                                "--tls-cert/--tls-key: not a certificate and its private key"),
        "CA not a certificate": (("--tls-cert", str(certs / "server.pem"),
                                  "--tls-key", str(certs / "server.key"), "--tls-client-ca", str(not_pem)),
                                 "--tls-client-ca: not a CA certificate"),
    }
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--port", "0", *DUMMY]
    procs = {name: subprocess.Popen([*cmd, *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
             for name, (flags, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        expected = cases[name][1]
        assert proc.returncode == 2, (name, err)
        assert "Traceback" not in err and expected in err, (name, err)
        assert "listening on" not in err, (name, err)


# ----- last: drains the token worker --------------------------------------------------------


def test_drain_with_the_admin_token_turns_both_health_ports_not_serving(tokens: Worker) -> None:
    """Runs last: the token worker is of no further use once drained."""
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(f"127.0.0.1:{tokens.health_port}") as ch:  # type: ignore[attr-defined]
        assert _health(ch) == SERVING
        ADMIN_RPCS["Drain"](tokens.stub, _bearer(ADMIN_TOKEN))
        assert _health(ch) == not_serving
    assert tokens.health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == not_serving


# ----- the vLLM engine protocol on the same port -------------------------------------------

VLLM = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]
# What a gateway holding only the Generate token must be able to call (see worker.auth).
VLLM_GENERATE_LEVEL = {"Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo",
                       "GetLoads", "GetTokenizer", "SubscribeKvEvents"}


def _vllm_call(w: Worker, name: str, md) -> None:
    """Call VllmEngine/`name` with an empty request (read the first answer of a stream)."""
    m = VLLM.methods_by_name[name]
    request = message_factory.GetMessageClass(m.input_type)()
    path = f"/{VLLM.full_name}/{name}"
    des = message_factory.GetMessageClass(m.output_type).FromString
    if m.server_streaming:
        call = w.channel.unary_stream(path, request_serializer=type(request).SerializeToString,
                                      response_deserializer=des)
        stream = call(request, timeout=10, metadata=md)
        try:
            next(stream)
        finally:
            stream.cancel()
    else:
        w.channel.unary_unary(path, request_serializer=type(request).SerializeToString,
                              response_deserializer=des)(request, timeout=10, metadata=md)


def _vllm_code(w: Worker, name: str, md) -> grpc.StatusCode:
    try:
        _vllm_call(w, name, md)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("rpc", [m.name for m in VLLM.methods])
def test_every_vllm_rpc_needs_a_token(tokens: Worker, rpc: str) -> None:
    for md in (None, _bearer("wrong-token")):
        assert _vllm_code(tokens, rpc, md) == UNAUTHENTICATED
    with_gen = _vllm_code(tokens, rpc, _bearer(GEN_TOKEN))
    if rpc in VLLM_GENERATE_LEVEL:  # past the interceptor: whatever the servicer answers
        assert with_gen not in (UNAUTHENTICATED, PERMISSION_DENIED), with_gen
    else:  # FlushCache, Embed, profiling, and any method added later: admin only
        assert with_gen == PERMISSION_DENIED
        assert _vllm_code(tokens, rpc, _bearer(ADMIN_TOKEN)) not in (UNAUTHENTICATED,
                                                                      PERMISSION_DENIED)


def test_with_only_the_generate_token_admin_methods_need_it() -> None:
    """An operator who sets only --auth-token must not leave Drain, Abort or reflection open."""
    from worker.auth import TokenInterceptor

    only_gen = TokenInterceptor(auth_token=GEN_TOKEN)
    for method in ("/llmworker.v1.WorkerService/Drain", "/llmworker.v1.WorkerService/Abort",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                   "/vllm.grpc.engine.VllmEngine/FlushCache"):
        assert only_gen.check(method, None)[0] == UNAUTHENTICATED
        assert only_gen.check(method, "wrong")[0] == UNAUTHENTICATED
        assert only_gen.check(method, GEN_TOKEN) is None
    assert only_gen.check("/grpc.health.v1.Health/Check", None) is None
    only_admin = TokenInterceptor(admin_token=ADMIN_TOKEN)  # Generate open, admin closed
    assert only_admin.check("/llmworker.v1.WorkerService/Generate", None) is None
    assert only_admin.check("/llmworker.v1.WorkerService/Drain", None)[0] == UNAUTHENTICATED

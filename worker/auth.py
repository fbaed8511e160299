"""Who may call what: TLS credentials, bearer tokens, and the redacted config.

Tokens come in ``authorization: Bearer <token>`` metadata and are checked by
`TokenInterceptor` before the request is deserialised, so the servicer never sees a
call that was refused:

=====================================================  ===================================
method                                                 needs
=====================================================  ===================================
``grpc.health.v1.Health/*``                            nothing (probes)
``llmworker.v1.WorkerService/Generate``                --auth-token or --admin-token
``llmworker.v1.KVTransfer/*`` (a decode worker's pull  --auth-token or --admin-token
of a prefill's handoff)
``vllm.grpc.engine.VllmEngine/`` Generate, Abort and   --auth-token or --admin-token
what SMG reads to route (HealthCheck, GetModelInfo,
GetServerInfo, GetLoads, GetTokenizer,
SubscribeKvEvents)
every other method (admin RPCs, the vLLM protocol's    --admin-token
FlushCache, Embed and profiling, reflection, unknown)
=====================================================  ===================================

An empty token flag turns its check off, with one exception: with only --auth-token set,
the admin methods need that token too (an operator who sets one token never leaves Drain or
Abort open to strangers). No token, or one that matches nothing, is
``UNAUTHENTICATED``; the Generate token presented to an admin method is
``PERMISSION_DENIED`` (known caller, not allowed). Tokens are compared with
`hmac.compare_digest`, and both are always compared, so timing says nothing about them.

Reflection stays as ``--reflection`` says, but with an admin token it needs that token
like any admin method (the config system cannot tell an explicit ``--reflection`` from its
default, so "off unless asked for" is "admin-only": it stays usable with
``grpcurl -H 'authorization: Bearer $ADMIN'`` and tells a stranger nothing).
"""

from __future__ import annotations

import hmac
import json
import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from worker.config import ServerConfig, WorkerConfig

GENERATE_METHOD = "/llmworker.v1.WorkerService/Generate"
# The gateway (SMG) holds the Generate token: it needs these to register, route and tokenize,
# and Abort, which it sends (instead of cancelling the stream) when its client disconnects:
# with Abort admin-only, a gateway without the admin token would leave those running.
VLLM_GENERATE_METHODS = frozenset(
    f"/vllm.grpc.engine.VllmEngine/{m}"
    for m in ("Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo", "GetLoads",
              "GetTokenizer", "SubscribeKvEvents"))
# A decode worker pulls a prefill's KV blocks with the Generate token (the gateway's), as
# the handoff came through a Generate; a handle reads only the prompt it was made for.
KV_TRANSFER_METHODS = frozenset(f"/llmworker.v1.KVTransfer/{m}"
                                for m in ("PullBlocks", "RenewLease", "ReleaseBlocks"))
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
# (section, field) of every secret in the config tree.
SECRET_FIELDS = (("server", "auth_token"), ("server", "admin_token"),
                 ("kv_transfer", "kv_transfer_peer_token"))

OPEN, GENERATE, ADMIN = "open", "generate", "admin"


def required_level(method: str) -> str:
    if method.startswith(OPEN_PREFIXES):
        return OPEN
    if method == GENERATE_METHOD or method in VLLM_GENERATE_METHODS or method in KV_TRANSFER_METHODS:
        return GENERATE
    return ADMIN  # deny by default: admin RPCs, reflection, anything unknown


def redacted_config(config: WorkerConfig) -> dict[str, Any]:
    """`config.to_dict()` with the tokens replaced by ``"<set>"`` (or ``""`` when unset)."""
    d = config.to_dict()
    for section, name in SECRET_FIELDS:
        d[section][name] = "<set>" if d[section][name] else ""
    return d


def redacted_config_json(config: WorkerConfig) -> str:
    """What `GetServerStatus.config_json` may show: `WorkerConfig.to_json` without secrets."""
    return json.dumps(redacted_config(config), sort_keys=True)


def bearer_token(metadata: Iterable[Any] | None) -> str | None:
    """The token of the first ``authorization: Bearer ...`` entry, or None."""
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, token = value.strip().partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return None


def _matches(given: bytes, expected: str) -> bool:
    # compare_digest is constant-time in the length of `given`; an unset token never matches.
    return hmac.compare_digest(given, expected.encode()) and bool(expected)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the token their method needs (see the module docstring)."""

    def __init__(self, auth_token: str = "", admin_token: str = "") -> None:
        self.auth_token = auth_token
        self.admin_token = admin_token

    @classmethod
    def from_config(cls, sc: ServerConfig) -> TokenInterceptor | None:
        """None when no token is set (nothing to check)."""
        return cls(sc.auth_token, sc.admin_token) if sc.auth_token or sc.admin_token else None

    def check(self, method: str, token: str | None) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the status to refuse it with."""
        level = required_level(method)
        if level == OPEN:
            return None
        given = (token or "").encode()
        is_admin = _matches(given, self.admin_token)
        is_user = _matches(given, self.auth_token)
        if level == GENERATE:
            if not self.auth_token or is_admin or is_user:
                return None
        elif self.admin_token:
            if is_admin:
                return None
            if is_user:
                return grpc.StatusCode.PERMISSION_DENIED, "this method needs the admin token"
        elif is_user:  # no admin token: the Generate token guards the admin methods too
            return None
        if token is None:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "missing 'authorization: Bearer <token>' metadata")
        return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        refusal = self.check(handler_call_details.method,
                             bearer_token(handler_call_details.invocation_metadata))
        handler = await continuation(handler_call_details)
        if refusal is None:
            return handler
        return _refusing_handler(handler, *refusal)


def _refusing_handler(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
                      details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with `code` (raw bytes for an
    unknown method, so that an unauthenticated caller cannot probe which methods exist)."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)
        yield  # pragma: no cover  (makes this an async generator)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(unary)
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


# ----- TLS -----------------------------------------------------------------------------------


def read_pem(flag: str, path: str) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


def server_credentials(sc: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key (+ --tls-client-ca: mutual TLS), or None
    for plaintext. Raises ValueError (one clear line) on a missing file or a lone flag."""
    if not (sc.tls_cert or sc.tls_key or sc.tls_client_ca):
        return None
    if not (sc.tls_cert and sc.tls_key):
        missing = "--tls-key" if sc.tls_cert else "--tls-cert"
        given = [f for f, v in (("--tls-cert", sc.tls_cert), ("--tls-key", sc.tls_key),
                                ("--tls-client-ca", sc.tls_client_ca)) if v]
        raise ValueError(f"{' and '.join(given)} given without {missing}: TLS needs both "
                         "--tls-cert and --tls-key")
    cert = read_pem("--tls-cert", sc.tls_cert)
    key = read_pem("--tls-key", sc.tls_key)
    ca = read_pem("--tls-client-ca", sc.tls_client_ca) if sc.tls_client_ca else None
    # gRPC reads them only when the port is bound, and says "Failed to bind" of a bad one.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(sc.tls_cert, sc.tls_key)
    except ssl.SSLError as e:
        raise ValueError(f"--tls-cert/--tls-key: not a certificate and its private key "
                         f"({e.reason or e})") from None
    if sc.tls_client_ca:
        try:
            ctx.load_verify_locations(sc.tls_client_ca)
        except ssl.SSLError as e:
            raise ValueError(f"--tls-client-ca: not a CA certificate ({e.reason or e})") from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)

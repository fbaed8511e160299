"""Python client for llm-worker's gRPC contract (``llmworker.v1.WorkerService``).

Two clients with the same method names: `WorkerClient` (blocking, ``grpc``) and
`AsyncWorkerClient` (``grpc.aio``; the same methods are coroutines, and
`AsyncWorkerClient.generate` returns an async iterator).

    from clients.client import WorkerClient

    with WorkerClient("127.0.0.1:50051") as client:
        for resp in client.generate("Why is the sky blue?", max_tokens=64, temperature=0):
            if resp.HasField("chunk"):
                print(resp.chunk.text, end="", flush=True)
        done = client.complete(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
        print(done.text, done.finish_reason, done.usage)

    async with AsyncWorkerClient() as client:
        async for resp in client.generate(token_ids=[1, 2, 3], max_tokens=8):
            ...

The target defaults to ``$LLMWORKER_TARGET`` or ``127.0.0.1:50051``. Errors are the
``grpc.RpcError`` the call failed with (``err.code()``, ``err.details()``); nothing is
wrapped. Like everything in `clients/` (benchmarks aside), this module imports only the
generated stubs, grpc and the standard library, never the worker itself (and
``opentelemetry-api`` when it is installed, to propagate the current trace).

Retries. Both clients' channels carry `RETRY_SERVICE_CONFIG` (``retry=False`` leaves it
out): gRPC itself retries ``Generate`` on ``RESOURCE_EXHAUSTED`` (the worker's queue is
full) and ``UNAVAILABLE`` (loading, draining, unreachable) as long as nothing of the
response has arrived (gRPC commits a call at its first response message or header), with
exponential backoff, at most 5 attempts, and throttled per channel when most calls fail.
When the refusal carries gRPC's ``grpc-retry-pushback-ms`` trailer (gRFC A6; the worker
sends it beside ``retry-after-ms``), the next attempt waits exactly that long instead of
the backoff, and a negative value stops retrying. Any stock gRPC channel can do the same::

    channel = grpc.insecure_channel(target, options=retry_channel_options())

Tracing. Each call carries the W3C ``traceparent`` (and ``tracestate``, ``baggage``) of the
OpenTelemetry context current at the call, through the globally configured propagators,
when ``opentelemetry-api`` is installed and a span is active; or the ``traceparent``
given to ``generate``/``complete`` explicitly, which wins.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmworker.v1 import worker_pb2, worker_pb2_grpc

__all__ = [
    "DEFAULT_TARGET",
    "GENERATE_RETRY_CODES",
    "RETRY_SERVICE_CONFIG",
    "AsyncWorkerClient",
    "Completion",
    "CompletionBuilder",
    "IncompleteStreamError",
    "WorkerClient",
    "build_generate_request",
    "default_target",
    "finish_reason_name",
    "retry_channel_options",
    "retry_service_config",
    "trace_context_metadata",
]

DEFAULT_TARGET = "127.0.0.1:50051"

Metadata = Sequence[tuple[str, str]]
MessageLike = Mapping[str, str] | tuple[str, str] | worker_pb2.ChatMessage


SERVICE = "llmworker.v1.WorkerService"
# Both mean "not now, nothing was done": a full waiting queue, or a worker loading, draining
# or unreachable. Nothing else is retried: the other codes would fail again the same way.
GENERATE_RETRY_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")


def _duration(seconds: float) -> str:
    """Seconds as a protobuf JSON Duration: ``0.1`` -> ``"0.1s"`` (no exponent form)."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def retry_service_config(
    *,
    max_attempts: int = 5,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 5.0,
    backoff_multiplier: float = 2.0,
    throttle: bool = True,
) -> dict[str, Any]:
    """The gRPC service config (as a dict; ``json.dumps`` it for the channel option) that
    retries ``Generate`` on `GENERATE_RETRY_CODES` before its first response (gRPC retries
    only uncommitted calls). ``max_attempts`` counts the first one; gRPC caps it at 5. The
    n-th retry waits a random time up to ``min(initial * multiplier**(n-1), max)`` seconds,
    or exactly ``grpc-retry-pushback-ms`` when the refusal's trailers carry it.
    ``throttle``: gRPC's retry throttling (10 tokens, 0.1 back per success): once more than
    half the recent calls on the channel failed, refusals are returned instead of retried,
    so that clients do not multiply the load on a saturated worker."""
    if not 2 <= max_attempts <= 5:
        raise ValueError(f"max_attempts must be 2..5 (gRPC's limit), got {max_attempts}")
    if not 0 < initial_backoff_s <= max_backoff_s or backoff_multiplier <= 0:
        raise ValueError("backoffs must be 0 < initial_backoff_s <= max_backoff_s, "
                         "with backoff_multiplier > 0")
    config: dict[str, Any] = {
        "methodConfig": [{
            "name": [{"service": SERVICE, "method": "Generate"}],
            "retryPolicy": {
                "maxAttempts": max_attempts,
                "initialBackoff": _duration(initial_backoff_s),
                "maxBackoff": _duration(max_backoff_s),
                "backoffMultiplier": backoff_multiplier,
                "retryableStatusCodes": list(GENERATE_RETRY_CODES),
            },
        }],
    }
    if throttle:
        config["retryThrottling"] = {"maxTokens": 10, "tokenRatio": 0.1}
    return config


RETRY_SERVICE_CONFIG: str = json.dumps(retry_service_config())


def retry_channel_options(service_config: str = RETRY_SERVICE_CONFIG) -> list[tuple[str, Any]]:
    """Channel options for any ``grpc``/``grpc.aio`` channel: retries on (gRPC's default
    too, said explicitly) and the service config (`RETRY_SERVICE_CONFIG` by default).
    A service config from the name resolver (DNS TXT records) would win over it; pass
    ``("grpc.service_config_disable_resolution", 1)`` as well to rule that out."""
    return [("grpc.enable_retries", 1), ("grpc.service_config", service_config)]


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")

try:  # optional: a client install need not have OpenTelemetry
    from opentelemetry import propagate as _propagate
except ImportError:  # pragma: no cover - opentelemetry-api is a worker dependency
    _propagate = None  # type: ignore[assignment]


def trace_context_metadata(traceparent: str | None = None) -> list[tuple[str, str]]:
    """The trace context to send with a call: ``[("traceparent", traceparent)]`` when given
    (ValueError unless it is W3C's ``version-traceid-spanid-flags`` in lowercase hex), else
    what OpenTelemetry's global propagators inject for the current context (nothing when no
    span is active or opentelemetry-api is not installed)."""
    if traceparent is not None:
        if not _TRACEPARENT.match(traceparent):
            raise ValueError("traceparent must be W3C's 00-<32 hex>-<16 hex>-<2 hex>, got "
                             f"{traceparent[:80]!r}")
        return [("traceparent", traceparent)]
    if _propagate is None:
        return []
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return [(k.lower(), v) for k, v in carrier.items()]


def default_target() -> str:
    """``$LLMWORKER_TARGET`` when set and non-empty, else ``127.0.0.1:50051``."""
    return os.environ.get("LLMWORKER_TARGET") or DEFAULT_TARGET


def finish_reason_name(reason: int) -> str:
    """``FINISH_REASON_STOP`` -> ``"stop"`` (also length, abort, error, unspecified)."""
    name = worker_pb2.FinishReason.Name(reason)
    return name.removeprefix("FINISH_REASON_").lower()


class IncompleteStreamError(RuntimeError):
    """A Generate stream ended without its final ``complete`` message."""


@dataclass
class Completion:
    """A whole generation, as `complete()` gathers it from the stream."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    usage: dict[str, int]  # prompt_tokens, completion_tokens, cached_tokens
    ttft_ms: float
    total_time_ms: float
    stop_reason: str  # the stop string or token id that ended it, if any
    queue_time_ms: float = 0.0
    error_message: str = ""  # with finish_reason "error"
    logprobs: list[worker_pb2.TokenLogprob] = field(default_factory=list)
    # Speculative decoding: draft tokens the worker verified for it, and of those, accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


# ---------------------------------------------------------------- request building


def _chat_message(m: MessageLike) -> worker_pb2.ChatMessage:
    if isinstance(m, worker_pb2.ChatMessage):
        return m
    if isinstance(m, Mapping):
        try:
            return worker_pb2.ChatMessage(role=m["role"], content=m["content"])
        except KeyError as e:
            raise ValueError(f"a chat message needs 'role' and 'content', got {dict(m)!r}") from e
    if isinstance(m, tuple) and len(m) == 2:
        return worker_pb2.ChatMessage(role=m[0], content=m[1])
    raise ValueError(f"a chat message is a {{'role', 'content'}} mapping or a pair, got {m!r}")


def build_generate_request(
    prompt: str | None = None,
    *,
    messages: Iterable[MessageLike] | None = None,
    token_ids: Iterable[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop: str | Iterable[str] | None = None,
    stop_token_ids: Iterable[int] | None = None,
    ignore_eos: bool = False,
    top_logprobs: int | None = None,
    logprobs: bool = False,
    priority: int = 0,
    request_id: str | None = None,
    cache_salt: str | None = None,
    include_special_tokens: bool = False,
) -> worker_pb2.GenerateRequest:
    """The `GenerateRequest` for these arguments; see `WorkerClient.generate`.

    Sampling fields are set only when given (unset means the worker's default), and the
    ``sampling``/``stopping`` sub-messages are present only when one of their fields is.
    """
    given = [
        name
        for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "give exactly one of prompt, messages or token_ids"
            + (f" (got {', '.join(given)})" if given else "")
        )
    req = worker_pb2.GenerateRequest(
        request_id=request_id or "",
        priority=priority,
        logprobs=bool(logprobs or top_logprobs),
        top_logprobs=top_logprobs or 0,
        cache_salt=cache_salt or "",
        include_special_tokens=include_special_tokens,
    )
    if prompt is not None:
        req.text = prompt
    elif messages is not None:
        req.chat.messages.extend(_chat_message(m) for m in messages)
        req.chat.SetInParent()  # an empty list is still "chat" (the worker rejects it)
    else:
        assert token_ids is not None
        req.token_ids.ids.extend(int(t) for t in token_ids)
        req.token_ids.SetInParent()

    sampling = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
    }
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if sampling:
        req.sampling.CopyFrom(worker_pb2.SamplingParams(**sampling))

    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stop_ids = [int(t) for t in stop_token_ids or []]
    if max_tokens or stops or stop_ids or ignore_eos:
        req.stopping.CopyFrom(
            worker_pb2.StoppingCriteria(
                max_tokens=max_tokens or 0,
                stop=stops,
                stop_token_ids=stop_ids,
                ignore_eos=ignore_eos,
            )
        )
    return req


class CompletionBuilder:
    """Folds a Generate stream into a `Completion`: ``add()`` each response, then ``result()``."""

    def __init__(self) -> None:
        self.request_id = ""
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[worker_pb2.TokenLogprob] = []
        self.complete: worker_pb2.GenerateComplete | None = None

    def add(self, resp: worker_pb2.GenerateResponse) -> None:
        if resp.request_id:
            self.request_id = resp.request_id
        kind = resp.WhichOneof("response")
        if kind == "chunk":
            self.text.append(resp.chunk.text)
            self.token_ids.extend(resp.chunk.token_ids)
            self.logprobs.extend(resp.chunk.logprobs)
        elif kind == "complete":
            self.complete = resp.complete

    def result(self) -> Completion:
        c = self.complete
        if c is None:
            raise IncompleteStreamError(
                f"Generate stream for {self.request_id or 'a request'} ended without 'complete'"
            )
        return Completion(
            request_id=self.request_id,
            text="".join(self.text),
            token_ids=self.token_ids,
            finish_reason=finish_reason_name(c.finish_reason),
            usage={
                "prompt_tokens": c.usage.prompt_tokens,
                "completion_tokens": c.usage.completion_tokens,
                "cached_tokens": c.usage.cached_tokens,
            },
            ttft_ms=c.ttft_ms,
            total_time_ms=c.total_time_ms,
            stop_reason=c.stop_reason,
            queue_time_ms=c.queue_time_ms,
            error_message=c.error_message,
            logprobs=self.logprobs,
            spec_draft_tokens=c.spec_draft_tokens,
            spec_accepted_tokens=c.spec_accepted_tokens,
        )


# ---------------------------------------------------------------- channels


def _read_cert(root_certificates: bytes | str | os.PathLike[str] | None) -> bytes | None:
    if root_certificates is None or isinstance(root_certificates, bytes):
        return root_certificates
    with open(root_certificates, "rb") as f:
        return f.read()


def _base_metadata(token: str | None, metadata: Metadata | None) -> tuple[tuple[str, str], ...]:
    md = [(k.lower(), v) for k, v in metadata or ()]
    if token:
        md.append(("authorization", f"Bearer {token}"))
    return tuple(md)


class _Base:
    def __init__(
        self,
        target: str | None,
        *,
        secure: bool,
        root_certificates: bytes | str | os.PathLike[str] | None,
        token: str | None,
        metadata: Metadata | None,
        timeout: float | None,
        options: Sequence[tuple[str, Any]] | None,
        retry: bool,
    ) -> None:
        self.target = target or default_target()
        self.timeout = timeout
        self._metadata = _base_metadata(token, metadata)
        self._secure = secure or root_certificates is not None
        self._credentials = (
            grpc.ssl_channel_credentials(root_certificates=_read_cert(root_certificates))
            if self._secure
            else None
        )
        self._options = list(options or ())
        if retry and not any(k == "grpc.service_config" for k, _ in self._options):
            self._options += retry_channel_options()

    def _call_kwargs(
        self, timeout: float | None, metadata: Metadata | None = None,
        traceparent: str | None = None,
    ) -> dict[str, Any]:
        md = self._metadata + tuple((k.lower(), v) for k, v in metadata or ())
        given = {k for k, _ in md}
        md += tuple(kv for kv in trace_context_metadata(traceparent) if kv[0] not in given)
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": md or None,
        }


class WorkerClient(_Base):
    """Blocking client. Every call takes ``timeout`` (seconds; default: the client's).

    ``secure=True`` (or ``root_certificates``, PEM bytes or a path) uses TLS; ``token``
    adds ``authorization: Bearer <token>``; ``metadata`` is sent with every call.
    ``retry`` (default on) puts `RETRY_SERVICE_CONFIG` on the channel, unless ``options``
    bring a ``grpc.service_config`` of their own.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        secure: bool = False,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        token: str | None = None,
        metadata: Metadata | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        retry: bool = True,
    ) -> None:
        super().__init__(
            target,
            secure=secure,
            root_certificates=root_certificates,
            token=token,
            metadata=metadata,
            timeout=timeout,
            options=options,
            retry=retry,
        )
        if self._credentials is not None:
            self.channel = grpc.secure_channel(self.target, self._credentials, self._options)
        else:
            self.channel = grpc.insecure_channel(self.target, self._options)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    # -- generation

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        token_ids: Iterable[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Iterable[str] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        ignore_eos: bool = False,
        top_logprobs: int | None = None,
        logprobs: bool = False,
        priority: int = 0,
        request_id: str | None = None,
        cache_salt: str | None = None,
        include_special_tokens: bool = False,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        traceparent: str | None = None,
    ) -> Iterator[worker_pb2.GenerateResponse]:
        """Stream one generation: chunks, then one ``complete``.

        Exactly one of ``prompt`` (text, sent as is), ``messages`` (chat, rendered with
        the model's template; ``{"role", "content"}`` mappings or pairs) or ``token_ids``
        (ValueError otherwise, raised here, before anything is sent). ``max_tokens``
        None or 0 is the worker's default. The returned iterator is the gRPC call:
        ``.cancel()`` aborts the request; a failed call raises ``grpc.RpcError``.
        ``traceparent`` (W3C) joins that trace; by default the current OpenTelemetry
        span's, if any, is sent.
        """
        req = build_generate_request(
            prompt,
            messages=messages,
            token_ids=token_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            top_logprobs=top_logprobs,
            logprobs=logprobs,
            priority=priority,
            request_id=request_id,
            cache_salt=cache_salt,
            include_special_tokens=include_special_tokens,
        )
        return self.generate_request(req, timeout=timeout, metadata=metadata,
                                     traceparent=traceparent)

    def generate_request(
        self,
        request: worker_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        traceparent: str | None = None,
    ) -> Iterator[worker_pb2.GenerateResponse]:
        """Stream a ready-made `GenerateRequest` (``traceparent``: as in ``generate``)."""
        return self.stub.Generate(request, **self._call_kwargs(timeout, metadata, traceparent))

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """`generate` with the same arguments, gathered into a `Completion`.

        A failed call raises ``grpc.RpcError``; that includes a request the engine
        failed, which this worker ends with status INTERNAL. A ``complete`` with
        FINISH_REASON_ERROR (the proto still allows it) is returned as ``finish_reason
        == "error"`` with ``error_message``, not raised.
        """
        call = self.generate(prompt, **kwargs)
        acc = CompletionBuilder()
        try:
            for resp in call:
                acc.add(resp)
        except BaseException:
            call.cancel()  # type: ignore[attr-defined]
            raise
        return acc.result()

    # -- admin

    def abort(self, *request_ids: str, timeout: float | None = None) -> worker_pb2.AbortResponse:
        """Abort these requests; ``aborted_ids`` are those that were in flight."""
        return self.stub.Abort(
            worker_pb2.AbortRequest(request_ids=list(request_ids)), **self._call_kwargs(timeout)
        )

    def model_info(self, *, timeout: float | None = None) -> worker_pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(
            worker_pb2.GetModelInfoRequest(), **self._call_kwargs(timeout)
        )

    def load(self, *, timeout: float | None = None) -> worker_pb2.GetLoadResponse:
        return self.stub.GetLoad(worker_pb2.GetLoadRequest(), **self._call_kwargs(timeout))

    def status(self, *, timeout: float | None = None) -> worker_pb2.GetServerStatusResponse:
        return self.stub.GetServerStatus(
            worker_pb2.GetServerStatusRequest(), **self._call_kwargs(timeout)
        )

    def drain(self, *, timeout: float | None = None) -> worker_pb2.DrainResponse:
        return self.stub.Drain(worker_pb2.DrainRequest(), **self._call_kwargs(timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """``grpc.health.v1.Health/Check``: ``"SERVING"``, ``"NOT_SERVING"``, ..."""
        resp = self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), **self._call_kwargs(timeout)
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_until_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects (``grpc.FutureTimeoutError`` after ``timeout``)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # -- lifetime

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWorkerClient(_Base):
    """``grpc.aio`` client with `WorkerClient`'s methods; create it inside the event loop.

    ``generate`` is a plain method returning an async iterator (the call: ``.cancel()``
    aborts); the others are coroutines. ``await client.close()`` or ``async with``.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        secure: bool = False,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        token: str | None = None,
        metadata: Metadata | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        retry: bool = True,
    ) -> None:
        super().__init__(
            target,
            secure=secure,
            root_certificates=root_certificates,
            token=token,
            metadata=metadata,
            timeout=timeout,
            options=options,
            retry=retry,
        )
        if self._credentials is not None:
            self.channel = grpc.aio.secure_channel(self.target, self._credentials, self._options)
        else:
            self.channel = grpc.aio.insecure_channel(self.target, self._options)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    # -- generation

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        token_ids: Iterable[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Iterable[str] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        ignore_eos: bool = False,
        top_logprobs: int | None = None,
        logprobs: bool = False,
        priority: int = 0,
        request_id: str | None = None,
        cache_salt: str | None = None,
        include_special_tokens: bool = False,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        traceparent: str | None = None,
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """As `WorkerClient.generate`, as an async iterator: ``async for r in ...``."""
        req = build_generate_request(
            prompt,
            messages=messages,
            token_ids=token_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            top_logprobs=top_logprobs,
            logprobs=logprobs,
            priority=priority,
            request_id=request_id,
            cache_salt=cache_salt,
            include_special_tokens=include_special_tokens,
        )
        return self.generate_request(req, timeout=timeout, metadata=metadata,
                                     traceparent=traceparent)

    def generate_request(
        self,
        request: worker_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        traceparent: str | None = None,
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """Stream a ready-made `GenerateRequest` (``traceparent``: as in ``generate``)."""
        return self.stub.Generate(request, **self._call_kwargs(timeout, metadata, traceparent))

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """As `WorkerClient.complete`."""
        call = self.generate(prompt, **kwargs)
        acc = CompletionBuilder()
        try:
            async for resp in call:
                acc.add(resp)
        except BaseException:
            call.cancel()  # type: ignore[attr-defined]
            raise
        return acc.result()

    # -- admin

    async def abort(
        self, *request_ids: str, timeout: float | None = None
    ) -> worker_pb2.AbortResponse:
        return await self.stub.Abort(
            worker_pb2.AbortRequest(request_ids=list(request_ids)), **self._call_kwargs(timeout)
        )

    async def model_info(self, *, timeout: float | None = None) -> worker_pb2.GetModelInfoResponse:
        return await self.stub.GetModelInfo(
            worker_pb2.GetModelInfoRequest(), **self._call_kwargs(timeout)
        )

    async def load(self, *, timeout: float | None = None) -> worker_pb2.GetLoadResponse:
        return await self.stub.GetLoad(worker_pb2.GetLoadRequest(), **self._call_kwargs(timeout))

    async def status(self, *, timeout: float | None = None) -> worker_pb2.GetServerStatusResponse:
        return await self.stub.GetServerStatus(
            worker_pb2.GetServerStatusRequest(), **self._call_kwargs(timeout)
        )

    async def drain(self, *, timeout: float | None = None) -> worker_pb2.DrainResponse:
        return await self.stub.Drain(worker_pb2.DrainRequest(), **self._call_kwargs(timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        resp = await self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), **self._call_kwargs(timeout)
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_until_ready(self, timeout: float = 10.0) -> None:
        """Wait until the channel connects (``asyncio.TimeoutError`` after ``timeout``)."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    # -- lifetime

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

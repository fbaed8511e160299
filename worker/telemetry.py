"""Traces and logs: OpenTelemetry spans by hand, structlog lines for everything.

Tracing
    ``configure_tracing()`` once at start-up. It turns tracing on only when told to: by an
    ``exporter`` argument (tests pass an ``InMemorySpanExporter``), or by the standard
    variables: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``, or a comma list),
    or, when that is unset, any of ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` and
    ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``. ``..._PROTOCOL`` is ``grpc`` (default, :4317)
    or ``http/protobuf`` (:4318, ``/v1/traces``); the exporters read endpoint, headers,
    timeout, compression and certificates from ``OTEL_*`` themselves. Otherwise no SDK is
    installed and spans are non-recording.

    Per RPC (the door makes these calls; the adapters only translate)::

        with rpc_span("/llmworker.v1.WorkerService/Generate", context.invocation_metadata(),
                      context=context) as span:          # SERVER span, joins `traceparent`
            log = bind_request(request_id, span)          # request_id, trace_id, span_id
            gen = GenerationTrace(model, request_id, max_tokens=..., temperature=...,
                                  top_p=..., top_k=..., input_messages=chat or None,
                                  prompt=text or None, record_content=trace_content)
                                  # INTERNAL child `chat M` or `text_completion M`
            gen.event("queued"); ...; gen.event("first_token"); ...
            gen.finish("stop", input_tokens=12, output_tokens=30, output_text=text)
            log_request_summary(log, request_id=..., finish_reason="stop", ...)

    Only ``WorkerService`` RPCs are traced: the servicer opens ``rpc_span``; the health and
    reflection servicers (grpcio's own) never call it, so they make no spans.

    Even with tracing off the span ``rpc_span`` yields carries ids: the caller's (from
    ``traceparent``) or, without one, fresh random ones, so every log line about a request
    has a ``trace_id`` and a ``span_id`` to correlate by.

    The OpenTelemetry *global* tracer provider can be set only once per process. This module
    keeps its own current provider and takes all its spans from it; ``configure_tracing`` may
    be called again (tests do, with a fresh exporter each) and then replaces that provider,
    shutting the old one down. The global is set to the first SDK provider configured, for
    third-party code that asks ``trace.get_tracer()``; later calls leave it alone.

Logging
    ``configure_logging()`` once at start-up: structlog renders JSON lines when stderr is not a
    terminal and a readable console format when it is. The standard library's ``logging``
    (grpc's Python loggers, ``logging.getLogger(__name__)`` in our modules, ``warnings``)
    goes through the same processors via a ``ProcessorFormatter`` on the root handler. Every
    line has ``timestamp`` (ISO 8601, UTC), ``level``, ``logger`` and ``event``; lines logged
    while a span is current also get its ``trace_id`` and ``span_id``. (gRPC's C core writes
    its own lines straight to stderr; ``GRPC_VERBOSITY`` governs those.)
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any
from urllib.parse import unquote

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "GenerationTrace",
    "bind_request",
    "configure_logging",
    "configure_tracing",
    "get_logger",
    "input_messages_json",
    "log_request_summary",
    "monotonic_to_wall",
    "otlp_traces_protocol",
    "output_messages_json",
    "rpc_observers",
    "rpc_span",
    "shutdown_tracing",
    "traces_exporter_names",
    "tracing_enabled",
]

_INSTRUMENTATION = "llm-worker"
_PROPAGATOR = TraceContextTextMapPropagator()

# --------------------------------------------------------------------------------------------
# Tracing setup
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_provider: TracerProvider | None = None  # this module's current SDK provider; None = off
_tracer: trace.Tracer | None = None
_atexit_registered = False
_rng = random.Random()  # ids for untraced requests; private, so no one's seed() touches it


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


_log = logging.getLogger(__name__)

# What turns the OTLP exporter on when OTEL_TRACES_EXPORTER is unset. The specification's
# default is "otlp" always; ours is "otlp" only when one of these says where or how, so that
# a worker started on a laptop does not retry exports to a collector that is not there.
_OTLP_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)
TRACES_EXPORTERS = ("otlp", "console", "none")
OTLP_PROTOCOLS = ("grpc", "http/protobuf", "http/json")


def traces_exporter_names() -> list[str]:
    """The exporters ``OTEL_TRACES_EXPORTER`` asks for, in order, without repeats: a comma
    list of ``otlp``, ``console`` or ``none``. Unset or empty: ``["otlp"]`` if an
    ``OTEL_EXPORTER_OTLP_*`` endpoint or protocol variable is set, else none. ``none`` anywhere
    in the list means no exporter (a warning if it stands beside others). Unknown names are
    skipped with a warning, as the specification asks of invalid values."""
    raw = _env("OTEL_TRACES_EXPORTER")
    if not raw:
        return ["otlp"] if any(_env(v) for v in _OTLP_VARIABLES) else []
    names: list[str] = []
    for part in raw.split(","):
        name = part.strip().lower()
        if not name or name in names:
            continue
        if name not in TRACES_EXPORTERS:
            _log.warning("OTEL_TRACES_EXPORTER: unknown exporter %r skipped (known: %s)",
                         name[:64], ", ".join(TRACES_EXPORTERS))
            continue
        names.append(name)
    if "none" in names:
        if len(names) > 1:
            _log.warning("OTEL_TRACES_EXPORTER=%s names none beside other exporters; "
                         "tracing stays off", raw[:200])
        return []
    return names


def otlp_traces_protocol() -> str:
    """``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else
    ``grpc`` (Python's default): ``grpc`` or ``http/protobuf``. ``http/json`` has no Python
    exporter: it is sent as ``http/protobuf`` (same port and path; OTLP/HTTP receivers take
    both encodings), with a warning; any other value warns and means ``grpc``."""
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = _env(var).lower()
        if not value:
            continue
        if value == "http/json":
            _log.warning("%s=http/json: the Python OTLP exporter has no JSON encoding; "
                         "exporting traces as http/protobuf", var)
            return "http/protobuf"
        if value not in OTLP_PROTOCOLS:
            _log.warning("%s=%r is not one of %s; exporting traces with grpc",
                         var, value[:64], ", ".join(OTLP_PROTOCOLS))
            return "grpc"
        return value
    return "grpc"


def _package_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("llm-worker")
    except Exception:
        return None


def _resource(service_name: str) -> Resource:
    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; those win over
    # the argument, which only replaces the SDK's "unknown_service" default.
    res = Resource.create({})
    if str(res.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        res = res.merge(Resource({SERVICE_NAME: service_name}))
    version = _package_version()
    if version and SERVICE_VERSION not in res.attributes:
        res = res.merge(Resource({SERVICE_VERSION: version}))
    return res


def _env_exporter(name: str) -> SpanExporter:
    """One exporter of ``OTEL_TRACES_EXPORTER``. The OTLP exporters read the endpoint,
    headers, timeout, compression, certificates and ``OTEL_EXPORTER_OTLP_INSECURE`` from the
    environment themselves (general and ``_TRACES_`` variables); HTTP appends ``/v1/traces``
    to a general endpoint. (Python's exporters read ``*_TIMEOUT`` in seconds, not the
    specification's milliseconds.) Imported here: each pulls in its own transport."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    assert name == "otlp", name
    if otlp_traces_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()


def configure_tracing(
    service_name: str = "llm-worker", exporter: SpanExporter | None = None
) -> bool:
    """Turn tracing on if asked to; return whether it is on.

    ``exporter`` given: spans go to it synchronously (``SimpleSpanProcessor``). Else each
    exporter of ``OTEL_TRACES_EXPORTER`` (see `traces_exporter_names`) gets a batching
    processor (``OTEL_BSP_*`` tune it): ``otlp`` over gRPC (default, :4317) or HTTP
    (``http/protobuf``, :4318 ``/v1/traces``) as `otlp_traces_protocol` says, ``console``
    to stdout. None asked for: tracing stays off and no SDK provider is installed.
    ``OTEL_SDK_DISABLED=true`` turns it off in every case. The resource's ``service.name``
    is ``OTEL_SERVICE_NAME`` (or ``OTEL_RESOURCE_ATTRIBUTES``) if set, else
    ``service_name``. ``OTEL_SEMCONV_STABILITY_OPT_IN`` picks the RPC attribute names (see
    `rpc_span`). Calling again replaces the previous configuration (shut down first).
    """
    global _provider, _tracer, _atexit_registered, _rpc_names
    shutdown_tracing()
    _rpc_names = _rpc_semconv_mode()
    if _env_true("OTEL_SDK_DISABLED"):
        return False
    processors: list[SimpleSpanProcessor | BatchSpanProcessor]
    if exporter is not None:
        processors = [SimpleSpanProcessor(exporter)]
    else:
        processors = [BatchSpanProcessor(_env_exporter(n)) for n in traces_exporter_names()]
    if not processors:
        return False
    provider = TracerProvider(resource=_resource(service_name), shutdown_on_exit=False)
    for processor in processors:
        provider.add_span_processor(processor)
    with _lock:
        _provider = provider
        _tracer = provider.get_tracer(_INSTRUMENTATION, _package_version())
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            trace.set_tracer_provider(provider)  # only the first time; it can't be replaced
        if not _atexit_registered:
            atexit.register(shutdown_tracing)
            _atexit_registered = True
    return True


def tracing_enabled() -> bool:
    """Whether ``configure_tracing`` installed an exporter (spans are recorded)."""
    return _tracer is not None


def shutdown_tracing() -> None:
    """Flush pending spans and turn tracing off. Safe to call twice; also runs at exit."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# --------------------------------------------------------------------------------------------
# Spans
# --------------------------------------------------------------------------------------------


def _random_span_context() -> SpanContext:
    trace_id = _rng.getrandbits(128) or 1
    span_id = _rng.getrandbits(64) or 1
    return SpanContext(trace_id, span_id, is_remote=False)


def _start_span(
    name: str,
    context: Context | None,
    kind: SpanKind,
    attributes: Mapping[str, Any],
) -> Span:
    tracer = _tracer
    if tracer is not None:
        return tracer.start_span(name, context=context, kind=kind, attributes=attributes)
    # Off: no span is made. Hand back the parent's ids (the caller's, from `traceparent`)
    # or, with no parent, fresh random ones, so log lines still share a trace_id.
    parent = trace.get_current_span(context).get_span_context()
    return NonRecordingSpan(parent if parent.is_valid else _random_span_context())


def _carrier(invocation_metadata: Iterable[Any] | Mapping[str, Any] | None) -> dict[str, str]:
    """gRPC metadata (pairs, ``_Metadatum``s, ``grpc.aio.Metadata`` or a dict) as a dict."""
    if not invocation_metadata:
        return {}
    items = (
        invocation_metadata.items()
        if isinstance(invocation_metadata, Mapping)
        else invocation_metadata
    )
    carrier: dict[str, str] = {}
    for item in items:
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if isinstance(value, str):  # binary (-bin) values are never trace context
            carrier[key.lower()] = value
    return carrier


# gRPC status codes that mark a *server* span as an error (OpenTelemetry RPC conventions);
# the rest (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, CANCELLED, ...) are the client's doing.
# UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS:
_SERVER_ERROR_CODES = frozenset({2, 4, 12, 13, 14, 15})
_STATUS_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)

# Which RPC attribute names server spans carry, by OTEL_SEMCONV_STABILITY_OPT_IN (the
# migration switch OpenTelemetry instrumentations use): "old" (default) the names backends
# and opentelemetry-instrumentation-grpc use today: rpc.system, rpc.service, rpc.method
# ("Generate"), rpc.grpc.status_code (int); "new" (``rpc``) the current conventions':
# rpc.system.name, rpc.method fully qualified ("llmworker.v1.WorkerService/Generate"),
# rpc.response.status_code ("OK"); "dup" (``rpc/dup``) both, rpc.method taking the new form.
_rpc_names = "old"


def _rpc_semconv_mode() -> str:
    opted = {v.strip().lower() for v in os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")}
    return "dup" if "rpc/dup" in opted else "new" if "rpc" in opted else "old"


def _context_code(context: Any) -> tuple[int | None, str | None]:
    if context is None:
        return None, None
    try:
        code, details = context.code(), context.details()
    except Exception:
        return None, None
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    number = code.value[0] if code is not None and hasattr(code, "value") else code
    return number, details or None


def _deadline_passed(context: Any) -> bool:
    try:
        remaining = context.time_remaining() if context is not None else None
    except Exception:
        return False
    return remaining is not None and remaining <= 0


def _peer_attributes(context: Any) -> dict[str, Any]:
    """``network.peer.*`` from gRPC's peer string: ``ipv4:10.0.0.7:51234``,
    ``ipv6:[::1]:51234`` or ``unix:/path`` (``ipv4:a:p,b:q`` through a proxy: the first)."""
    try:
        peer = context.peer() if context is not None else None
    except Exception:
        return {}
    if not isinstance(peer, str) or ":" not in peer:
        return {}
    family, _, rest = peer.partition(":")
    rest = unquote(rest.split(",")[0])
    if family == "unix":
        return {"network.transport": "unix", "network.peer.address": rest} if rest else {}
    if family not in ("ipv4", "ipv6"):
        return {}
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return {}
    return {"network.transport": "tcp", "network.type": family,
            "network.peer.address": host.strip("[]"), "network.peer.port": int(port)}


# Called with (gRPC full method, status code name) as each RPC that opened an `rpc_span`
# ends, on the event loop, traced or not: worker.metrics counts RPCs by status. Must not raise.
rpc_observers: list[Callable[[str, str], None]] = []


def _finish_rpc_span(span: Span, context: Any, exc: BaseException | None) -> str:
    """Sets the span's status attributes; returns the status code's name ("OK", ...)."""
    code, details = _context_code(context)
    if code is None:
        if exc is None:
            code = 0  # OK
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            code = 4 if _deadline_passed(context) else 1  # DEADLINE_EXCEEDED or CANCELLED
        else:
            code = 2  # UNKNOWN: what gRPC reports for an unhandled exception
    name = _STATUS_NAMES[code] if 0 <= code < len(_STATUS_NAMES) else str(code)
    if _rpc_names != "new":
        span.set_attribute("rpc.grpc.status_code", code)
    if _rpc_names != "old":
        span.set_attribute("rpc.response.status_code", name)
    aborted = exc is not None and type(exc).__name__ == "AbortError"  # context.abort(...)
    if exc is not None and not aborted and isinstance(exc, Exception):
        span.record_exception(exc)
    if code in _SERVER_ERROR_CODES:
        if _rpc_names != "old":
            span.set_attribute("error.type", name)
        desc = details or (f"{type(exc).__name__}: {exc}" if exc is not None else None)
        span.set_status(Status(StatusCode.ERROR, desc))
    return name


@contextmanager
def rpc_span(
    method: str,
    invocation_metadata: Iterable[Any] | Mapping[str, Any] | None = None,
    *,
    context: Any = None,
    server_address: str | None = None,
    server_port: int | None = None,
) -> Iterator[Span]:
    """A SERVER span for one RPC, current for the ``with`` body; yields it.

    ``method`` is gRPC's full method name, with or without the leading slash
    (``"/llmworker.v1.WorkerService/Generate"``); the span is named without it
    (``{service}/{method}``) and carries the RPC attributes (names: see ``_rpc_names``;
    by default ``rpc.system``, ``rpc.service``, ``rpc.method`` and, at the end,
    ``rpc.grpc.status_code``), ``network.peer.address``/``port``, ``network.transport`` and
    ``network.type`` from ``context.peer()``, and ``server.address``/``server.port`` when
    given (the address clients dial; gRPC does not tell a servicer its ``:authority``). It
    joins the caller's trace from W3C ``traceparent``/``tracestate`` in
    ``invocation_metadata``. Pass the servicer ``context`` so the status code set by
    ``context.abort``/``set_code`` is recorded; without it, a normal exit is OK, a
    cancellation CANCELLED and any other exception UNKNOWN. The span's status is ERROR for
    the server-fault codes (UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE,
    DATA_LOSS) and unset otherwise; unexpected exceptions are recorded as span events.

    Safe around ``yield`` in an async-generator servicer: grpc.aio iterates it in one task,
    and one it closes from another task detaches nothing there (`_current`).
    Health and reflection are not traced: their servicers never call this.
    """
    full = method.lstrip("/")
    service, _, name = full.rpartition("/")
    parent = _PROPAGATOR.extract(_carrier(invocation_metadata))
    attributes: dict[str, Any] = {}
    if _rpc_names != "new":
        attributes.update({"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
    if _rpc_names != "old":
        attributes.update({"rpc.system.name": "grpc", "rpc.method": full})
    if _tracer is not None:  # the peer is parsed only for a span that is recorded
        attributes.update(_peer_attributes(context))
        if server_address:
            attributes["server.address"] = server_address
        if server_port is not None:
            attributes["server.port"] = server_port
    span = _start_span(full, parent, SpanKind.SERVER, attributes)
    try:
        with _current(span):
            failure: BaseException | None = None
            try:
                yield span
            except BaseException as exc:
                failure = exc
                raise
            finally:
                status = _finish_rpc_span(span, context, failure)
                for observe in rpc_observers:
                    observe(full, status)
    finally:
        span.end()


_ATTACHED: contextvars.ContextVar[bool] = contextvars.ContextVar("llmworker_rpc_span", default=False)


@contextmanager
def _current(span: Span) -> Iterator[None]:
    """`span` current for the body (trace.use_span's attach and detach). An abandoned
    stream's async generator may be closed by grpc.aio from another task, whose Context
    never held the attachment: detaching there fails, and OpenTelemetry logs an error with a
    traceback ("Failed to detach context", a few per hundred cancelled streams). Only the
    Context that made the attachment detaches; the other is discarded with its task anyway."""
    token = otel_context.attach(trace.set_span_in_context(span))
    mark = _ATTACHED.set(True)  # its reset fails exactly where the detach would
    try:
        yield
    finally:
        try:
            _ATTACHED.reset(mark)
            here = True
        except ValueError:  # "created in a different Context"
            here = False
        if here:
            otel_context.detach(token)


def monotonic_to_wall(t_monotonic: float) -> float:
    """A ``time.monotonic()`` reading (the engine's clock) as ``time.time()`` seconds."""
    return time.time() - (time.monotonic() - t_monotonic)


def _ns(timestamp_s: float | None) -> int | None:
    return None if timestamp_s is None else int(timestamp_s * 1e9)


def _field(message: Any, name: str) -> Any:
    return message[name] if isinstance(message, Mapping) else getattr(message, name)


def input_messages_json(messages: Iterable[Any]) -> str:
    """Chat messages (``{"role", "content"}`` mappings or objects with those attributes, e.g.
    our proto's ``ChatMessage``) as ``gen_ai.input.messages``: a JSON array in the GenAI
    conventions' message schema, ``[{"role": ..., "parts": [{"type": "text", "content":
    ...}]}]``."""
    return json.dumps(
        [{"role": str(_field(m, "role")),
          "parts": [{"type": "text", "content": str(_field(m, "content"))}]} for m in messages],
        ensure_ascii=False)


def output_messages_json(text: str, finish_reason: str) -> str:
    """One generated text as ``gen_ai.output.messages``: one assistant message (one choice)
    with its ``finish_reason``."""
    return json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": text}],
                        "finish_reason": finish_reason}], ensure_ascii=False)


class GenerationTrace:
    """The span of one generation, named ``{operation} {model}`` (``chat M`` or
    ``text_completion M``), INTERNAL (the model runs in this process), a child of the span
    current at construction (the RPC's), with the OpenTelemetry GenAI conventions'
    attributes: ``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.*``
    (those given), ``gen_ai.response.model``/``id`` and, at ``finish``,
    ``gen_ai.response.finish_reasons`` and ``gen_ai.usage.*``.

    ``operation``: ``chat`` or ``text_completion``; by default ``chat`` when
    ``input_messages`` are given (the request was chat messages), else ``text_completion``
    (text or token ids). Pass ``input_messages`` and ``prompt`` whenever the request has
    them: they are recorded only with ``record_content=True`` (``--trace-content``), as
    ``gen_ai.input.messages`` (the messages, or the prompt as one user message) and, at
    ``finish``, ``gen_ai.output.messages``: JSON strings of the conventions' message schema
    (span attributes cannot hold structures in OpenTelemetry Python).

    Events, in the order added: ``queued``, ``scheduled``, ``first_token``, ``preempted``,
    ``resumed`` (as they happen) and ``finished`` (added by ``finish``).

    Used as a context manager it is finished on the way out if the body did not finish it:
    with reason ``abort`` on cancellation, ``error`` on any other exception.
    """

    CHAT = "chat"
    TEXT_COMPLETION = "text_completion"
    # The conventions' well-known providers are vendors' APIs (openai, aws.bedrock, ...);
    # none is this worker. The value is open: ours names the flavour of the extra attributes
    # we add (llm_worker.*), as the conventions ask (aws.bedrock <-> aws.bedrock.*).
    PROVIDER = "llm_worker"

    def __init__(
        self,
        model: str,
        request_id: str,
        *,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None = None,
        priority: int | None = None,
        prompt: str | None = None,
        record_content: bool = False,
        operation: str | None = None,
        input_messages: Sequence[Any] | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        stop_sequences: Sequence[str] | None = None,
        choice_count: int | None = None,
        stream: bool | None = None,
        lora_name: str | None = None,
    ) -> None:
        if operation is None:
            operation = self.CHAT if input_messages is not None else self.TEXT_COMPLETION
        if operation not in (self.CHAT, self.TEXT_COMPLETION):
            raise ValueError(f"operation must be chat or text_completion, not {operation[:64]!r}")
        self.operation = operation
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": self.PROVIDER,
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.response.id": request_id,
            "gen_ai.output.type": "text",
        }
        optional = {
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": temperature,
            "gen_ai.request.top_p": top_p,
            "gen_ai.request.top_k": top_k,
            "gen_ai.request.seed": seed,
            "gen_ai.request.frequency_penalty": frequency_penalty,
            "gen_ai.request.presence_penalty": presence_penalty,
            "gen_ai.request.stop_sequences": list(stop_sequences) if stop_sequences else None,
            # Conditionally required: only when more than one candidate is asked for.
            "gen_ai.request.choice.count": choice_count if choice_count and choice_count > 1 else None,
            "gen_ai.request.stream": stream,
            "llm_worker.request.priority": priority,
            # The LoRA adapter the request ran with (absent: the base model).
            "llm_worker.request.lora_name": lora_name,
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        if record_content:
            if input_messages is not None:
                attributes["gen_ai.input.messages"] = input_messages_json(input_messages)
            elif prompt is not None:
                attributes["gen_ai.input.messages"] = input_messages_json(
                    [{"role": "user", "content": prompt}])
        self.record_content = record_content
        self._finished = False
        self._span = _start_span(f"{operation} {model}", None, SpanKind.INTERNAL, attributes)

    @property
    def span(self) -> Span:
        return self._span

    @property
    def trace_id_hex(self) -> str:
        return trace.format_trace_id(self._span.get_span_context().trace_id)

    @property
    def span_id_hex(self) -> str:
        return trace.format_span_id(self._span.get_span_context().span_id)

    @property
    def finished(self) -> bool:
        return self._finished

    def event(self, name: str, timestamp_s: float | None = None, **attrs: Any) -> None:
        """Add an event; ``timestamp_s`` is wall-clock (``time.time()``) seconds when the event
        is recorded after the fact (see ``monotonic_to_wall``), else now."""
        if not self._finished:
            self._span.add_event(name, attrs or None, timestamp=_ns(timestamp_s))

    def finish(
        self,
        finish_reason: str,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        *,
        output_text: str | None = None,
        error: str | None = None,
        cached_tokens: int | None = None,
        queue_time_ms: float | None = None,
        ttft_ms: float | None = None,
    ) -> None:
        """Record the outcome, add the ``finished`` event and end the span (once; later calls
        do nothing). ``finish_reason`` is ``stop``, ``length``, ``abort`` or ``error``; an
        ``error`` (or an ``error`` message) sets the span status to ERROR. ``ttft_ms``
        becomes ``gen_ai.response.time_to_first_chunk`` (seconds)."""
        if self._finished:
            return
        self._finished = True
        span = self._span
        values = {
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.usage.cache_read.input_tokens": cached_tokens,
            "gen_ai.response.time_to_first_chunk": None if ttft_ms is None else ttft_ms / 1000,
            "llm_worker.queue_time_ms": queue_time_ms,
        }
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        span.set_attributes({k: v for k, v in values.items() if v is not None})
        if self.record_content and output_text is not None:
            span.set_attribute("gen_ai.output.messages",
                               output_messages_json(output_text, finish_reason))
        span.add_event("finished", {"finish_reason": finish_reason})
        if error is not None or finish_reason == "error":
            span.set_attribute("error.type", "generation_error")
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def __enter__(self) -> GenerationTrace:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._finished:
            return
        if exc is None or isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.finish("abort")
        else:
            self.finish("error", error=f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------


def _add_trace_context(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Adds the current span's ids to lines that don't carry their own."""
    if "trace_id" not in event_dict:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event_dict["trace_id"] = trace.format_trace_id(ctx.trace_id)
            event_dict["span_id"] = trace.format_span_id(ctx.span_id)
    return event_dict


def _head_first(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Puts timestamp, level, logger and event first, so JSON lines read left to right."""
    head = {
        k: event_dict.pop(k) for k in ("timestamp", "level", "logger", "event") if k in event_dict
    }
    return head | event_dict


_HANDLER_MARK = "_llm_worker_handler"


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    number = logging.getLevelName(level.strip().upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}")
    return number


def configure_logging(
    fmt: str = "auto", level: str | int = "INFO", *, stream: IO[str] | None = None
) -> None:
    """Route structlog and the standard library's logging through one pipeline to ``stream``
    (default stderr), replacing the root logger's handlers.

    ``fmt``: ``"json"`` (one JSON object a line), ``"console"`` (readable, colours on a
    terminal) or ``"auto"`` (console when the stream is a terminal, JSON otherwise).
    """
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    is_tty = bool(isatty is not None and isatty())
    if fmt == "auto":
        fmt = "console" if is_tty else "json"
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be auto, json or console, not {fmt!r}")
    level_no = _level_number(level)

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_context,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.UnicodeDecoder(),
    ]
    if fmt == "json":
        final: list[Any] = [
            structlog.processors.format_exc_info,
            _head_first,
            structlog.processors.JSONRenderer(),
        ]
    else:
        final = [structlog.dev.ConsoleRenderer(colors=is_tty)]

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,  # a logger used before this call must see this setup
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)

    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if getattr(old, _HANDLER_MARK, False):
            old.close()
    root.addHandler(handler)
    root.setLevel(level_no)
    logging.captureWarnings(True)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger; ``name`` becomes the line's ``logger`` field."""
    return structlog.stdlib.get_logger(name)


def bind_request(
    request_id: str,
    span: Span | None = None,
    *,
    logger: structlog.stdlib.BoundLogger | None = None,
    **fields: Any,
) -> structlog.stdlib.BoundLogger:
    """A logger whose every line carries ``request_id``, ``trace_id`` (32 hex digits) and
    ``span_id`` (16) of ``span`` (default: the current span), plus ``fields``.

    Bound explicitly rather than through context variables, so it can be handed to code
    that runs outside the RPC's task. The ids are left out only if the span is invalid,
    which spans from ``rpc_span``/``GenerationTrace`` never are.
    """
    base = logger if logger is not None else get_logger("worker.request")
    ctx = (span if span is not None else trace.get_current_span()).get_span_context()
    if ctx.is_valid:
        fields["trace_id"] = trace.format_trace_id(ctx.trace_id)
        fields["span_id"] = trace.format_span_id(ctx.span_id)
    return base.bind(request_id=request_id, **fields)


def log_request_summary(
    logger: structlog.stdlib.BoundLogger,
    *,
    request_id: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    queue_time_ms: float | None = None,
    ttft_ms: float | None = None,
    total_time_ms: float | None = None,
    **fields: Any,
) -> None:
    """The one ``request finished`` line per request (INFO; WARNING if it ended in error).

    Pass the logger from ``bind_request`` so the line carries ``trace_id``/``span_id``."""
    times = {"queue_time_ms": queue_time_ms, "ttft_ms": ttft_ms, "total_time_ms": total_time_ms}
    for key, value in times.items():
        fields[key] = round(value, 3) if value is not None else None
    method = logger.warning if finish_reason == "error" else logger.info
    method(
        "request finished",
        request_id=request_id,
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        **fields,
    )

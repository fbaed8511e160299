"""Registers a servicer so that bytes which do not parse as the method's request message
get INVALID_ARGUMENT naming the message, instead of gRPC's UNKNOWN.

grpc.aio turns an exception in a request deserializer into UNKNOWN, which tells a client
nothing. Here the deserializer catches the parse error and hands the method a
`MalformedRequest`; a thin wrapper answers it before the servicer ever sees it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class MalformedRequest:
    message: str  # the request message's name
    error: str

    def detail(self) -> str:
        return f"the request is not a valid {self.message}: {self.error}"[:300]


def _deserializer(cls: type) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return MalformedRequest(cls.DESCRIPTOR.full_name, str(e) or "cannot parse")

    return parse


def _guard_unary(method: Callable[..., Any]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail())
        return await method(request, context)

    return handler


def _guard_stream(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail())
        async for response in method(request, context):
            yield response

    return handler


def _guard_writer(method: Callable[..., Any]) -> Callable[..., Any]:
    """A streaming method that writes with `context.write` (grpc.aio's other style, e.g. the
    health servicer's Watch): a coroutine, as grpc.aio tells the two styles apart."""
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail())
        await method(request, context)

    return handler


def _unimplemented(name: str) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented")

    return handler


def _guard(impl: Any, name: str, streaming: bool) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(impl):
        return _guard_stream(impl)
    if not inspect.iscoroutinefunction(impl):  # none, or the generated base's sync stub
        return _unimplemented(name)
    return _guard_writer(impl) if streaming else _guard_unary(impl)


def add_servicer(servicer: object, service: ServiceDescriptor, server: grpc.aio.Server) -> None:
    """Register every method of `service` (unary-unary or unary-stream) on `servicer`: its
    async methods (for a stream, an async generator or a coroutine that writes); any other
    answers UNIMPLEMENTED."""
    handlers = {}
    for m in service.methods:
        assert not m.client_streaming, f"{m.name}: client streaming is not handled here"
        request_cls = message_factory.GetMessageClass(m.input_type)
        response_cls = message_factory.GetMessageClass(m.output_type)
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else (
            grpc.unary_unary_rpc_method_handler)
        impl = _guard(getattr(servicer, m.name, None), m.name, m.server_streaming)
        handlers[m.name] = make(impl, request_deserializer=_deserializer(request_cls),
                                response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)

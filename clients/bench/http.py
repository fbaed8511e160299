"""A minimal HTTP/1.1 client on asyncio streams, enough to stream an OpenAI-style response.

One connection per request (``Connection: close``), so no pooling to get wrong; on loopback
or a LAN its set-up costs well under a millisecond, next to TTFTs of tens. Bodies arrive
chunked (``Transfer-Encoding: chunked``, what streaming servers send), with a
``Content-Length``, or until the server closes. ``https://`` URLs use the default TLS
context. Standard library only: the benchmark adds no dependency.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class HTTPError(RuntimeError):
    """A malformed response, or a status other than 200 (`status`, `body` keep the details)."""

    def __init__(self, message: str, status: int = 0, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]  # lower-case names
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def body_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked."""
        te = self.headers.get("transfer-encoding", "").lower()
        if "chunked" in te:
            while True:
                size_line = await self.reader.readline()
                if not size_line:
                    raise HTTPError("connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await self.reader.readline()).strip():  # trailers, then CRLF
                        pass
                    return
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)  # the CRLF after each chunk
                yield data
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await self.reader.read(min(left, 65536))
                if not data:
                    raise HTTPError("connection closed before Content-Length bytes")
                left -= len(data)
                yield data
        else:
            while data := await self.reader.read(65536):
                yield data

    async def read_all(self) -> bytes:
        return b"".join([c async for c in self.body_chunks()])

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, ssl.SSLError):
            pass


async def request(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
) -> Response:
    """Send one request (`body` as JSON when given); the caller reads and closes the reply."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    ctx = ssl.create_default_context() if u.scheme == "https" else None
    reader, writer = await asyncio.open_connection(u.hostname, port, ssl=ctx)
    payload = b"" if body is None else json.dumps(body).encode()
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {u.netloc}",
        "Connection: close",
        "Accept: application/json, text/event-stream",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
    await writer.drain()
    try:
        status_line = (await reader.readline()).decode("latin-1").strip()
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP response: {status_line!r}")
        resp_headers: dict[str, str] = {}
        while line := (await reader.readline()).decode("latin-1").strip():
            name, _, value = line.partition(":")
            resp_headers[name.strip().lower()] = value.strip()
    except BaseException:
        writer.close()
        raise
    return Response(int(parts[1]), parts[2] if len(parts) > 2 else "", resp_headers, reader, writer)


async def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    resp = await request("GET", url, headers=headers)
    try:
        body = await resp.read_all()
    finally:
        await resp.close()
    if resp.status != 200:
        raise HTTPError(f"GET {url}: {resp.status} {resp.reason}", resp.status, body.decode())
    return json.loads(body)

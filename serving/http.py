"""The small HTTP/1.1 server the emulated workers speak (asyncio streams, loopback, no dependencies).

One request per connection (every answer says ``Connection: close``), bodies of at most
``MAX_BODY_BYTES``, JSON and text answers with a ``Content-Length``, and server-sent events (``data:
<json>`` lines, ended by ``data: [DONE]`` and the connection's close) for streams. Enough for the
gateways and clients the workers serve (smg, sglang-router, httpx, aiohttp); not a general server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

try:  # several times faster on the large token-id bodies of long prompts; sglang-router depends on it
    import orjson
except ImportError:  # pragma: no cover - the serving extra installs it
    orjson = None  # type: ignore[assignment]

MAX_BODY_BYTES = 64 * 2**20

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class HttpError(Exception):
    """Answer the request with ``status`` and a JSON error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Lower-case names."""
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON (an empty body is ``{}``); ``HttpError(400)`` when it is not JSON."""
        if not self.body:
            return {}
        try:
            return loads(self.body)
        except ValueError as exc:
            raise HttpError(400, f"request body is not JSON: {exc}") from None


async def read_request(reader: asyncio.StreamReader) -> HttpRequest:
    """Read one request; ``HttpError`` for a malformed or oversized one."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpError(400, "request head too large") from None
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3:
        raise HttpError(400, f"malformed request line {request_line!r}")
    method, target, _ = parts
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(400, "malformed Content-Length") from None
    if length > MAX_BODY_BYTES:
        raise HttpError(413, "request body too large")
    body = await reader.readexactly(length) if length > 0 else b""
    url = urlsplit(target)
    return HttpRequest(method.upper(), url.path or "/", dict(parse_qsl(url.query)), headers, body)


def loads(data: bytes | str) -> Any:
    """Parse JSON (orjson when installed)."""
    return orjson.loads(data) if orjson is not None else json.loads(data)


def dumps(obj: Any) -> bytes:
    """Encode JSON (orjson when installed; numpy integers and arrays allowed)."""
    if orjson is not None:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(obj, default=_plain).encode()


def _plain(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)
    if tolist is None:
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")
    return tolist()


_KEEP_ALIVE: weakref.WeakKeyDictionary[asyncio.StreamWriter, bool] = weakref.WeakKeyDictionary()
"""Connections of a ``keep_alive`` server whose current request may be followed by another one."""


def _head(status: int, content_type: str, length: int | None, keep_alive: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"Content-Type: {content_type}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [
        "Cache-Control: no-cache",
        "Connection: keep-alive" if keep_alive else "Connection: close",
        "",
        "",
    ]
    return "\r\n".join(lines).encode("latin-1")


async def send_bytes(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str) -> None:
    writer.write(_head(status, content_type, len(body), _KEEP_ALIVE.get(writer, False)) + body)
    await writer.drain()


async def send_json(writer: asyncio.StreamWriter, status: int, payload: Any) -> None:
    await send_bytes(writer, status, dumps(payload), "application/json")


async def send_text(
    writer: asyncio.StreamWriter, status: int, text: str, content_type: str = "text/plain; charset=utf-8"
) -> None:
    await send_bytes(writer, status, text.encode(), content_type)


class SseStream:
    """A server-sent-event answer: ``await start()``, ``await send(...)`` per event, ``await done()``."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.started = False

    async def start(self) -> None:
        _KEEP_ALIVE[self.writer] = False  # a stream ends with the connection
        self.writer.write(_head(200, "text/event-stream", None))
        self.started = True
        await self.writer.drain()

    async def send(self, event: Any) -> None:
        """One ``data:`` event: a JSON-able object, or an already encoded JSON string."""
        data = event.encode() if isinstance(event, str) else dumps(event)
        self.writer.write(b"data: " + data + b"\n\n")
        await self.writer.drain()

    async def done(self) -> None:
        self.writer.write(b"data: [DONE]\n\n")
        await self.writer.drain()


Handler = Callable[[HttpRequest, asyncio.StreamWriter], Awaitable[None]]


class HttpServer:
    """Serves ``handler`` on ``host:port`` (0: a free port). ``await start()``; ``await stop()``
    closes the socket and cancels the requests still being answered. With ``keep_alive`` a
    connection serves further requests after an answer with a ``Content-Length`` (unless the client
    sent ``Connection: close``); a stream still ends its connection."""

    def __init__(
        self, handler: Handler, host: str = "127.0.0.1", port: int = 0, *, keep_alive: bool = False
    ) -> None:
        self.handler = handler
        self.keep_alive = keep_alive
        self.host, self.port = host, port
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            while True:
                try:
                    request = await read_request(reader)
                    _KEEP_ALIVE[writer] = (
                        self.keep_alive and request.headers.get("connection", "").lower() != "close"
                    )
                    await self.handler(request, writer)
                except HttpError as exc:
                    _KEEP_ALIVE[writer] = False
                    await send_json(
                        writer, exc.status, {"error": {"message": exc.message, "code": exc.status}}
                    )
                if not _KEEP_ALIVE.get(writer, False):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except asyncio.CancelledError:
            # stop() (or the loop's end) cancelled the connection: this task is the top of its own
            # stack, so it ends here. Ending cancelled would make Python 3.11's start_server callback
            # call task.exception() and log a CancelledError traceback per open connection.
            pass
        finally:
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.close()


__all__ = [
    "MAX_BODY_BYTES",
    "HttpError",
    "HttpRequest",
    "HttpServer",
    "SseStream",
    "dumps",
    "loads",
    "read_request",
    "send_bytes",
    "send_json",
    "send_text",
]

"""A lean HTTP/1.1 client for the router's upstream legs: keep-alive connection pools per worker.

The router sends two requests per client request (the prefill and the decode leg) to workers on
loopback or a cluster network. A general client (httpx) spends more time in its own machinery than
the router spends routing; this one does only what those legs need, on asyncio streams:

* **Pools.** One pool of idle connections per ``(host, port)``: a connection goes back to its pool
  after a response that was read to its end and did not say ``Connection: close``; anything else
  (an error, a cancellation, a body not read to its end, a body delimited by the connection's close)
  closes it. A pooled connection the server has closed meanwhile is skipped, and a request whose
  reused connection turns out dead before a single byte of the answer came (the server closed an
  idle keep-alive connection as the request went out) is sent once more on a fresh connection.
* **Bodies.** ``Content-Length``, ``Transfer-Encoding: chunked`` (SGLang's streams, uvicorn's), or
  until the connection closes (the emulated workers' streams). ``Response.lines()`` yields the body's
  lines as text (server-sent events), ``Response.read()`` the whole body.
* **Time.** ``connect_timeout_s`` to open a connection; every read of one exchange (the head, each
  line or chunk) must be done by the exchange's deadline, ``timeout_s`` after it was sent.
* **Errors.** Every transport failure (refused, reset, cut, timed out, a malformed answer) is an
  ``UpstreamError`` naming its cause; an HTTP error status is an answer, not an error.

Not a general client: no TLS, no proxies, no redirects, no cookies, no compression, HTTP/1.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from serving.http import dumps

STREAM_LIMIT_BYTES = 16 * 2**20
"""The longest line (or head) a response may have: a server-sent event carrying many token ids fits."""

_Origin = tuple[str, int]


class UpstreamError(Exception):
    """A transport-level failure of one exchange (nothing usable came back)."""


def _origin(url: str) -> tuple[_Origin, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"upstream URL must be http://HOST[:PORT]/..., got {url!r}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return (parts.hostname, parts.port or 80), path


class _Connection:
    __slots__ = ("origin", "reader", "reused", "writer")

    def __init__(self, origin: _Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.origin, self.reader, self.writer = origin, reader, writer
        self.reused = False

    @property
    def alive(self) -> bool:
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Response:
    """An answer whose head was read: ``status``, ``headers`` (lower-case names); read the body with
    ``read()`` or ``lines()``, then ``close()`` (which keeps the connection when it may be reused)."""

    def __init__(
        self,
        client: UpstreamClient,
        conn: _Connection,
        status: int,
        headers: dict[str, str],
        deadline: float,
        no_body: bool,
    ) -> None:
        self.status, self.headers = status, headers
        self._client, self._conn, self._deadline = client, conn, deadline
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        try:
            self._left: int | None = 0 if no_body else (int(length) if length is not None else None)
        except ValueError:
            raise UpstreamError(f"malformed Content-Length {length!r}") from None
        if self._chunked:
            self._left = None
        self._keep = headers.get("connection", "").lower() != "close" and (
            self._chunked or self._left is not None
        )
        self._done = self._left == 0 and not self._chunked
        self._closed = False

    async def _io(self, awaitable: Any) -> Any:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await awaitable
        except TimeoutError:
            raise UpstreamError("ReadTimeout: no answer within the request's timeout") from None
        except asyncio.IncompleteReadError:
            raise UpstreamError("RemoteProtocolError: the connection closed mid-answer") from None
        except asyncio.LimitOverrunError:
            raise UpstreamError("RemoteProtocolError: an answer line is too long") from None
        except (OSError, ValueError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None

    async def _chunk_size(self) -> int:
        line = await self._io(self._conn.reader.readuntil(b"\r\n"))
        try:
            return int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise UpstreamError(f"RemoteProtocolError: malformed chunk size {line[:40]!r}") from None

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body as it comes (chunks, or reads of up to 64 KiB)."""
        reader = self._conn.reader
        if self._done:
            return
        if self._chunked:
            while True:
                size = await self._chunk_size()
                if size == 0:
                    while (await self._io(reader.readuntil(b"\r\n"))) != b"\r\n":
                        pass  # trailers
                    self._done = True
                    return
                data = await self._io(reader.readexactly(size + 2))
                yield data[:-2]
        elif self._left is not None:
            while self._left > 0:
                data = await self._io(reader.read(min(self._left, 2**16)))
                if not data:
                    raise UpstreamError("RemoteProtocolError: the connection closed mid-answer")
                self._left -= len(data)
                yield data
            self._done = True
        else:
            while data := await self._io(reader.read(2**16)):
                yield data
            self._done = True

    async def read(self) -> bytes:
        """The whole body."""
        reader = self._conn.reader
        if self._left is not None and self._left > 0 and not self._chunked:
            data = await self._io(reader.readexactly(self._left))
            self._left, self._done = 0, True
            return bytes(data)
        return b"".join([piece async for piece in self._pieces()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as text, without their line ends (an event stream's ``data:`` lines)."""
        if not self._chunked and self._left is None:  # until the close: read lines straight
            reader = self._conn.reader
            while True:
                raw = await self._io(reader.readline())
                if not raw:
                    self._done = True
                    return
                yield raw.rstrip(b"\r\n").decode()
        tail = b""
        async for piece in self._pieces():
            tail += piece
            *complete, tail = tail.split(b"\n")
            for raw in complete:
                yield raw.rstrip(b"\r").decode()
        if tail:
            yield tail.rstrip(b"\r").decode()

    async def close(self) -> None:
        """Give the connection back to its pool (the body read to its end, keep-alive) or close it."""
        if self._closed:
            return
        self._closed = True
        if self._done and self._keep:
            self._client._release(self._conn)
        else:
            self._conn.close()


class UpstreamClient:
    """Keep-alive pools and exchanges (see the module docstring). ``await aclose()`` at the end."""

    def __init__(
        self,
        *,
        timeout_s: float = 3600.0,
        connect_timeout_s: float = 5.0,
        max_idle_per_origin: int = 256,
    ) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[_Origin, deque[_Connection]] = {}
        self._closed = False
        self.connects = 0
        """Connections opened so far (a test of reuse reads it)."""

    async def _connect(self, origin: _Origin) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(*origin, limit=STREAM_LIMIT_BYTES)
        except TimeoutError:
            raise UpstreamError(f"ConnectTimeout: {origin[0]}:{origin[1]}") from None
        except OSError as exc:
            raise UpstreamError(f"ConnectError: {exc}") from None
        self.connects += 1
        return _Connection(origin, reader, writer)

    def _acquire_idle(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.alive:
                conn.reused = True
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin, deque())
        if self._closed or not conn.alive or len(idle) >= self.max_idle_per_origin:
            conn.close()
        else:
            idle.append(conn)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        """Send one request; the answer once its head is read (read its body, then ``close()`` it).
        ``UpstreamError`` on a transport failure."""
        if self._closed:
            raise UpstreamError("the upstream client is closed")
        origin, path = _origin(url)
        deadline = asyncio.get_running_loop().time() + (self.timeout_s if timeout_s is None else timeout_s)
        head = [f"{method} {path} HTTP/1.1", f"Host: {origin[0]}:{origin[1]}"]
        if body is not None:
            head.append(f"Content-Length: {len(body)}")
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}")
        wire = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        conn = self._acquire_idle(origin)
        if conn is None:
            conn = await self._connect(origin)
        while True:
            try:
                return await self._exchange(conn, method, wire, deadline)
            except _StaleConnection:
                conn = await self._connect(origin)  # the reused one was dead: once more, fresh
            except BaseException:
                conn.close()
                raise

    async def _exchange(self, conn: _Connection, method: str, wire: bytes, deadline: float) -> Response:
        reader, writer = conn.reader, conn.writer
        try:
            async with asyncio.timeout_at(deadline):
                writer.write(wire)
                await writer.drain()
                raw = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            partial = getattr(exc, "partial", b"")
            if conn.reused and not partial:
                conn.close()
                raise _StaleConnection from None
            raise UpstreamError(
                f"RemoteProtocolError: the connection closed before an answer ({type(exc).__name__})"
            ) from None
        except TimeoutError:
            raise UpstreamError("ReadTimeout: no answer within the request's timeout") from None
        except asyncio.LimitOverrunError:
            raise UpstreamError("RemoteProtocolError: the answer's head is too long") from None
        except OSError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        status_line, _, rest = raw.decode("latin-1").partition("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise UpstreamError(f"RemoteProtocolError: malformed status line {status_line[:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in rest.split("\r\n"):
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if parts[0] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        return Response(self, conn, status, headers, deadline, no_body)

    async def fetch(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes]:
        """One exchange read to its end: ``(status, body)``."""
        resp = await self.request(method, url, body, headers=headers, timeout_s=timeout_s)
        try:
            return resp.status, await resp.read()
        finally:
            await resp.close()

    async def post_json(self, url: str, payload: Any, *, timeout_s: float | None = None) -> tuple[int, bytes]:
        """POST ``payload`` as JSON: ``(status, body)``."""
        return await self.fetch("POST", url, dumps(payload), headers=JSON_HEADERS, timeout_s=timeout_s)

    async def get(self, url: str, *, timeout_s: float | None = None) -> tuple[int, bytes]:
        """GET ``url``: ``(status, body)``."""
        return await self.fetch("GET", url, timeout_s=timeout_s)

    async def aclose(self) -> None:
        """Close every idle connection; answers still being read close theirs when done."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()


class _StaleConnection(Exception):
    pass


JSON_HEADERS = {"Content-Type": "application/json"}


__all__ = ["JSON_HEADERS", "Response", "UpstreamClient", "UpstreamError"]

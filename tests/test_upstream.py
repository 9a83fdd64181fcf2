"""The router's upstream client (``serving.upstream``) against raw loopback servers: keep-alive reuse,
the three body framings, a pooled connection the server closed, timeouts, refused connections and
cancellation (a connection in use when cancelled is never pooled)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from serving.upstream import UpstreamClient, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw server on loopback; yields its URL and a list counting the connections it accepted."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.decode().split("\r\n"):
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    return await reader.readexactly(length)


def _run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=20))  # type: ignore[arg-type]


def test_keep_alive_connections_are_reused_and_bodies_by_content_length() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()

    async def main() -> None:
        async with _server(echo) as (url, accepted):
            client = UpstreamClient()
            for i in range(5):
                status, body = await client.post_json(url + "/x", {"i": i})
                assert status == 200 and body == b'{"i":%d}' % i
            assert client.connects == 1 and len(accepted) == 1, "one connection, reused"
            await client.aclose()

    _run(main())


def test_chunked_and_close_delimited_streams_yield_their_lines() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for piece in (b"data: 1\n\nda", b"ta: 2\n\n", b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\ndata: 1\n\ndata: [DONE]\n\n")
        await writer.drain()

    async def main() -> None:
        client = UpstreamClient()
        async with _server(chunked) as (url, accepted):
            for _ in range(2):
                resp = await client.request("POST", url, b"{}")
                lines = [line async for line in resp.lines()]
                await resp.close()
                assert [x for x in lines if x] == ["data: 1", "data: 2", "data: [DONE]"]
            assert len(accepted) == 1, "a chunked stream read to its end keeps its connection"
        async with _server(until_close) as (url, accepted):
            for _ in range(2):
                resp = await client.request("POST", url, b"{}")
                assert [x async for x in resp.lines() if x] == ["data: 1", "data: [DONE]"]
                await resp.close()
            assert len(accepted) == 2, "a body delimited by the close ends its connection"
        await client.aclose()

    _run(main())


def test_a_pooled_connection_the_server_closed_is_replaced_once() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)  # answers keep-alive, then closes without saying so
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async def main() -> None:
        async with _server(one_per_connection) as (url, accepted):
            client = UpstreamClient()
            for _ in range(3):
                assert await client.post_json(url, {}) == (200, b"ok")
                await asyncio.sleep(0.05)  # the server's close reaches the pooled connection
            assert len(accepted) == 3
            for _ in range(3):  # at once: the close may come while the request goes out
                assert await client.post_json(url, {}) == (200, b"ok")
            assert len(accepted) == 6
            await client.aclose()

    _run(main())


def test_transport_failures_are_upstream_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(10)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        client = UpstreamClient()
        async with _server(silent) as (url, _):
            with pytest.raises(UpstreamError, match="ReadTimeout"):
                await client.post_json(url, {}, timeout_s=0.2)
        async with _server(cut) as (url, _):
            with pytest.raises(UpstreamError, match="closed mid-answer"):
                await client.post_json(url, {})
        async with _server(garbage) as (url, _):
            with pytest.raises(UpstreamError, match="malformed status line"):
                await client.post_json(url, {})
        with pytest.raises(UpstreamError, match="ConnectError"):
            await client.post_json(url, {})  # that server is gone
        with pytest.raises(ValueError, match="http://"):
            await client.post_json("https://127.0.0.1:1/x", {})
        await client.aclose()

    _run(main())


def test_a_cancelled_exchange_closes_its_connection() -> None:
    async def slow_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(10)

    async def main() -> None:
        async with _server(slow_stream) as (url, accepted):
            client = UpstreamClient()

            async def consume() -> None:
                resp = await client.request("POST", url, b"{}")
                try:
                    async for _ in resp.lines():
                        pass
                finally:
                    await resp.close()

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not any(client._idle.values()), "a half-read connection is never pooled"
            resp = await client.request("POST", url, b"{}")
            await resp.close()
            assert len(accepted) == 2
            await client.aclose()

    _run(main())

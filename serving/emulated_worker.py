"""An SGLang-like worker that runs on a CPU: its iteration timing comes from ``envs.cost_model``.

It serves the part of SGLang's native HTTP API that clients of a single worker use —
``POST /generate`` (``input_ids`` or ``text``, ``sampling_params.max_new_tokens`` / ``ignore_eos``,
``stream``), ``GET /health``, ``GET /model_info`` and ``GET /server_info`` (also under their older
``/get_`` names; with ``max_total_num_tokens`` and ``chunked_prefill_size``) — and schedules
requests like SGLang does: FCFS chunked prefill mixed into continuous-batching decode iterations,
one token per running request per iteration, each iteration lasting what the cost model says
(times ``time_scale``). Streaming responses are server-sent events (``data: {json}`` lines, then
``data: [DONE]``); a client that disconnects aborts its request.

It is what the real-GPU profiler (``serving.profiler``) is tested against, and a stand-in for one
aggregated (non-PD) worker behind a gateway in regular mode. Its scheduling is its own, simpler than
the simulator's; the emulated PD cluster (``serving.pd_cluster``) runs the simulator itself.

    python -m serving.emulated_worker --gpu H200 --model gpt-oss-120b --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from envs.cost_model import CostModel
from serving.http import HttpRequest, HttpServer, SseStream, send_json


@dataclass
class _Req:
    rid: int
    input_tokens: int
    max_new_tokens: int
    stream: bool
    queue: asyncio.Queue[dict[str, Any] | None]
    prefilled: int = 0
    generated: int = 0
    aborted: bool = False


@dataclass
class WorkerStats:
    """Counters a test or a user can read while the worker runs."""

    iterations: int = 0
    mixed_iterations: int = 0
    finished: int = 0
    aborted: int = 0
    iteration_times_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))


class EmulatedWorker:
    """One emulated SGLang worker. ``await start()`` binds; ``await stop()`` shuts it down."""

    def __init__(
        self,
        cost_model: CostModel,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        chunked_prefill_size: int = 8192,
        max_running_requests: int = 256,
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.cm = cost_model
        self.host, self.port = host, port
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.time_scale = time_scale
        self.stats = WorkerStats()
        self._ids = itertools.count()
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._wake = asyncio.Event()
        self._http = HttpServer(self._route, host, port)
        self._loop_task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self._http.start()
        self.port = self._http.port
        self._loop_task = asyncio.create_task(self._schedule_loop())

    async def stop(self) -> None:
        await self._http.stop()  # open streams end with the worker
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.cm.model.name,
            "tp_size": self.cm.tp,
            "max_total_num_tokens": self.cm.kv_capacity_tokens,
            "chunked_prefill_size": self.chunked_prefill_size,
            "max_running_requests": self.max_running_requests,
            "version": "crossflow-emulated",
            "gpu": self.cm.gpu.name,
            "time_scale": self.time_scale,
        }

    # ---------------------------------------------------------------- scheduler
    async def _schedule_loop(self) -> None:
        while True:
            self._running = [r for r in self._running if not r.aborted]
            while self._waiting and self._waiting[0].aborted:
                self._waiting.popleft()
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            budget = self.chunked_prefill_size
            chunks: list[tuple[_Req, int]] = []
            room = self.max_running_requests - len(self._running)
            for req in self._waiting:
                if budget <= 0 or len(chunks) >= room:
                    break
                take = min(req.input_tokens - req.prefilled, budget)
                chunks.append((req, take))
                budget -= take
            decoding = list(self._running)
            context = sum(r.input_tokens + r.generated for r in decoding)
            dt = self.cm.iteration_time_s([(t, r.prefilled) for r, t in chunks], len(decoding), context)
            await asyncio.sleep(dt * self.time_scale)
            self.stats.iterations += 1
            self.stats.mixed_iterations += bool(chunks and decoding)
            self.stats.iteration_times_s.append(dt * self.time_scale)
            for req in decoding:
                self._emit(req)
            for req, take in chunks:
                req.prefilled += take
                if req.prefilled >= req.input_tokens:
                    self._waiting.remove(req)
                    self._emit(req)  # the prefill iteration produces the first token
                    if req.generated < req.max_new_tokens and not req.aborted:
                        self._running.append(req)
            self._running = [r for r in self._running if r.generated < r.max_new_tokens and not r.aborted]

    def _emit(self, req: _Req) -> None:
        if req.aborted:
            return
        req.generated += 1
        done = req.generated >= req.max_new_tokens
        meta = {
            "id": str(req.rid),
            "prompt_tokens": req.input_tokens,
            "completion_tokens": req.generated,
            "finish_reason": {"type": "length", "length": req.max_new_tokens} if done else None,
        }
        if req.stream or done:
            req.queue.put_nowait(
                {"text": " tok" * req.generated if not req.stream else " tok", "meta_info": meta}
            )
        if done:
            self.stats.finished += 1
            req.queue.put_nowait(None)

    # ---------------------------------------------------------------- HTTP
    async def _route(self, request: HttpRequest, writer: asyncio.StreamWriter) -> None:
        method, path = request.method, request.path
        if method == "GET" and path in ("/health", "/health_generate"):
            await send_json(writer, 200, {})
        elif method == "GET" and path in ("/model_info", "/get_model_info"):
            await send_json(writer, 200, {"model_path": self.cm.model.name, "is_generation": True})
        elif method == "GET" and path in ("/server_info", "/get_server_info"):
            await send_json(writer, 200, self.server_info())
        elif method == "POST" and path == "/generate":
            await self._generate(request.json(), writer)
        else:
            await send_json(writer, 404, {"error": f"no route {method} {path}"})

    async def _generate(self, payload: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if "input_ids" in payload:
            n_in = len(payload["input_ids"])
        elif isinstance(payload.get("text"), str):
            n_in = max(1, len(payload["text"].split()))  # one token per word: good enough for timing
        else:
            await send_json(writer, 400, {"error": "field 'input_ids' or 'text' is required"})
            return
        params = payload.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        if n_in < 1 or max_new < 1 or n_in + max_new > self.cm.kv_capacity_tokens:
            await send_json(writer, 400, {"error": f"cannot serve {n_in} input + {max_new} output tokens"})
            return
        req = _Req(next(self._ids), n_in, max_new, bool(payload.get("stream")), asyncio.Queue())
        self._waiting.append(req)
        self._wake.set()
        try:
            if not req.stream:
                result = await req.queue.get()
                await req.queue.get()  # the end marker
                await send_json(writer, 200, result or {})
                return
            stream = SseStream(writer)
            await stream.start()
            while (item := await req.queue.get()) is not None:
                await stream.send(item)
            await stream.done()
        except (ConnectionError, asyncio.CancelledError):
            req.aborted = True
            self.stats.aborted += 1
            raise


class BackgroundWorker:
    """Run an :class:`EmulatedWorker` on its own event loop in a daemon thread (for tests and scripts)."""

    def __init__(self, worker: EmulatedWorker) -> None:
        self.worker = worker
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> EmulatedWorker:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.worker.start(), self._loop).result(timeout=10)
        return self.worker

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.worker.stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run an emulated SGLang worker timed by the cost model.")
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--model", default="gpt-oss-120b")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every iteration time")
    args = parser.parse_args(argv)
    worker = EmulatedWorker(
        CostModel(args.gpu, args.model, args.tp), host=args.host, port=args.port, time_scale=args.time_scale
    )

    async def serve() -> None:
        await worker.start()
        print(f"emulated {args.model} on {args.gpu} TP{args.tp} at {worker.url}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Replay a trace against a live SGLang-compatible server over HTTP and measure what a client sees.

A client of ``crossflow simulate``'s workload: it sends the trace's requests to ``POST /generate``
(SGLang's native API, streaming) and reports the figures of :class:`envs.metrics.RunMetrics`, so a
replay and a simulation of the same trace can be compared key by key.

- **Arrivals.** Open-loop traces keep their timestamps, divided by the load factor (as
  :func:`envs.arrivals.scale_load`). Closed-loop traces (agent sessions) start sessions as a Poisson
  process of ``session_rate_per_s * load`` drawn exactly as the simulator draws it (same seed, same
  generator), and release each request ``think_time_s`` after the request it ``depends_on`` ended
  (finished, refused or failed), or after its session started.
- **Prefix sharing.** Prompts are token ids built by :class:`PromptTokens` from the trace's prefix
  identity (``parent_id`` / ``shared_prefix_tokens``), so a request shares exactly its trace prefix
  with earlier requests and nothing else; radix caches and cache-aware routers see the sharing.
- **Output length.** Every request asks for its trace output length: ``max_new_tokens`` with
  ``ignore_eos: true``.
- **Measurement** follows SGLang's ``bench_serving`` client for ``/generate``
  (``sglang/benchmark/serving.py``, ``async_request_sglang_generate``): TTFT is the time from sending
  to the first event that carries a token; each later event that raises ``completion_tokens`` by k
  adds k inter-token intervals of (gap since the previous such event) / k; a request's latency ends
  at the last event of its stream. Tokens are counted from ``meta_info.completion_tokens`` (as
  bench_serving's batch recorder does), not from non-empty text, so a token that decodes to no text
  still counts. A request the server refuses (an HTTP error, an abort event with its ``status_code``,
  or SGLang's in-stream ``error`` event) counts as rejected.
- **Emulated time.** When ``/server_info`` reports ``crossflow_time_scale`` (an emulated cluster whose
  iterations take cost-model time x scale), the schedule is stretched by the scale and every measured
  time is divided by it, so the figures are in the cluster's emulated time.
- **Lag check.** When the workers report ``crossflow_lag`` (an emulated cluster), the replay asks
  each one (directly, or those a gateway lists at ``/workers``) how late its iterations ran behind
  their schedule during the replay; a lag beyond 5 % of the replay's wall duration fails the
  replay's check (``ReplayResult.lag_failure``): the host could not keep the emulation's schedule.
  The replay's own event loop is watched too (``client_lag_s``): against an emulation in scaled time,
  a client that falls that far behind fails the check as well (its stream timestamps are late).
- **Bounds.** At most the requests of the given trace, and at most ``timeout_s`` of wall time; what is
  still running then is cancelled and counted as unfinished.

Figures a client cannot observe (borrowed share, lease use, retractions, utilisation) are ``None``;
the prefix-hit share is known only when the server reports ``meta_info.cached_tokens`` (SGLang does).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx
import numpy as np

from envs.arrivals import poisson_session_starts, scale_load
from envs.cluster_config import ClusterConfig
from envs.live import lag_check
from envs.metrics import RunMetrics, weighted_quantiles
from envs.request import Request, Trace

TIME_SCALE_KEY = "crossflow_time_scale"
"""``/server_info`` key of an emulated cluster's time scale (wall seconds per emulated second)."""
LAG_KEY = "crossflow_lag"
"""``/server_info`` key of an emulated worker's lag behind its schedule (``max_s``, ``mean_s``, ...)."""
LAG_SINCE_PARAM = "crossflow_lag_since"
"""``/server_info`` query parameter of an emulated worker: report its lag from this Unix time on."""

METRIC_KEYS: tuple[str, ...] = tuple(f.name for f in fields(RunMetrics))
"""The metric names of a replay: exactly those of a simulation."""

UNOBSERVED_METRICS: frozenset[str] = frozenset(
    {
        "borrowed_share",
        "fallback_share",
        "borrowed_prefill_tokens",
        "local_share",
        "local_prefill_tokens",
        "lease_utilisation",
        "lease_granted_prefill_tokens",
        "n_rejected_context",
        "n_compacted",
        "retractions",
        "prefill_utilisation",
        "decode_utilisation",
    }
)
"""Metrics that only the cluster knows; a replay reports them as ``None``."""

_DEFAULT_SLO = ClusterConfig()


class PromptTokens:
    """Deterministic prompt token ids for the requests of a trace, keeping its prefix sharing.

    Token ``j`` of request ``r`` is token ``j`` of ``r.parent_id`` when ``j < r.shared_prefix_tokens``,
    and otherwise a token drawn uniformly from ``[first_token_id, vocab_size)`` by a generator seeded
    with ``(seed, r.request_id)``. So requests share (transitively) the leading tokens the trace says
    they share, and unrelated requests share none beyond chance (1 / vocabulary per position). The
    default range is a valid, non-special id range of every model in the catalog.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        *,
        vocab_size: int = 32000,
        first_token_id: int = 100,
        seed: int = 0,
        memo_size: int = 64,
    ) -> None:
        if not 0 <= first_token_id < vocab_size:
            raise ValueError(f"need 0 <= first_token_id < vocab_size, got {first_token_id}, {vocab_size}")
        self._requests = requests
        self._low, self._high = first_token_id, vocab_size
        self._seed = seed
        self._memo: OrderedDict[int, np.ndarray] = OrderedDict()
        self._memo_size = max(1, memo_size)

    def ids(self, request_id: int) -> np.ndarray:
        """The request's prompt as an ``int64`` array of ``input_tokens`` ids (do not modify it)."""
        memo = self._memo
        found = memo.get(request_id)
        if found is not None:
            memo.move_to_end(request_id)
            return found
        chain = [request_id]  # up to a memoised ancestor or a root, built top-down
        while True:
            r = self._requests[chain[-1]]
            if r.parent_id < 0 or r.shared_prefix_tokens == 0 or r.parent_id in memo:
                break
            chain.append(r.parent_id)
        built: np.ndarray | None = None
        for i, rid in enumerate(reversed(chain)):
            r = self._requests[rid]
            shared = r.shared_prefix_tokens if r.parent_id >= 0 else 0
            parent_ids = built if i > 0 else memo.get(r.parent_id) if shared else None
            shared = min(shared, len(parent_ids)) if parent_ids is not None else 0
            rng = np.random.default_rng([self._seed, rid])
            fresh = rng.integers(self._low, self._high, size=r.input_tokens - shared, dtype=np.int64)
            built = np.concatenate([parent_ids[:shared], fresh]) if parent_ids is not None else fresh
            memo[rid] = built
            memo.move_to_end(rid)
            while len(memo) > self._memo_size:
                memo.popitem(last=False)
        assert built is not None
        return built


@dataclass
class RequestRecord:
    """What one request did, as the client saw it. Times are wall seconds since the replay started."""

    request_id: int
    session_id: int
    input_tokens: int
    output_tokens: int
    """Asked for (``max_new_tokens``)."""
    send_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    """Time of the stream's last event; set only for a request that completed."""
    completion_tokens: int = 0
    """Tokens received (``meta_info.completion_tokens`` of the last event)."""
    itl_s: array[float] = field(default_factory=lambda: array("d"))
    """Inter-token intervals (8 bytes each: a long replay holds millions)."""
    cached_tokens: int | None = None
    """``meta_info.cached_tokens`` when the server reports it."""
    status: int | None = None
    """HTTP status, or the ``status_code`` of an abort event inside a 200 stream."""
    rejected: bool = False
    """The server refused it (HTTP error status or an abort event)."""
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_s is not None and not self.rejected and not self.error


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: target, load, bounds, prompt construction."""

    url: str
    """Base URL of the server or gateway (``http://127.0.0.1:30000``)."""
    load: float = 1.0
    """Open loop: divides arrival times; closed loop: multiplies the session start rate."""
    session_rate_per_s: float | None = None
    """Closed-loop traces: sessions started per second at load 1 (required for them)."""
    max_requests: int | None = None
    """At most this many requests are sent (closed loop: the first ones released)."""
    timeout_s: float = 600.0
    """Wall-clock bound of the whole replay."""
    time_scale: float | None = None
    """Wall seconds per emulated second; None = read ``crossflow_time_scale`` from ``/server_info``
    (1.0 when the server does not report it)."""
    seed: int = 0
    vocab_size: int = 32000
    endpoint: str = "/generate"
    slo_ttft_s: float = _DEFAULT_SLO.slo_ttft_s
    slo_tpot_s: float = _DEFAULT_SLO.slo_tpot_s

    def __post_init__(self) -> None:
        if not (self.load > 0 and math.isfinite(self.load)):
            raise ValueError(f"load must be positive and finite, got {self.load}")
        if not (self.timeout_s > 0):
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.time_scale is not None and not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be positive and finite, got {self.time_scale}")
        if self.session_rate_per_s is not None and not (self.session_rate_per_s > 0):
            raise ValueError(f"session_rate_per_s must be positive, got {self.session_rate_per_s}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")


@dataclass
class ReplayResult:
    """A finished (or cut short) replay: metrics in emulated time, and every request's record."""

    trace_name: str
    config: ReplayConfig
    time_scale: float
    time_scale_source: str
    """``"server_info"``, ``"argument"`` or ``"default"`` (the server reported none: wall time)."""
    server_info: dict[str, Any] | None
    metrics: dict[str, float | int | None]
    records: list[RequestRecord]
    wall_s: float
    timed_out: bool
    lag: list[dict[str, Any]] = field(default_factory=list)
    """Each emulated worker's lag during the replay (``url`` plus its ``crossflow_lag`` report)."""
    lag_failure: str | None = None
    """Why the emulation (or, against an emulation, the replay client) did not keep its schedule
    during the replay, or None (also for real servers)."""
    client_lag_s: float = 0.0
    """Largest delay of the replay's own event loop behind a 50 ms ticker (wall seconds)."""

    def to_json_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        return {
            "trace": self.trace_name,
            "seed": self.config.seed,
            "url": self.config.url,
            "replay": cfg,
            "time_scale": self.time_scale,
            "time_scale_source": self.time_scale_source,
            "server_info": self.server_info,
            "wall_s": self.wall_s,
            "timed_out": self.timed_out,
            "lag": self.lag,
            "client_lag_s": self.client_lag_s,
            "lag_failure": self.lag_failure,
            "metrics": self.metrics,
            "requests": [_record_json(r, self.time_scale) for r in self.records],
        }


def _record_json(r: RequestRecord, scale: float) -> dict[str, Any]:
    """One request in emulated time (ITLs as mean / max, not every interval)."""

    def t(x: float | None) -> float | None:
        return None if x is None else x / scale

    return {
        "request_id": r.request_id,
        "session_id": r.session_id,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "send_s": t(r.send_s),
        "first_token_s": t(r.first_token_s),
        "finish_s": t(r.finish_s),
        "itl_mean_s": t(float(np.mean(r.itl_s))) if r.itl_s else None,
        "itl_max_s": t(max(r.itl_s)) if r.itl_s else None,
        "status": r.status,
        "rejected": r.rejected,
        "error": r.error,
    }


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def replay_metrics(
    records: Sequence[RequestRecord],
    n_requests: int,
    *,
    time_scale: float = 1.0,
    slo_ttft_s: float = _DEFAULT_SLO.slo_ttft_s,
    slo_tpot_s: float = _DEFAULT_SLO.slo_tpot_s,
    n_dropped_empty: int = 0,
) -> dict[str, float | int | None]:
    """The :class:`~envs.metrics.RunMetrics` figures of a replay, in emulated time (wall / scale).

        Definitions match the simulator's: duration from the first send to the last finish; throughputs
        over finished requests; ITL statistics over every inter-token interval (token-weighted);
        per-request SLO on TTFT and mean ITL over the requests not refused (unfinished ones count as
        misses, refused ones are reported apart); prefix-hit share over
    finished requests, known only if each reported ``cached_tokens``. ``None`` where a
        client cannot observe the figure or no request produced it (never NaN).
    """
    done = [r for r in records if r.finished]
    n_rejected = sum(r.rejected for r in records)
    # a finished request has all three times (RequestRecord.finished)
    send = np.array([r.send_s for r in done], dtype=float) / time_scale
    first = np.array([r.first_token_s for r in done], dtype=float) / time_scale
    finish = np.array([r.finish_s for r in done], dtype=float) / time_scale
    out_tokens = np.array([r.completion_tokens for r in done], dtype=float)
    ttft, e2e = first - send, finish - send
    itl = (
        np.concatenate([np.frombuffer(r.itl_s, dtype=np.float64) for r in done] or [np.zeros(0)]) / time_scale
    )
    sent = [r.send_s for r in records if r.send_s is not None]
    duration = max(float(finish.max()) - min(sent) / time_scale, 1e-9) if done else None

    def q(values: np.ndarray, p: float) -> float | None:
        return float(np.quantile(values, p)) if len(values) else None

    itl_p50, itl_p99 = (
        weighted_quantiles(itl, np.ones_like(itl), [0.5, 0.99]) if len(itl) else [math.nan, math.nan]
    )
    per_req_itl = np.where(out_tokens > 1, (finish - first) / np.maximum(out_tokens - 1, 1), 0.0)
    slo_ok = int(((ttft <= slo_ttft_s) & (per_req_itl <= slo_tpot_s)).sum())
    cached = [r.cached_tokens for r in done]
    values: dict[str, float | int | None] = {
        "n_requests": n_requests,
        "n_finished": len(done),
        "n_rejected": n_rejected,
        "max_input_tokens_served": max((r.input_tokens for r in done), default=0),
        "n_dropped_empty": n_dropped_empty,
        "duration_s": duration,
        "input_tokens_per_s": sum(r.input_tokens for r in done) / duration if duration else None,
        "output_tokens_per_s": sum(r.completion_tokens for r in done) / duration if duration else None,
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else None,
        "ttft_p50_s": q(ttft, 0.5),
        "ttft_p99_s": q(ttft, 0.99),
        "itl_mean_s": float(itl.mean()) if len(itl) else None,
        "itl_p50_s": _finite_or_none(itl_p50),
        "itl_p99_s": _finite_or_none(itl_p99),
        "e2e_mean_s": float(e2e.mean()) if len(e2e) else None,
        "e2e_p50_s": q(e2e, 0.5),
        "e2e_p99_s": q(e2e, 0.99),
        "n_slo_met": slo_ok,
        "slo_attainment": slo_ok / (n_requests - n_rejected) if n_requests > n_rejected else None,
        "prefix_hit_share": (
            sum(c for c in cached if c is not None) / max(1, sum(r.input_tokens for r in done))
            if cached and all(c is not None for c in cached)
            else None
        ),
    }
    for key in UNOBSERVED_METRICS:
        values[key] = None
    missing = set(METRIC_KEYS) ^ set(values)
    assert not missing, f"replay metrics out of step with RunMetrics: {sorted(missing)}"
    return {key: values[key] for key in METRIC_KEYS}


def find_time_scale(info: Any) -> float | None:
    """The ``crossflow_time_scale`` reported anywhere in a ``/server_info`` answer (a gateway may nest
    its workers' answers), or None. Raises ``ValueError`` if workers report different scales."""
    found: set[float] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == TIME_SCALE_KEY and isinstance(value, int | float) and not isinstance(value, bool):
                    found.add(float(value))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(info)
    if len(found) > 1:
        raise ValueError(f"/server_info reports different {TIME_SCALE_KEY} values: {sorted(found)}")
    if found:
        scale = found.pop()
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"/server_info reports {TIME_SCALE_KEY}={scale}; expected a positive number")
        return scale
    return None


class Replayer:
    """Replays one prepared trace against one server (``await run()`` once)."""

    def __init__(
        self, trace: Trace, config: ReplayConfig, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        """``transport`` replaces the network (tests: ``httpx.MockTransport``)."""
        if trace.closed_loop and config.session_rate_per_s is None:
            raise ValueError(f"trace {trace.name!r} is closed-loop: a session rate (sessions/s) is required")
        self.trace = trace if trace.closed_loop else scale_load(trace, config.load)
        self.config = config
        self.prompts = PromptTokens(self.trace.requests, vocab_size=config.vocab_size, seed=config.seed)
        self.records = [
            RequestRecord(r.request_id, r.session_id, r.input_tokens, r.output_tokens)
            for r in self.trace.requests
        ]
        self.time_scale = 1.0
        self._t0 = 0.0
        self._n_sent = 0
        self._client_lag_s = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._transport = transport

    @property
    def n_requests(self) -> int:
        """Requests in the workload: the trace's, at most ``max_requests``."""
        n = len(self.trace.requests)
        return n if self.config.max_requests is None else min(n, self.config.max_requests)

    async def run(self) -> ReplayResult:
        cfg = self.config
        timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        # trust_env=False: a benchmark must not be routed through a proxy from the environment
        async with httpx.AsyncClient(
            base_url=cfg.url, timeout=timeout, limits=limits, trust_env=False, transport=self._transport
        ) as client:
            info = await self._server_info(client)
            reported = find_time_scale(info)
            if cfg.time_scale is not None:
                self.time_scale, source = cfg.time_scale, "argument"
            elif reported is not None:
                self.time_scale, source = reported, "server_info"
            else:
                self.time_scale, source = 1.0, "default"
            since_unix_s = time.time()
            self._t0 = time.perf_counter()
            timed_out = False
            watcher = asyncio.create_task(self._watch_loop())
            try:
                driver = self._run_closed(client) if self.trace.closed_loop else self._run_open(client)
                await asyncio.wait_for(driver, timeout=cfg.timeout_s)
            except TimeoutError:
                timed_out = True
            finally:
                watcher.cancel()
                await self._cancel_all()
            wall_s = time.perf_counter() - self._t0
            lag = await self._lag_reports(client, since_unix_s)
        metrics = replay_metrics(
            self.records,
            self.n_requests,
            time_scale=self.time_scale,
            slo_ttft_s=cfg.slo_ttft_s,
            slo_tpot_s=cfg.slo_tpot_s,
            n_dropped_empty=int(self.trace.meta.get("dropped_empty_requests", 0)),  # type: ignore[call-overload]
        )
        failures = [(r["max_s"], f"{r['url']}: {why}") for r in lag if (why := lag_check(r["max_s"], wall_s))]
        client_problem = lag_check(self._client_lag_s, wall_s, "the replay client")
        if client_problem is not None and source != "default":  # only an emulation's clock is ours to keep
            failures.append((self._client_lag_s, client_problem))
        return ReplayResult(
            self.trace.name,
            cfg,
            self.time_scale,
            source,
            info,
            metrics,
            self.records,
            wall_s,
            timed_out,
            lag,
            max(failures)[1] if failures else None,
            self._client_lag_s,
        )

    async def _watch_loop(self, period_s: float = 0.05) -> None:
        """Record how late this event loop wakes a ticker (a busy client reads streams late)."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(period_s)
            self._client_lag_s = max(self._client_lag_s, time.perf_counter() - start - period_s)

    async def _lag_reports(self, client: httpx.AsyncClient, since_unix_s: float) -> list[dict[str, Any]]:
        """The ``crossflow_lag`` reports since ``since_unix_s`` of the server, or of the workers a
        gateway lists at ``/workers``; empty when nobody reports one."""
        urls = await self._worker_urls(client) or [self.config.url]
        params = f"?{LAG_SINCE_PARAM}={since_unix_s:.6f}"
        answers = await asyncio.gather(*(_get_json(client, url, (f"/server_info{params}",)) for url in urls))
        return [
            {"url": url, **a[LAG_KEY]}
            for url, a in zip(urls, answers, strict=True)
            if isinstance(a, dict) and isinstance(a.get(LAG_KEY), dict) and "max_s" in a[LAG_KEY]
        ]

    async def _worker_urls(self, client: httpx.AsyncClient) -> list[str]:
        """The worker URLs a gateway lists at ``/workers`` (smg, sglang-router); empty for a server."""
        listing = await _get_json(client, self.config.url, ("/workers",))
        return [
            w["url"]
            for w in (listing or {}).get("workers", [])
            if isinstance(w, dict) and isinstance(w.get("url"), str)
        ]

    async def _server_info(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        """The server's ``/server_info`` (or ``/get_server_info``, which smg forwards to a worker). When
        that holds no time scale and the server is a gateway that lists its workers at ``/workers``
        (smg, sglang-router), the workers' own answers are added under ``"workers"``."""
        info = await _get_json(client, self.config.url, ("/server_info", "/get_server_info"), required=True)
        if find_time_scale(info) is not None:
            return info
        urls = await self._worker_urls(client)
        if not urls:
            return info
        answers = await asyncio.gather(*(_get_json(client, url, ("/server_info",)) for url in urls))
        workers = [{"url": url, "server_info": a} for url, a in zip(urls, answers, strict=True)]
        return {**(info or {}), "workers": workers}

    async def _cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in self.records:
            if r.send_s is not None and r.finish_s is None and not r.error:
                r.error = "cancelled: the replay reached its time limit"

    def _wall(self, emulated_s: float) -> float:
        """Replay-relative wall time of an emulated instant."""
        return emulated_s * self.time_scale

    async def _sleep_until(self, wall_s: float) -> None:
        delay = wall_s - (time.perf_counter() - self._t0)
        if delay > 0:
            await asyncio.sleep(delay)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run_open(self, client: httpx.AsyncClient) -> None:
        requests = self.trace.requests[: self.n_requests]
        if not requests:
            return
        origin = min(r.arrival_s for r in requests)
        for r in sorted(requests, key=lambda r: (r.arrival_s, r.request_id)):
            await self._sleep_until(self._wall(r.arrival_s - origin))
            self._spawn(self._send(client, r))
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def _run_closed(self, client: httpx.AsyncClient) -> None:
        requests = self.trace.requests
        children: dict[int, list[int]] = {}
        for r in requests:
            if r.depends_on >= 0:
                children.setdefault(r.depends_on, []).append(r.request_id)
        sessions = self.trace.session_ids
        assert self.config.session_rate_per_s is not None  # checked in __init__
        rate = self.config.session_rate_per_s * self.config.load
        # the simulator's draw: same generator, same seed, same call
        starts = poisson_session_starts(len(sessions), rate, np.random.default_rng(self.config.seed))
        start_of = dict(zip(sessions, starts.tolist(), strict=True))

        async def node(rid: int, release_wall_s: float) -> None:
            await self._sleep_until(release_wall_s)
            if self._n_sent >= self.n_requests:
                return  # the request budget is spent: the rest of this branch is never released
            await self._send(client, requests[rid])
            ended = time.perf_counter() - self._t0
            for child in children.get(rid, ()):
                think = max(0.0, requests[child].think_time_s)
                self._spawn(node(child, ended + self._wall(think)))

        for r in requests:
            if r.depends_on < 0:
                self._spawn(node(r.request_id, self._wall(start_of[r.session_id] + max(0.0, r.think_time_s))))
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    def _body(self, r: Request) -> bytes:
        payload = {
            "input_ids": self.prompts.ids(r.request_id).tolist(),
            "sampling_params": {"max_new_tokens": r.output_tokens, "ignore_eos": True, "temperature": 0.0},
            "stream": True,
        }
        return json.dumps(payload, separators=(",", ":")).encode()

    async def _send(self, client: httpx.AsyncClient, r: Request) -> None:
        """Send one request and record its stream (never raises for a server or transport failure)."""
        rec = self.records[r.request_id]
        self._n_sent += 1
        body = self._body(r)
        start = time.perf_counter()
        rec.send_s = start - self._t0
        last_tokens, last_token_event, last_event = 0, start, start
        try:
            async with client.stream(
                "POST", self.config.endpoint, content=body, headers={"Content-Type": "application/json"}
            ) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")[:300]
                    rec.rejected, rec.error = True, f"HTTP {resp.status_code}: {text}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.perf_counter()
                    data = line[5:].strip()
                    if data == "[DONE]":
                        last_event = now
                        continue
                    event = json.loads(data)
                    if isinstance(event.get("error"), dict):  # SGLang's in-stream error event
                        err = event["error"]
                        rec.rejected = True
                        rec.status = int(err.get("code") or 400)
                        rec.error = f"error event: {err.get('message', '')}"[:300]
                        return
                    meta = event.get("meta_info") or {}
                    finish = meta.get("finish_reason")
                    if isinstance(finish, dict) and finish.get("type") == "abort":
                        rec.rejected = True
                        rec.status = int(finish.get("status_code") or rec.status or 0)
                        rec.error = f"aborted: {finish.get('message', '')}"[:300]
                        return
                    tokens = meta.get("completion_tokens")
                    if not isinstance(tokens, int):
                        tokens = last_tokens + (1 if event.get("text") else 0)
                    if tokens > last_tokens:
                        if rec.first_token_s is None:
                            rec.first_token_s = now - self._t0
                        else:  # bench_serving: the gap since the last event that brought tokens
                            k = tokens - last_tokens
                            rec.itl_s.extend([(now - last_token_event) / k] * k)
                        last_tokens, last_token_event = tokens, now
                    last_event = now
                    if isinstance(meta.get("cached_tokens"), int):
                        rec.cached_tokens = meta["cached_tokens"]
            rec.completion_tokens = last_tokens
            if last_tokens == 0:
                rec.error = "the stream ended without a token"
            else:
                rec.finish_s = last_event - self._t0
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # bad stream content too
            rec.completion_tokens = last_tokens
            rec.error = f"{type(exc).__name__}: {exc}"[:300]


async def _get_json(
    client: httpx.AsyncClient, base_url: str, paths: Sequence[str], *, required: bool = False
) -> dict[str, Any] | None:
    """The first of ``paths`` on ``base_url`` that answers 200 with JSON (a non-dict answer is wrapped as
    ``{"answer": ...}``), or None. Unreachable: ``ConnectionError`` when ``required``, else None."""
    for path in paths:
        try:
            resp = await client.get(f"{base_url.rstrip('/')}{path}", timeout=10.0)
        except httpx.HTTPError as exc:
            if required:
                raise ConnectionError(f"cannot reach {base_url}{path}: {exc}") from exc
            return None
        if resp.status_code == 200:
            try:
                payload = resp.json()
            except ValueError:
                continue
            return payload if isinstance(payload, dict) else {"answer": payload}
    return None


def replay(trace: Trace, config: ReplayConfig) -> ReplayResult:
    """Replay ``trace`` against ``config.url`` (blocking; runs its own event loop)."""
    return asyncio.run(Replayer(trace, config).run())

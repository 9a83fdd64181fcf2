"""Crossflow's PD router: SGLang's PD protocol in front of prefill and decode workers, and the lease
path chosen by the same ``policies/`` code the simulator runs.

One asyncio HTTP server (``serving.http``) on loopback serves SGLang's ``POST /generate`` and OpenAI's
``POST /v1/completions`` and ``/v1/chat/completions``, streamed (server-sent events) or not. Per
request:

1. **Validation.** The body is read with the workers' own parser (``pd_cluster.parse_generation``) and
   checked against the model's context window: a malformed body, a field of the wrong type or an
   oversize prompt is answered with an SGLang-style 400 naming the field and never reaches a worker.
2. **Picks.** The prefill and decode workers are chosen by ``policies.routing`` (smg 1.13.0's
   ``cache_aware`` by default, with its overload protection from a ``/v1/loads`` poll every
   ``load_monitor_interval_s``), against the router's approximate prefix trees (chained page hashes
   of the token ids, ``envs.live.PrefixResolver``'s hashing) and in-flight counts.
3. **Path.** With a scheduler (``policies.ClusterScheduler``, built by ``policies.catalog``), its
   ``choose_path`` decides from a ``PathQuery`` filled as the simulator fills it: the prefill pick's
   cached tokens, the uncomputed prefill tokens the router has in flight to that worker (timed by
   the cluster estimator as the queue wait), the decode trees' matches and the router's KV view.
4. **Normal path: dual dispatch.** The body goes to the prefill worker (non-streamed) and the decode
   worker with ``bootstrap_host`` / ``bootstrap_port`` (the prefill worker's bootstrap server) and a
   fresh 63-bit ``bootstrap_room``; the decode leg's answer is relayed. When one leg fails at the
   transport level (connection refused or cut), the other is cancelled and aborted on its worker
   (SGLang's ``POST /abort_request``), so a decode leg never waits for a prefill that is gone.
5. **Borrowed path.** The body goes to the lending decode worker alone with ``do_local_prefill: true``
   and the fallback prefill worker's bootstrap fields. The worker re-checks its own lease on arrival
   and may refuse (503, or an abort event before any token): the router then sends the request on
   the normal path with a fresh room (a *fallback*).
6. **Retries.** A leg answered 408, 429 or 5xx (or cut) before the first token is sent again after
   smg's backoff, with a fresh room, avoiding the workers that failed it; each worker has a circuit
   breaker and a periodic health check (``serving.resilience``, smg's defaults). After the first
   token a failure ends the client's stream with an error event (no hang, no silent end).

**Leases over the wire.** Lease agents (``serving.lease_agent``) report each decode node's
``NodeState`` to the control plane (its own server, ``127.0.0.1`` by default, every request needs
``Authorization: Bearer <token>``). Each control interval the router hands the states reported
within the last 1.5 intervals to ``ClusterScheduler.on_control_interval``, which runs the node
policy and publishes (or revokes) each node's lease in the router's ledger, exactly as the simulator
does. A node whose agent stopped reporting is left out, so its lease is not refreshed and expires at
its TTL: nothing more is borrowed there. A borrowed request counts as arrived at its node (so the
node's next lease adds back what it holds, as work the node's state already shows) only once a report
read after the request was sent comes in: a report read before it cannot show it, and counting it
then would grant its budget twice (the simulator's states are exact at its ticks, so there the two
coincide).

**Policy reload.** ``POST /crossflow/v1/policy`` on the control plane (``{"policy": REF}``) swaps the
router's scheduler for the one ``policy_loader`` builds, without dropping a request
(``Router.reload_policy`` says how in-flight reservations are kept).

**Time.** Against an emulated cluster (``time_scale`` wall seconds per emulated second) the
scheduler's clock, the control interval, the load poll and the latency histograms run in emulated
seconds; retries, breakers and health checks in wall seconds.

``/metrics`` (Prometheus, ``crossflow:*``), ``/server_info`` (the policy served: name, version and
hash; the time scale), ``/workers``, ``/health``, ``/v1/models`` are served too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import urlsplit

import numpy as np

from envs.live import PrefixResolver
from policies.chunk_limits import ChunkLimits
from policies.lease import LeaseBudgets
from policies.lease_path import without_prefix_pulls
from policies.node_policies import DecodePressureRule
from policies.node_state import NodeState
from policies.path import PathDecision, PathQuery
from policies.routing import (
    CacheAwareConfig,
    OverloadProtection,
    RoutingPolicy,
    WorkerPool,
    make_routing_policy,
)
from serving.http import (
    HttpError,
    HttpRequest,
    HttpServer,
    SseStream,
    dumps,
    loads,
    send_bytes,
    send_json,
    send_text,
)
from serving.pd_cluster import CHARS_PER_TOKEN, Generation, parse_generation, render_abort
from serving.prom import Registry
from serving.replay import TIME_SCALE_KEY
from serving.resilience import (
    BreakerConfig,
    CircuitBreaker,
    Health,
    HealthConfig,
    RetryConfig,
    is_retryable,
)
from serving.sglang_plugin.wire import (
    MARKER_FIELD,
    is_request_id_list,
    lease_update_accepted,
    lease_update_body,
)
from serving.upstream import JSON_HEADERS, UpstreamClient, UpstreamError

if TYPE_CHECKING:
    from policies.bundle import PolicyBundle

NODE_STATE_PATH = "/crossflow/v1/node_state"
"""The control plane's lease-report route (``POST``, JSON ``{"node_id": j, "node_state": {...}}``,
optionally ``"state_age_s"``: wall seconds from the start of the agent's read of the worker to the
post, so the router knows which of its borrowed requests the state can reflect)."""
POLICY_PATH = "/crossflow/v1/policy"
"""The control plane's policy route: ``GET`` the served policy, ``POST {"policy": REF}`` reloads it
(``Router.reload_policy``)."""
ROOM_BITS = 63
BLOCK_TOKENS = 16
"""The router's prefix trees hash token ids in blocks of at least this many tokens (whole KV pages):
a match is known to within one block, and a long prompt costs one hash per block, not per token."""
STATE_FRESH_INTERVALS = 1.5
"""A node's reported state is used at a control interval when it is at most this many intervals old."""

_APIS = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
_API_PATHS = {api: path for path, api in _APIS.items()}


class SchedulerLike(Protocol):
    """What the router asks of ``policies.ClusterScheduler``."""

    ledger: Any
    control_interval_s: float

    @property
    def uses_gateway_decode_pick(self) -> bool: ...

    def on_control_interval(self, now_s: float, states: Sequence[NodeState]) -> list[int]: ...

    def choose_path(self, q: PathQuery, now_s: float) -> PathDecision: ...

    def on_task_arrival(self, reservation_id: int, state: NodeState, now_s: float) -> str: ...

    def on_task_started(self, reservation_id: int, now_s: float) -> bool: ...

    def on_prefill_done(self, reservation_id: int) -> None: ...

    def on_request_finished(self, reservation_id: int) -> None: ...

    def on_fallback(self, reservation_id: int) -> None: ...


class QueueEstimator(Protocol):
    """Queue-wait timing (``envs.estimator.ClusterEstimator``)."""

    def queue_wait_s(self, queued_tokens: int) -> float: ...

    def prefill_iteration_time_s(self, chunks: Sequence[tuple[int, int]]) -> float: ...


@dataclass(frozen=True)
class PolicyInfo:
    """The policy a router serves, as ``/server_info`` reports it (a bundle's name, version and
    content hash; for a catalog policy its name, the package version and a hash of its parameters)."""

    name: str
    version: str = ""
    sha256: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    policy: str = ""
    """The catalog policy it runs (a bundle's ``policy``; a catalog policy's own name)."""
    source: str = ""
    """Where it came from: ``catalog``, or the bundle folder or ``wandb:`` reference it was loaded from."""

    @classmethod
    def from_catalog(cls, name: str, params: Mapping[str, Any], version: str) -> PolicyInfo:
        digest = hashlib.sha256(dumps({"name": name, "params": dict(params)})).hexdigest()
        return cls(name, version, digest, dict(params), policy=name, source="catalog")

    @classmethod
    def from_bundle(cls, bundle: PolicyBundle, source: str) -> PolicyInfo:
        """A bundle's identity: its name, version and digest (``PolicyBundle.digest``)."""
        return cls(
            bundle.name, str(bundle.version), bundle.digest, dict(bundle.params), bundle.policy, source
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "sha256": self.sha256,
            "policy": self.policy,
            "source": self.source,
            "params": dict(self.params),
        }


PolicyLoader = Callable[[str], "tuple[SchedulerLike | None, PolicyInfo]"]
"""Turns a policy reference (a catalog name, a bundle folder, a ``wandb:`` reference) into the
router's scheduler for it (None: a passive policy) and its identity; raises ``ValueError`` /
``FileNotFoundError`` / ``KeyError`` naming what is wrong. Called off the event loop."""


@dataclass(frozen=True)
class RouterConfig:
    """What the router serves and how (see the module docstring).

    ``prefill``: ``(url, bootstrap_port)`` per prefill worker (as smg's ``--prefill URL PORT``);
    ``decode``: decode worker URLs. ``context_window_tokens`` and ``vocab_size`` describe the model
    (prompts longer than the window are refused here; text is tokenised as the emulated workers do).
    """

    prefill: tuple[tuple[str, int | None], ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    control_host: str = "127.0.0.1"
    control_port: int = 0
    control_token: str | None = None
    """None: a random token is made (``Router.control_token``)."""
    model_name: str = "default"
    context_window_tokens: int = 131_072
    vocab_size: int = 32_000
    page_tokens: int = 1
    prefill_chunk_tokens: int = 0
    """The prefill workers' per-iteration token budget (``PrefillQueue``); 0: a whole prompt per iteration."""
    kv_capacity_tokens: int = 0
    decode_prefix_cache: bool = False
    prefill_routing: str = "cache_aware"
    decode_routing: str = "cache_aware"
    overload: OverloadProtection | None = field(default_factory=OverloadProtection)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    time_scale: float = 1.0
    """Wall seconds per emulated second of the workers (1: real workers)."""
    request_timeout_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("RouterConfig needs at least one prefill and one decode worker")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"RouterConfig.time_scale must be positive, got {self.time_scale}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"RouterConfig.prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}"
            )
        if self.page_tokens < 1 or self.context_window_tokens < 2:
            raise ValueError("RouterConfig: page_tokens >= 1 and context_window_tokens >= 2")


@dataclass
class Worker:
    """One upstream worker as the router sees it."""

    role: Literal["prefill", "decode"]
    idx: int
    url: str
    bootstrap_port: int | None
    breaker: CircuitBreaker
    health: Health

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def name(self) -> str:
        return f"{self.role}{self.idx}"

    @property
    def available(self) -> bool:
        return self.health.healthy and self.breaker.allows()


class PageTrees:
    """The router's approximate prefix tree per worker: the chained page hashes it sent there (a
    worker holds a request's prefix as far as its leading hashes were sent to it), least recently
    used pages dropped beyond ``max_pages`` per worker."""

    def __init__(self, n_workers: int, page_tokens: int, max_pages: int) -> None:
        self.page_tokens = page_tokens
        self.max_pages = max(1, max_pages)
        self.trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_workers)]

    def match_tokens(self, worker: int, hashes: Sequence[int], input_tokens: int) -> int:
        tree, n = self.trees[worker], 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return min(n * self.page_tokens, input_tokens)

    def matches(self, hashes: Sequence[int], input_tokens: int, eligible: Sequence[int]) -> dict[int, int]:
        return {i: m for i in eligible if (m := self.match_tokens(i, hashes, input_tokens)) > 0}

    def insert(self, worker: int, hashes: Sequence[int]) -> None:
        tree = self.trees[worker]
        for h in hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.max_pages:
            tree.popitem(last=False)


class PrefillQueue:
    """The router's estimate of one prefill worker's uncomputed queue: it replays the worker's
    schedule from the requests the router sent there, in dispatch order. Each iteration packs up to
    ``chunk_tokens`` of the queue head (several small prompts share one iteration, a long one runs in
    chunks), as the simulator's prefill worker does, and takes ``iteration_time_s`` of those chunks
    (``(tokens, tokens before them)`` pairs: the estimator's cost model). A request's tokens leave the
    count when the iteration that computes them ends, or all at once when the worker answers. With
    ``chunk_tokens`` 0 an iteration is one whole prompt. It stands for what the simulator's path
    query reads from the worker itself (its queued uncomputed tokens); what it cannot see is a prompt
    the worker holds back until the decode side has room for its KV (``docs/serving.md``)."""

    def __init__(
        self,
        chunk_tokens: int = 0,
        iteration_time_s: Callable[[Sequence[tuple[int, int]]], float] | None = None,
    ) -> None:
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.iteration_time_s = iteration_time_s or (lambda chunks: 0.0)
        self._entries: OrderedDict[int, list[int]] = OrderedDict()
        """key -> [tokens not yet computed, tokens before them (cached or computed)]."""
        self._batch: list[tuple[int, int]] = []
        """The iteration being replayed: (key, tokens it computes)."""
        self._batch_end_s: float | None = None
        """When it ends (None: the worker is idle)."""
        self._next = 0

    def add(self, tokens: int, cached_tokens: int, now_s: float) -> int:
        """Queue ``tokens`` of prefill after ``cached_tokens`` of cached prefix; the entry's key (for
        ``remove``)."""
        self._advance(now_s)
        self._next += 1
        if tokens > 0:
            self._entries[self._next] = [tokens, cached_tokens]
            if self._batch_end_s is None:
                self._start(now_s)
        return self._next

    def remove(self, key: int, now_s: float) -> None:
        """The worker answered at ``now_s``: the request's tokens leave the count (an iteration it
        shared still ends when replayed). The replay first catches up to ``now_s``, so the schedule
        before the answer stays what it was."""
        self._advance(now_s)
        self._entries.pop(key, None)

    def _start(self, now_s: float) -> None:
        budget = self.chunk_tokens
        batch: list[tuple[int, int]] = []
        chunks: list[tuple[int, int]] = []
        for key, (left, before) in self._entries.items():
            take = min(left, budget) if budget else left
            batch.append((key, take))
            chunks.append((take, before))
            budget -= take
            if budget <= 0:
                break
        self._batch = batch
        self._batch_end_s = now_s + self.iteration_time_s(chunks) if batch else None

    def _advance(self, now_s: float) -> None:
        while self._batch_end_s is not None and self._batch_end_s <= now_s:
            for key, take in self._batch:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry[0] -= take
                entry[1] += take
                if entry[0] <= 0:
                    del self._entries[key]
            self._start(self._batch_end_s)

    def tokens(self, now_s: float) -> int:
        """Uncomputed tokens expected still queued at ``now_s`` (those of the iteration being
        computed count until it ends)."""
        self._advance(now_s)
        return sum(left for left, _ in self._entries.values())


class LegFailed(Exception):
    """A leg ended before its first token: ``status`` (0: transport), whether it may be retried, and
    the worker to blame (None: the request itself)."""

    def __init__(self, status: int, message: str, worker: Worker | None, *, transport: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.worker, self.transport = status, message, worker, transport

    @property
    def retryable(self) -> bool:
        return self.transport or is_retryable(self.status)


@dataclass(slots=True)
class _BorrowedLeg:
    """A borrowed request sent to a lending node, as the router's ledger follows it there."""

    scheduler: Any
    """The scheduler holding its reservation (the one it was made under, even after a reload)."""
    reservation_id: int
    sent_s: float
    arrived: bool = False
    """A report read after it was sent has come in (``on_task_arrival`` called)."""
    committed: bool = False
    """``on_task_started`` has been called: the node reported its prefill begun, or its first token came."""
    held: bool = False
    """That call committed the reservation (it had not been revoked nor let expire)."""


@dataclass
class _Flight:
    """One client request in flight (what the router's views count)."""

    request_id: int
    gen: Generation
    hashes: list[int]
    common_json: bytes = b"{}"
    """The client's body without the fields each leg sets (``_LEG_FIELDS``), encoded once."""
    prefill: Worker | None = None
    decode: Worker | None = None
    prefill_entry: int | None = None
    """Its entry in its prefill worker's ``PrefillQueue`` while counted there."""
    scheduler: SchedulerLike | None = None
    """The scheduler that chose its path: a borrowed request's reservation lives in that scheduler's
    ledger, so its start, finish and fallback are reported there even after a policy reload."""
    generation: int = 0
    """The policy generation that admitted it (``Router.policy_generation``)."""


def _sse_data(line: str) -> str | None:
    return line[6:] if line.startswith("data: ") else (line[5:] if line.startswith("data:") else None)


def _event_error(event: Any) -> tuple[int, str] | None:
    """``(status, message)`` when a streamed event (or a non-streamed answer) is SGLang's abort or an
    error object; None for a normal event."""
    if not isinstance(event, dict):
        return None
    err = event.get("error")
    if isinstance(err, dict):
        code = err.get("code")
        return (int(code) if isinstance(code, int) else 500, str(err.get("message", "error")))
    if isinstance(err, str):
        return 500, err
    reason = (event.get("meta_info") or {}).get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        code = reason.get("status_code")
        return (int(code) if isinstance(code, int) else 500, str(reason.get("message", "aborted")))
    return None


def _event_tokens(event: Any) -> int | None:
    """Completion tokens a ``/generate`` event reports so far (None on the OpenAI routes)."""
    if isinstance(event, dict):
        meta = event.get("meta_info")
        if isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
            return int(meta["completion_tokens"])
    return None


class Router:
    """The router (see the module docstring). ``await start()``; ``await stop()``."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        scheduler: SchedulerLike | None = None,
        estimator: QueueEstimator | None = None,
        policy: PolicyInfo | None = None,
        policy_loader: PolicyLoader | None = None,
    ) -> None:
        if scheduler is not None and estimator is None:
            raise ValueError("a router with a scheduler needs the cluster estimator (queue-wait timing)")
        self.config = config
        self.scheduler = without_prefix_pulls(scheduler)  # no node here can pull a cached prefix
        self.estimator = estimator
        self.policy = policy or PolicyInfo("static")
        self.policy_loader = policy_loader
        self.policy_generation = 0
        """Bumped by each policy reload."""
        self._reload_lock = asyncio.Lock()
        self._control_task: asyncio.Task[None] | None = None
        self.control_token = config.control_token or secrets.token_urlsafe(24)
        self.prefill = [
            Worker("prefill", i, url.rstrip("/"), port, CircuitBreaker(config.breaker), Health(config.health))
            for i, (url, port) in enumerate(config.prefill)
        ]
        self.decode = [
            Worker("decode", j, url.rstrip("/"), None, CircuitBreaker(config.breaker), Health(config.health))
            for j, url in enumerate(config.decode)
        ]
        self.prefill_pool, self.decode_pool = WorkerPool(len(self.prefill)), WorkerPool(len(self.decode))
        self._prefill_router: RoutingPolicy = make_routing_policy(config.prefill_routing, config.cache_aware)
        self._decode_router: RoutingPolicy = make_routing_policy(config.decode_routing, config.cache_aware)
        block = -(-BLOCK_TOKENS // config.page_tokens) * config.page_tokens
        max_pages = config.cache_aware.max_tree_size // (CHARS_PER_TOKEN * block)
        self._prefill_trees = PageTrees(len(self.prefill), block, max_pages)
        self._computed_trees = PageTrees(len(self.prefill), block, max_pages)
        """The prefixes each prefill worker has computed (a prompt enters when its prefill ends; bounded
        as the gateway's tree is, not by the worker's own cache); ``_prefill_trees`` has them from
        dispatch, as the gateway routes."""
        self._decode_trees = PageTrees(len(self.decode), block, max_pages)
        self._hasher = PrefixResolver(block)
        timing = estimator.prefill_iteration_time_s if estimator is not None else None
        self._prefill_queues = [PrefillQueue(config.prefill_chunk_tokens, timing) for _ in self.prefill]
        self._decode_kv = [0] * len(self.decode)
        self._overloaded: dict[str, list[bool]] = {
            "prefill": [False] * len(self.prefill),
            "decode": [False] * len(self.decode),
        }
        self._rng = np.random.default_rng(config.seed)
        self._retry_rng = np.random.default_rng(config.seed + 1)
        self._rooms = np.random.default_rng(config.seed + 2)
        self._next_id = 0
        self._reports: dict[int, tuple[NodeState, float]] = {}
        """Per node, its last reported state and when (the scheduler's clock) the agent began reading it."""
        self._borrowed_legs: dict[int, dict[str, _BorrowedLeg]] = {}
        """Per node, the borrowed requests sent there and not yet done, by the leg's request id."""
        self._lease_takers: set[int] = set()
        """Decode nodes whose agents say their worker installs pushed leases (``_push_leases``)."""
        self._pushed: dict[int, tuple[Any, ...]] = {}
        """Per node, the lease last installed there (policy generation, budgets, expiry)."""
        self._pushing: set[int] = set()
        self._push_tasks: set[asyncio.Task[None]] = set()
        self._reservation_nodes: dict[tuple[int, int], int] = {}
        """Active borrow reservations (policy generation, reservation id) -> their node (to label
        revocations; ids of two policies' ledgers may coincide)."""
        self._all_reported = asyncio.Event()
        """Set once every decode node's agent has reported (the first control interval runs then)."""
        self._leases_out = asyncio.Event()
        """Set once a control interval ran on every decode node's state (``wait_leases_out``)."""
        self.first_control_s: float | None = None
        """When (the scheduler's clock) the first control interval ran: the origin of the control grid."""
        self.first_request_s: float | None = None
        """When (the scheduler's clock) the first well-formed generation request came in."""
        self._next_control_wall_s: float | None = None
        """When (``time.perf_counter``) the next control interval is due; None without a control loop.
        Each report's answer tells the agent how far ahead that is (``next_control_in_s``)."""
        self.http = HttpServer(self._route, config.host, config.port, keep_alive=True)
        self.control = HttpServer(
            self._control_route, config.control_host, config.control_port, keep_alive=True
        )
        self.upstream: UpstreamClient | None = None
        """Every request to a worker (legs, aborts, lease pushes, health checks, load polls): keep-alive
        pools per worker (``serving.upstream``)."""
        self._t0 = time.perf_counter()
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics()

    # ---------------------------------------------------------------- life cycle
    @property
    def url(self) -> str:
        return self.http.url

    @property
    def control_url(self) -> str:
        return self.control.url

    def now_s(self) -> float:
        """The scheduler's clock: emulated seconds since the router started."""
        return (time.perf_counter() - self._t0) / self.config.time_scale

    async def start(self) -> None:
        self.upstream = UpstreamClient(timeout_s=self.config.request_timeout_s, connect_timeout_s=5.0)
        self._t0 = time.perf_counter()
        await self.http.start()
        await self.control.start()
        loops = [self._health_loop()]
        if self.config.overload is not None:
            loops.append(self._load_loop(self.config.overload))
        self._tasks = [asyncio.create_task(c) for c in loops]
        self._start_control_loop()

    def _start_control_loop(self) -> None:
        if self.scheduler is not None:
            self._control_task = asyncio.create_task(
                self._control_loop(self.scheduler, self.policy_generation)
            )

    async def _stop_control_loop(self) -> None:
        task, self._control_task = self._control_task, None
        self._next_control_wall_s = None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        await self._stop_control_loop()
        for push in list(self._push_tasks):
            push.cancel()
        await asyncio.gather(*self._push_tasks, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.http.stop()
        await self.control.stop()
        if self.upstream is not None:
            await self.upstream.aclose()

    # ---------------------------------------------------------------- metrics
    def _metrics(self) -> None:
        r = self.registry = Registry()
        self.m_requests = r.counter(
            "crossflow:requests_total", "Client requests answered.", ("api", "status")
        )
        self.m_decisions = r.counter(
            "crossflow:path_decisions_total", "Path decisions by path and reason code.", ("path", "reason")
        )
        self.m_fallbacks = r.counter(
            "crossflow:fallbacks_total", "Borrowed requests sent back to the normal path.", ("node", "cause")
        )
        self.m_completed = r.counter(
            "crossflow:requests_completed_total",
            "Requests answered in full, by the path they finished on.",
            ("path",),
        )
        self.m_retries = r.counter("crossflow:retries_total", "Dispatches sent again.", ("cause",))
        self.m_revocations = r.counter(
            "crossflow:lease_revocations_total", "Reservations revoked by a lease update.", ("node",)
        )
        self.m_reinstatements = r.counter(
            "crossflow:lease_reinstatements_total",
            "Revoked reservations re-opened because the node reported it had started them first "
            "(each is also in lease_revocations_total).",
            ("node",),
        )
        self.m_reports = r.counter(
            "crossflow:lease_reports_total", "Node states reported by lease agents.", ("node",)
        )
        self.m_reloads = r.counter(
            "crossflow:policy_reloads_total",
            "Policy reloads on the control plane, by the new policy's name.",
            ("policy",),
        )
        self.m_pushes = r.counter(
            "crossflow:lease_pushes_total",
            "Leases sent to decode workers that install them (/set_internal_state), by result.",
            ("node", "result"),
        )
        self.m_borrowed_tokens = r.counter(
            "crossflow:lease_borrowed_prefill_tokens_total",
            "Prefill tokens reserved by borrowed requests that started on a lease.",
            ("node",),
        )
        r.gauge("crossflow:lease_budget", "The node's current lease (0 once expired).", ("node", "budget"),
                source=self._lease_budgets)  # fmt: skip
        r.gauge(
            "crossflow:lease_utilisation",
            "Prefill tokens borrowed over prefill tokens granted by the node's leases so far.",
            ("node",),
            source=self._lease_utilisation,
        )
        r.gauge(
            "crossflow:worker_available",
            "1 when healthy and its breaker lets requests through.",
            ("worker",),
            source=lambda: {(w.name,): float(w.available) for w in self.prefill + self.decode},
        )
        self.m_ttft = r.histogram(
            "crossflow:time_to_first_token_seconds", "TTFT by path (emulated s).", ("path",)
        )
        self.m_itl = r.histogram(
            "crossflow:inter_token_latency_seconds", "ITL by path (emulated s).", ("path",)
        )

    def _lease_budgets(self) -> dict[tuple[str, ...], float]:
        if self.scheduler is None:
            return {}
        ledger, now = self.scheduler.ledger, self.now_s()
        out: dict[tuple[str, ...], float] = {}
        for node in ledger.node_ids():
            lease = ledger.lease(node)
            live = lease.is_live(now)
            for name, value in lease.budgets.to_dict().items():
                out[(str(node), name)] = float(value) if live else 0.0
        return out

    def _lease_utilisation(self) -> dict[tuple[str, ...], float]:
        if self.scheduler is None:
            return {}
        ledger, now = self.scheduler.ledger, self.now_s()
        out: dict[tuple[str, ...], float] = {}
        for node in ledger.node_ids():
            granted = ledger.granted_prefill_tokens(node, now)
            out[(str(node),)] = self.m_borrowed_tokens.get(node) / granted if granted > 0 else 0.0
        return out

    # ---------------------------------------------------------------- background loops
    async def _health_loop(self) -> None:
        cfg = self.config.health
        if not cfg.enabled:
            return
        assert self.upstream is not None
        while True:
            for w in self.prefill + self.decode:
                try:
                    status, _ = await self.upstream.get(w.url + cfg.endpoint, timeout_s=cfg.timeout_s)
                    ok = status == 200
                except UpstreamError:
                    ok = False
                w.health.record(ok)
            self._refresh_flags()
            await asyncio.sleep(cfg.interval_s)

    async def _load_loop(self, rule: OverloadProtection) -> None:
        """smg's load monitor: every ``load_monitor_interval_s`` (emulated), each worker's
        ``/v1/loads`` sets its overload flag."""
        assert self.upstream is not None
        while True:
            for role, workers in (("prefill", self.prefill), ("decode", self.decode)):
                flags = []
                for w in workers:
                    try:
                        _, body = await self.upstream.get(w.url + "/v1/loads?include=core", timeout_s=5.0)
                        snap = loads(body)["loads"][0]
                        flags.append(
                            rule.is_overloaded(int(snap["num_waiting_reqs"]), float(snap["token_usage"]))
                        )
                    except (UpstreamError, ValueError, KeyError, IndexError, TypeError):
                        flags.append(self._overloaded[role][w.idx])
                self._overloaded[role] = flags
            self._refresh_flags()
            # at least 1 s of wall time, as smg's whole-second flag allows (gateway_timer_args)
            await asyncio.sleep(max(1.0, rule.load_monitor_interval_s * self.config.time_scale))

    def _refresh_flags(self) -> None:
        """Pools' candidate flags: overloaded, unhealthy or breaker-open workers are left out."""
        for pool, workers, role in (
            (self.prefill_pool, self.prefill, "prefill"),
            (self.decode_pool, self.decode, "decode"),
        ):
            pool.set_overloaded([self._overloaded[role][w.idx] or not w.available for w in workers])

    async def reload_policy(self, ref: str) -> PolicyInfo:
        """Serve policy ``ref`` from now on (through ``policy_loader``); the previous identity.

        Without dropping a request: the new scheduler is built off the event loop, then swapped in at
        once (no await between the swap's steps, so no request sees half of it). A request already
        admitted keeps the scheduler that chose its path (``_Flight.scheduler``): a borrowed one
        reports its start, finish or fallback to the ledger that holds its reservation, so that
        reservation is released exactly once and never in the new ledger. The old scheduler gets no
        more control intervals: its leases are not refreshed and nothing new is reserved on them;
        the reservations it holds end with their requests. The new scheduler starts with an empty
        ledger and publishes leases at its first control interval from the states the lease agents
        reported (kept across the swap), and those states count the old policy's borrowed work
        still running on each node (a worker reports what it runs), so the new leases are sized
        around it rather than over it; the worker's own check on arrival remains the last word
        (a refused borrow falls back to the normal path). Until that first interval no request is
        borrowed: the normal path, never a lost request. Raises what the loader raises, and
        ``ValueError`` for a lease policy on a router without a queue estimator.
        """
        if self.policy_loader is None:
            raise ValueError("this router was started without a policy loader; it cannot reload")
        async with self._reload_lock:
            scheduler, info = await asyncio.to_thread(self.policy_loader, ref)
            if scheduler is not None and self.estimator is None:
                raise ValueError("a router with a scheduler needs the cluster estimator (queue-wait timing)")
            await self._stop_control_loop()
            previous = self.policy
            self.scheduler, self.policy = without_prefix_pulls(scheduler), info
            self.policy_generation += 1
            self._start_control_loop()
            if scheduler is None:
                self._revoke_pushed_leases()
            self.m_reloads.inc(info.name)
            return previous

    async def _control_loop(self, scheduler: SchedulerLike, generation: int) -> None:
        """Control intervals on a fixed grid of wall times (a late wake-up does not shift the ones
        after it, as the simulator's ticks are never shifted); one that falls a whole interval
        behind restarts the grid from now rather than running the missed ones back to back. The
        first runs as soon as every decode node has reported (at most one interval after the loop
        starts), so the leases are out before the first requests come, as in the simulator, whose
        first control tick publishes them at the instant its first request arrives."""
        interval_s = scheduler.control_interval_s
        wall_interval_s = interval_s * self.config.time_scale
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_reported.wait(), wall_interval_s)
        due_s = time.perf_counter() - wall_interval_s
        while True:
            due_s += wall_interval_s
            late_s = time.perf_counter() - due_s
            if late_s > wall_interval_s:
                due_s += wall_interval_s * math.floor(late_s / wall_interval_s)
            self._next_control_wall_s = due_s
            await asyncio.sleep(max(0.0, due_s - time.perf_counter()))
            now = self.now_s()
            if self.first_control_s is None:
                self.first_control_s = now
            fresh = [
                replace(state, time_s=now)
                for state, at_s in self._reports.values()
                if now - at_s <= STATE_FRESH_INTERVALS * interval_s
            ]
            revoked = scheduler.on_control_interval(now, sorted(fresh, key=lambda s: s.node_id))
            for rid in revoked or ():
                with contextlib.suppress(KeyError):
                    self.m_revocations.inc(self._reservation_nodes.pop((generation, rid)))
            self._push_leases(scheduler, now, generation)
            if len(fresh) == len(self.decode):
                self._leases_out.set()

    def control_phase_s(self) -> float | None:
        """Where the first request fell on the control grid: its arrival after the latest control
        interval before it (the scheduler's clock; 0 up to one interval). A replay's arrivals keep
        that phase against the router's ticks, so it is the phase to simulate the same run at
        (``train.experiment.simulate_at_phase``). None before the first interval or request."""
        if self.first_control_s is None or self.first_request_s is None or self.scheduler is None:
            return None
        return (self.first_request_s - self.first_control_s) % self.scheduler.control_interval_s

    async def wait_leases_out(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s`` wall seconds, until a control interval has run on every decode
        node's reported state and the leases it published have been pushed to the nodes that take
        them; whether that happened (never without a scheduler)."""
        try:
            await asyncio.wait_for(self._leases_out.wait(), timeout_s)
        except TimeoutError:
            return False
        if self._push_tasks:
            await asyncio.wait(set(self._push_tasks), timeout=timeout_s)
        return True

    # ---------------------------------------------------------------- leases over the wire
    def _push_leases(self, scheduler: Any, now_s: float, generation: int) -> None:
        """Send each lease-taking node the lease just published for it, when it changed (a new
        budget, expiry or policy): ``POST /set_internal_state`` with ``wire.lease_update_body``, the
        time it has left as its TTL, so the worker's own re-check admits against the router's lease,
        the node policy's cap on each borrowed iteration (``ClusterScheduler.chunk_limits`` over
        the range the node's last report gives: its running-batch limit and KV capacity) and its
        decode-pressure test (``ClusterScheduler.pressure_rule``: the node holds un-started borrowed
        requests back while it holds, as the simulator's node pauses them).
        An expired lease is not sent (the worker's copy lapses at the same TTL); a zero one is (a
        revocation). One push per node at a time; one that fails is sent again at the next interval."""
        for j in sorted(self._lease_takers - self._pushing):
            lease = scheduler.ledger.lease(j)
            if lease is None or (not lease.budgets.is_zero() and not lease.is_live(now_s)):
                continue
            key = (generation, lease.budgets.as_tuple(), lease.expires_s)
            if self._pushed.get(j) != key:
                ttl_s = lease.ttl_s if lease.budgets.is_zero() else lease.expires_s - now_s
                rule_fn = getattr(scheduler, "pressure_rule", None)
                rule = rule_fn(j) if callable(rule_fn) else None
                self._start_push(j, lease.budgets, ttl_s, key, self._chunk_limits(scheduler, j), rule)

    def _chunk_limits(self, scheduler: Any, node: int) -> ChunkLimits | None:
        """The node policy's per-iteration cap for ``node``, tabulated over its last reported range."""
        report = self._reports.get(node)
        if report is None or not callable(getattr(scheduler, "chunk_limits", None)):
            return None
        state = report[0]
        limits: ChunkLimits | None = scheduler.chunk_limits(
            node, state.max_running_requests, state.kv_capacity_tokens
        )
        return limits

    def _start_push(
        self,
        node: int,
        budgets: LeaseBudgets,
        ttl_s: float,
        key: tuple[Any, ...],
        chunk_limits: ChunkLimits | None = None,
        pressure_rule: DecodePressureRule | None = None,
    ) -> None:
        self._pushing.add(node)
        task = asyncio.create_task(self._push_lease(node, budgets, ttl_s, key, chunk_limits, pressure_rule))
        self._push_tasks.add(task)
        task.add_done_callback(self._push_tasks.discard)

    async def _push_lease(
        self,
        node: int,
        budgets: LeaseBudgets,
        ttl_s: float,
        key: tuple[Any, ...],
        chunk_limits: ChunkLimits | None,
        pressure_rule: DecodePressureRule | None,
    ) -> None:
        assert self.upstream is not None
        ok = False
        try:
            status, answer = await self.upstream.post_json(
                self.decode[node].url + "/set_internal_state",
                lease_update_body(budgets, ttl_s, chunk_limits, pressure_rule),
                timeout_s=5.0,
            )
            ok = status == 200 and lease_update_accepted(_json_or_none(answer))
        except UpstreamError:
            pass
        finally:
            self._pushing.discard(node)
        if ok:
            self._pushed[node] = key
        self.m_pushes.inc(node, "installed" if ok else "failed")

    def _revoke_pushed_leases(self) -> None:
        """Send every lease-taking node an all-zero lease (a reload to a policy without leases)."""
        for j in sorted(self._lease_takers - self._pushing):
            self._start_push(j, LeaseBudgets.zero(), 1.0, (self.policy_generation, "revoked"))

    # ---------------------------------------------------------------- control plane
    def _node_report(self, body: Any) -> dict[str, Any]:
        """A lease agent's report (``NODE_STATE_PATH``): check it (``HttpError`` 400 naming the field),
        keep the state for the next control interval, and answer with the node's lease now and how
        far ahead (wall seconds) the next control interval is."""
        node = body.get("node_id") if isinstance(body, dict) else None
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < len(self.decode):
            raise HttpError(400, f"field 'node_id' must be a decode worker index 0..{len(self.decode) - 1}")
        raw = body.get("node_state")
        try:
            state = NodeState(**{**raw, "node_id": node}) if isinstance(raw, dict) else None
        except TypeError as exc:
            raise HttpError(400, f"field 'node_state': {exc}") from None
        if state is None:
            raise HttpError(400, "field 'node_state' must be an object")
        age = body.get("state_age_s", 0.0)
        if isinstance(age, bool) or not isinstance(age, int | float) or not 0 <= age < math.inf:
            raise HttpError(400, "field 'state_age_s' must be a non-negative number of seconds")
        read_s = self.now_s() - age / self.config.time_scale
        started = body.get("started_borrowed", [])
        if not is_request_id_list(started):
            raise HttpError(400, "field 'started_borrowed' must be a list of request ids")
        self._reports[node] = (state, read_s)
        self._note_report(node, state, read_s, set(started))
        if len(self._reports) == len(self.decode):
            self._all_reported.set()
        if body.get("takes_leases") is True:
            self._lease_takers.add(node)
        else:
            self._lease_takers.discard(node)
        self.m_reports.inc(node)
        lease = self.scheduler.ledger.lease(node) if self.scheduler is not None else None
        answer: dict[str, Any] = {
            "lease": None if lease is None else {**lease.budgets.to_dict(), "expires_s": lease.expires_s}
        }
        if self._next_control_wall_s is not None:
            answer["next_control_in_s"] = max(0.0, self._next_control_wall_s - time.perf_counter())
        return answer

    async def _control_route(self, request: HttpRequest, writer: asyncio.StreamWriter) -> None:
        if request.headers.get("authorization") != f"Bearer {self.control_token}":
            await send_json(
                writer, 401, {"error": {"message": "control plane: bad or missing token", "code": 401}}
            )
            return
        if request.method == "POST" and request.path == NODE_STATE_PATH:
            await send_json(writer, 200, self._node_report(request.json()))
            return
        if request.path == POLICY_PATH and request.method == "GET":
            await send_json(writer, 200, {"policy": self.policy.to_dict()})
            return
        if request.path == POLICY_PATH and request.method == "POST":
            body = request.json()
            ref = body.get("policy") if isinstance(body, dict) else None
            if not isinstance(ref, str) or not ref.strip():
                raise HttpError(
                    400, "field 'policy' must be a catalog policy, a bundle folder or a wandb: reference"
                )
            if self.policy_loader is None:
                raise HttpError(501, "this router was started without a policy loader; it cannot reload")
            try:
                previous = await self.reload_policy(ref.strip())
            except (ValueError, FileNotFoundError, KeyError) as exc:
                raise HttpError(400, f"field 'policy': {exc}") from None
            await send_json(writer, 200, {"policy": self.policy.to_dict(), "previous": previous.to_dict()})
            return
        await send_json(
            writer, 404, {"error": {"message": f"no route {request.method} {request.path}", "code": 404}}
        )

    # ---------------------------------------------------------------- data plane
    async def _route(self, request: HttpRequest, writer: asyncio.StreamWriter) -> None:
        path, method = request.path, request.method
        api = _APIS.get(path)
        if api is not None and method == "POST":
            await self._generate(api, request, writer)
        elif method == "GET" and path in ("/health", "/liveness", "/readiness"):
            await send_text(writer, 200, "OK")
        elif method == "GET" and path == "/metrics":
            await send_text(
                writer, 200, self.registry.exposition(), "text/plain; version=0.0.4; charset=utf-8"
            )
        elif method == "GET" and path in ("/server_info", "/get_server_info"):
            await send_json(writer, 200, self.server_info())
        elif method == "GET" and path == "/workers":
            await send_json(writer, 200, self.workers_listing())
        elif method == "GET" and path == "/v1/models":
            model = {"id": self.config.model_name, "object": "model", "owned_by": "crossflow"}
            await send_json(writer, 200, {"object": "list", "data": [model]})
        else:
            await send_json(writer, 404, {"error": {"message": f"no route {method} {path}", "code": 404}})

    def server_info(self) -> dict[str, Any]:
        return {
            "crossflow_router": {
                "policy": self.policy.to_dict(),
                "prefill": [w.url for w in self.prefill],
                "decode": [w.url for w in self.decode],
            },
            TIME_SCALE_KEY: self.config.time_scale,
        }

    def workers_listing(self) -> dict[str, Any]:
        return {
            "workers": [
                {
                    "url": w.url,
                    "worker_type": w.role,
                    "is_healthy": w.available,
                    "bootstrap_port": w.bootstrap_port,
                }
                for w in self.prefill + self.decode
            ]
        }

    async def _generate(self, api: str, request: HttpRequest, writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        try:
            body = request.json()
            gen = parse_generation(api, body, cfg.model_name, cfg.vocab_size)
            n_in = len(gen.token_ids)
            if n_in + gen.max_new_tokens > cfg.context_window_tokens:
                raise HttpError(
                    400,
                    f"field 'max_new_tokens': {n_in} input + {gen.max_new_tokens} output tokens exceed the "
                    f"model's context length of {cfg.context_window_tokens} tokens",
                )
        except HttpError as exc:
            self.m_requests.inc(api, exc.status)
            await send_json(writer, exc.status, {"error": {"message": exc.message, "code": exc.status}})
            return
        if self.first_request_s is None:
            self.first_request_s = self.now_s()
        self._next_id += 1
        common = {k: v for k, v in body.items() if k not in _LEG_FIELDS}
        flight = _Flight(self._next_id, gen, self._hasher.page_hashes(gen.token_ids), dumps(common))
        client = _ClientSide(writer, gen.stream)
        try:
            status = await self._serve(flight, body, client)
        except (ConnectionError, asyncio.CancelledError):
            self.m_requests.inc(api, "client_gone")
            raise
        except Exception as exc:  # a router bug: answer it rather than cutting the connection
            status = 500
            await client.fail(gen, 500, f"router error: {type(exc).__name__}: {exc}")
        self.m_requests.inc(api, status)

    async def _serve(self, flight: _Flight, body: dict[str, Any], client: _ClientSide) -> int:
        """Choose, dispatch, fall back and retry until an answer reached the client; its status."""
        avoid: set[str] = set()
        decision = self._choose(flight, avoid)
        attempt = 0
        while True:
            attempt += 1
            try:
                if decision is not None and decision.path == "borrow":
                    return await self._borrowed(flight, body, client, decision)
                return await self._normal(flight, body, client, avoid)
            except LegFailed as exc:
                if client.started:
                    await client.fail(flight.gen, exc.status or 502, exc.message)
                    return exc.status or 502
                if decision is not None and decision.path == "borrow":  # fall back: normal path now
                    self.m_fallbacks.inc(str(decision.node_id), "refused" if exc.status == 503 else "failed")
                    decision = None
                    continue
                if exc.worker is not None:
                    avoid.add(exc.worker.name)
                if not exc.retryable or attempt >= self.config.retry.max_attempts:
                    await client.fail(flight.gen, exc.status or 502, exc.message)
                    return exc.status or 502
                self.m_retries.inc("transport" if exc.transport else str(exc.status))
                await asyncio.sleep(self.config.retry.backoff_s(attempt, self._retry_rng))

    # ---------------------------------------------------------------- decisions
    def _pick(self, role: Literal["prefill", "decode"], flight: _Flight, avoid: set[str]) -> Worker:
        workers = self.prefill if role == "prefill" else self.decode
        pool = self.prefill_pool if role == "prefill" else self.decode_pool
        rule = self._prefill_router if role == "prefill" else self._decode_router
        trees = self._prefill_trees if role == "prefill" else self._decode_trees
        n_in = len(flight.gen.token_ids)
        matches = trees.matches(flight.hashes, n_in, pool.candidates()) if rule.uses_prefix_match else {}
        idx = rule.choose(pool, n_in, matches, self._rng, lambda i: len(trees.trees[i]) * trees.page_tokens)
        chosen = workers[idx]
        if chosen.available and chosen.name not in avoid:
            return chosen
        usable = [w.idx for w in workers if w.available and w.name not in avoid]
        if not usable:
            usable = [w.idx for w in workers if w.name not in avoid] or [w.idx for w in workers]
        return workers[pool.least_loaded(usable)]

    def _choose(self, flight: _Flight, avoid: set[str]) -> PathDecision | None:
        """The scheduler's path decision (None without a scheduler: the normal path)."""
        if self.scheduler is None:
            return None
        gen, n_in = flight.gen, len(flight.gen.token_ids)
        p = self._pick("prefill", flight, avoid)
        cached = min(self._prefill_trees.match_tokens(p.idx, flight.hashes, n_in), n_in - 1)
        d = self._pick("decode", flight, avoid) if self.scheduler.uses_gateway_decode_pick else None
        queued = self._prefill_queues[p.idx].tokens(self.now_s())
        decode_cached: Mapping[int, int] = {}
        if self.config.decode_prefix_cache:
            decode_cached = self._decode_trees.matches(flight.hashes, n_in, range(len(self.decode)))
        query = PathQuery(
            request_id=flight.request_id,
            session_id=-1,
            input_tokens=n_in,
            expected_output_tokens=gen.max_new_tokens,
            normal_uncached_tokens=n_in - cached,
            normal_queue_wait_s=self.estimator.queue_wait_s(queued) if self.estimator else 0.0,
            normal_prefill_worker=p.idx,
            decode_cached_tokens=decode_cached,
            prefill_cached_tokens=cached,
            normal_decode_worker=None if d is None else d.idx,
            normal_queued_tokens=queued,
            decode_kv_load_tokens=dict(enumerate(self._decode_kv)),
            decode_kv_capacity_tokens=self.config.kv_capacity_tokens,
        )
        decision = self.scheduler.choose_path(query, self.now_s())
        flight.scheduler, flight.generation = self.scheduler, self.policy_generation
        self.m_decisions.inc(decision.path, decision.code.name.lower())
        if decision.path == "borrow":
            assert decision.reservation_id is not None and decision.node_id is not None
            self._reservation_nodes[(flight.generation, decision.reservation_id)] = decision.node_id
        flight.prefill, flight.decode = p, d
        return decision if decision.path == "borrow" else None

    # ---------------------------------------------------------------- the two paths
    def _room_fields(self, p: Worker, rid: str) -> dict[str, Any]:
        """A leg's request id and prefill worker's bootstrap fields, with a fresh room."""
        room = int(self._rooms.integers(0, 2**ROOM_BITS - 1))
        return {
            "rid": rid,
            "bootstrap_host": p.host,
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": room,
        }

    def _enter(self, flight: _Flight, d: Worker, p: Worker | None) -> None:
        gen = flight.gen
        self.decode_pool.dispatched(d.idx)
        self._decode_trees.insert(d.idx, flight.hashes)
        self._decode_kv[d.idx] += len(gen.token_ids) + gen.max_new_tokens
        if p is not None:
            self.prefill_pool.dispatched(p.idx)
            n_in = len(gen.token_ids)
            # the queue counts what the worker will compute: only a prefix a prompt it finished brought
            # is in its cache (one still queued there is not, as the simulator's worker counts it)
            cached = min(self._computed_trees.match_tokens(p.idx, flight.hashes, n_in), n_in - 1)
            flight.prefill_entry = self._prefill_queues[p.idx].add(n_in - cached, cached, self.now_s())
            self._prefill_trees.insert(p.idx, flight.hashes)

    def _prefill_left(self, flight: _Flight, p: Worker, *, computed: bool = False) -> None:
        """The prefill worker is done with the request (answered, failed, or its first token came);
        ``computed``: its prefill ended there (an answer without error, or the first token), so the
        worker now caches its prompt."""
        if computed:
            self._computed_trees.insert(p.idx, flight.hashes)
        if flight.prefill_entry is not None:
            self._prefill_queues[p.idx].remove(flight.prefill_entry, self.now_s())
            flight.prefill_entry = None

    def _leave(self, flight: _Flight, d: Worker) -> None:
        gen = flight.gen
        self.decode_pool.finished(d.idx)
        self._decode_kv[d.idx] -= len(gen.token_ids) + gen.max_new_tokens

    async def _normal(
        self, flight: _Flight, body: dict[str, Any], client: _ClientSide, avoid: set[str]
    ) -> int:
        p = flight.prefill if flight.prefill is not None and flight.prefill.name not in avoid else None
        p = p if p is not None and p.available else self._pick("prefill", flight, avoid)
        d = flight.decode if flight.decode is not None and flight.decode.name not in avoid else None
        d = d if d is not None and d.available else self._pick("decode", flight, avoid)
        flight.prefill = flight.decode = None  # a retry picks again
        rid = f"crossflow-{flight.request_id}-{secrets.token_hex(4)}"
        room = self._room_fields(p, rid)
        leg_body = _leg_json(flight.common_json, {**room, **_stream_fields(body)})
        prefill_body = _leg_json(flight.common_json, {**room, "stream": False})
        self._enter(flight, d, p)
        prefill_task = asyncio.create_task(self._prefill_leg(p, prefill_body, flight.gen.api))
        # the prefill pool counts the request until its prefill worker answered (policies.routing)
        prefill_task.add_done_callback(lambda _: self.prefill_pool.finished(p.idx))
        decode_task = asyncio.create_task(
            self._relay(
                d, leg_body, client, flight, "normal", lambda: self._prefill_left(flight, p, computed=True)
            )
        )
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done:
                exc = prefill_task.exception()
                self._prefill_left(flight, p, computed=exc is None)
                if exc is not None and not (decode_task.done() or client.started):
                    await self._cancel_leg(decode_task, d, rid)  # it would wait for a prefill that is gone
                    raise exc
            await asyncio.wait({decode_task})
            if decode_task.exception() is not None and not prefill_task.done():
                await self._cancel_leg(prefill_task, p, rid)  # the prefill leg has no decode partner
            return await decode_task
        finally:
            self._prefill_left(flight, p)
            self._leave(flight, d)
            for task in (prefill_task, decode_task):
                if not task.done():
                    task.cancel()
            await asyncio.gather(prefill_task, decode_task, return_exceptions=True)

    async def _cancel_leg(self, task: asyncio.Task[Any], w: Worker, rid: str) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert self.upstream is not None
        with contextlib.suppress(UpstreamError):
            await self.upstream.post_json(w.url + "/abort_request", {"rid": rid}, timeout_s=5.0)

    async def _prefill_leg(self, p: Worker, body: bytes, api: str) -> None:
        assert self.upstream is not None
        try:
            status, content = await self.upstream.fetch(
                "POST", p.url + _API_PATHS[api], body, headers=JSON_HEADERS
            )
        except UpstreamError as exc:
            p.breaker.record(False)
            raise LegFailed(0, f"prefill worker {p.url}: {exc}", p, transport=True) from None
        problem = (
            _event_error(_json_or_none(content))
            if status == 200
            else (status, content.decode(errors="replace")[:500])
        )
        p.breaker.record(problem is None or not is_retryable(problem[0]))
        if problem is not None:
            raise LegFailed(problem[0], f"prefill worker {p.url}: {problem[1]}", p)

    async def _borrowed(
        self, flight: _Flight, body: dict[str, Any], client: _ClientSide, decision: PathDecision
    ) -> int:
        scheduler = flight.scheduler  # the one holding the reservation, even after a reload
        assert scheduler is not None and decision.node_id is not None and decision.reservation_id is not None
        res, d = decision.reservation_id, self.decode[decision.node_id]
        p = flight.prefill if flight.prefill is not None else self._pick("prefill", flight, set())
        rid = f"crossflow-{flight.request_id}-{secrets.token_hex(4)}"
        fields = {**self._room_fields(p, rid), **_stream_fields(body), MARKER_FIELD: True}
        leg_body = _leg_json(flight.common_json, fields)
        self._enter(flight, d, None)
        started = False
        # it reaches the node now; the reports read after this show it (_note_report)
        leg = _BorrowedLeg(scheduler, res, self.now_s())
        self._borrowed_legs.setdefault(d.idx, {})[rid] = leg

        def first_token() -> None:
            nonlocal started
            started = True
            if not leg.committed:  # no report has shown its prefill begun: its first token does
                self._commit(leg, d.idx, self.now_s())
            if leg.held:
                scheduler.on_prefill_done(res)

        try:
            return await self._relay(d, leg_body, client, flight, "borrow", first_token)
        finally:
            self._leave(flight, d)
            self._reservation_nodes.pop((flight.generation, res), None)
            self._borrowed_legs.get(d.idx, {}).pop(rid, None)
            if not started:
                flight.prefill = None  # the fallback picks its prefill worker again, as the simulator
            if started:
                with contextlib.suppress(KeyError, ValueError):
                    if scheduler.ledger.status(res) in ("reserved", "committed"):
                        scheduler.on_request_finished(res)
            else:
                scheduler.on_fallback(res)

    def _note_report(self, node: int, state: NodeState, read_s: float, started: set[str]) -> None:
        """Follow the borrowed requests sent to ``node`` through its state read at ``read_s``: those
        sent before the read have arrived there (``on_task_arrival``: the node's next lease counts them
        as work its state shows; those sent later wait for the next report), and those among
        ``started`` (the node reports their prefill begun) commit their reservations
        (``on_task_reported_started`` where the scheduler has it, else ``on_task_started``), as the
        simulator commits one the moment its node starts it. Without
        that, a revocation before the first token would take back, in the router's ledger, room the
        node goes on spending, and the next lease would promise it twice."""
        legs = self._borrowed_legs.get(node)
        if not legs:
            return
        for rid, leg in legs.items():
            if leg.sent_s > read_s and rid not in started:
                continue
            if not leg.arrived:
                leg.arrived = True
                leg.scheduler.on_task_arrival(leg.reservation_id, state, read_s)
            if rid in started and not leg.committed:
                self._commit(leg, node, read_s)

    def _commit(self, leg: _BorrowedLeg, node: int, now_s: float) -> None:
        """Commit ``leg``'s reservation once, the node having started it (``on_task_reported_started``,
        which re-opens one this router revoked in the meantime); count its prefill if it held."""
        leg.committed = True
        started = getattr(leg.scheduler, "on_task_reported_started", None) or leg.scheduler.on_task_started
        ledger = leg.scheduler.ledger
        was_revoked = ledger.status(leg.reservation_id) == "revoked"
        leg.held = bool(started(leg.reservation_id, now_s))
        if leg.held and was_revoked:
            self.m_reinstatements.inc(node)
        if leg.held:
            prefill = ledger.held_by(leg.reservation_id).prefill_tokens
            self.m_borrowed_tokens.inc(node, amount=float(prefill))

    @staticmethod
    def _worker_fine(status: int, path: str) -> bool:
        """Whether an error answer says nothing against the worker (its breaker counts a success): a
        client error, or a lending node refusing borrowed work (503)."""
        return not is_retryable(status) or (path == "borrow" and status == 503)

    async def _relay(
        self, d: Worker, body: bytes, client: _ClientSide, flight: _Flight, path: str, on_first: Any
    ) -> int:
        """Send ``body`` to decode worker ``d`` and relay its answer to the client; ``LegFailed``
        before the first token (nothing was sent to the client then)."""
        assert self.upstream is not None
        api = flight.gen.api
        url = d.url + _API_PATHS[api]
        sent_s = time.perf_counter()
        scale = self.config.time_scale
        try:
            resp = await self.upstream.request("POST", url, body, headers=JSON_HEADERS)
        except UpstreamError as exc:
            d.breaker.record(False)
            raise LegFailed(0, f"decode worker {d.url}: {exc}", d, transport=True) from None
        try:
            if resp.status != 200 or not flight.gen.stream:
                whole = await resp.read()
                problem = (
                    _event_error(_json_or_none(whole))
                    if resp.status == 200
                    else (resp.status, whole.decode(errors="replace")[:500])
                )
                if problem is not None:
                    d.breaker.record(self._worker_fine(problem[0], path))
                    raise LegFailed(problem[0], f"decode worker {d.url}: {problem[1]}", d)
                d.breaker.record(True)
                on_first()
                self.m_ttft.observe((time.perf_counter() - sent_s) / scale, path)
                await client.whole(whole)
                self.m_completed.inc(path)
                return 200
            last_s, last_tokens, done = sent_s, 0, False
            async for line in resp.lines():
                data = _sse_data(line)
                if data is None:
                    continue
                if data.strip() == "[DONE]":
                    done = True
                    break
                event = loads(data)
                problem = _event_error(event)
                if problem is not None:
                    if not client.started:
                        d.breaker.record(self._worker_fine(problem[0], path))
                        raise LegFailed(problem[0], f"decode worker {d.url}: {problem[1]}", d)
                    await client.send(data)
                    continue
                now = time.perf_counter()
                if not client.started:
                    d.breaker.record(True)
                    on_first()
                    self.m_ttft.observe((now - sent_s) / scale, path)
                    await client.start()
                else:
                    tokens = _event_tokens(event)
                    k = max(1, (tokens - last_tokens) if tokens is not None else 1)
                    for _ in range(k):
                        self.m_itl.observe((now - last_s) / scale / k, path)
                last_tokens = _event_tokens(event) or last_tokens
                last_s = now
                await client.send(data)
            if not done:
                raise UpstreamError("RemoteProtocolError: the stream ended without [DONE]")
            await client.done()
            self.m_completed.inc(path)
            return 200
        except UpstreamError as exc:
            d.breaker.record(False)
            raise LegFailed(0, f"decode worker {d.url}: {exc}", d, transport=True) from None
        finally:
            await resp.close()


_LEG_FIELDS = frozenset(
    {"rid", "bootstrap_host", "bootstrap_port", "bootstrap_room", "stream", "stream_options", MARKER_FIELD}
)
"""Body fields the router sets per leg (the rest of the client's body is relayed as it came)."""


def _stream_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's streaming fields, which the decode leg keeps."""
    return {k: body[k] for k in ("stream", "stream_options") if k in body}


def _leg_json(common_json: bytes, fields: Mapping[str, Any]) -> bytes:
    """The encoded object ``common_json`` (none of ``fields``' keys in it) with ``fields`` added: the
    client's body is encoded once per request, not once per leg and attempt."""
    tail = dumps(dict(fields))
    if common_json.strip() == b"{}":
        return tail
    return common_json.rstrip()[:-1] + b"," + tail[1:]


def _json_or_none(data: bytes) -> Any:
    try:
        return loads(data)
    except ValueError:
        return None


class _ClientSide:
    """The client's end of one request: nothing is sent until the first token (or a final error)."""

    def __init__(self, writer: asyncio.StreamWriter, stream: bool) -> None:
        self.writer = writer
        self.stream = SseStream(writer) if stream else None
        self.started = False

    async def start(self) -> None:
        self.started = True
        if self.stream is not None:
            await self.stream.start()

    async def send(self, data: str) -> None:
        assert self.stream is not None
        await self.stream.send(data)

    async def done(self) -> None:
        assert self.stream is not None
        await self.stream.done()

    async def whole(self, data: bytes) -> None:
        self.started = True
        await send_bytes(self.writer, 200, data, "application/json")

    async def fail(self, gen: Generation, status: int, message: str) -> None:
        """An error answer: an HTTP error before anything was sent, else an error event and the end."""
        if not self.started:
            self.started = True
            await send_json(self.writer, status, {"error": {"message": message, "code": status}})
            return
        if self.stream is not None:
            with contextlib.suppress(ConnectionError):
                await self.stream.send(render_abort(gen, status, message))
                await self.stream.done()


__all__ = [
    "NODE_STATE_PATH",
    "POLICY_PATH",
    "PageTrees",
    "PolicyInfo",
    "PolicyLoader",
    "Router",
    "RouterConfig",
    "Worker",
]

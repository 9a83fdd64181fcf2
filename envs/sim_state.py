"""Mutable state of one simulation: requests in flight, workers, running counters.

Kept apart from the event loop in ``envs.simulator`` so the loop reads as the scheduling policy it
models. Nothing here knows about events or the scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.itl import ItlHistogram
from envs.prefix_cache import PrefixCache
from envs.request import Request
from policies.admission import LeaseTokenBucket
from policies.node_state import NodeState

NORMAL, BORROWED, FALLBACK, LOCAL = 0, 1, 2, 3
PATH_NAMES = ("normal", "borrowed", "fallback", "local")
SHED_ERROR_PREFIX = "shed: "
"""``ReqState.error`` of a request the path policy's admission control refused: unlike other refusals
it stays in the SLO denominator, a miss (``envs.metrics``)."""


class ReqState:
    """One request in flight: its path, workers, prefill progress, KV held and token times."""

    __slots__ = (
        "arrival_s",
        "bootstrapped",
        "cached",
        "context",
        "d_cached",
        "decode_worker",
        "done",
        "error",
        "finish_s",
        "first_token_s",
        "generated",
        "has_kv",
        "input",
        "kv_held",
        "last_token_s",
        "needs_recompute",
        "output",
        "path",
        "prefill_worker",
        "pull",
        "queued_estimate",
        "reservation",
        "retractions",
        "rid",
        "sent_upto",
        "started",
    )

    def __init__(self, r: Request) -> None:
        self.rid = r.request_id
        self.input = max(1, r.input_tokens)
        self.output = max(1, r.output_tokens)
        self.arrival_s = math.nan
        self.first_token_s = math.nan
        self.finish_s = math.nan
        self.last_token_s = math.nan
        self.cached = 0
        """Input tokens taken from a prefix cache instead of computed (prefill worker's, or the decode
        node's plus any pulled prefix on the borrowed path)."""
        self.done = 0
        """Input tokens whose KV exists on the prefilling worker (cached + computed)."""
        self.started = False
        self.bootstrapped = False
        """Normal path: the decode worker pre-allocated its KV, so the prefill worker may run it."""
        self.d_cached = 0
        """Normal path: leading input tokens the decode worker already holds (its radix cache)."""
        self.sent_upto = 0
        """Normal path: input positions whose KV the prefill worker has sent (or found on the decode)."""
        self.generated = 0
        self.context = 0
        """KV context on the decode worker that decode attention reads (input + generated)."""
        self.kv_held = 0
        """KV tokens allocated privately to this request on its decode worker."""
        self.has_kv = False
        self.needs_recompute = False
        self.retractions = 0
        self.path = NORMAL
        self.prefill_worker = -1
        self.decode_worker = -1
        self.reservation = -1
        self.pull = 0
        self.queued_estimate = 0
        self.error = ""


@dataclass
class Counters:
    """Running totals since the simulation started (an RL reward reads their differences)."""

    prefill_tokens: int = 0
    """Prompt tokens computed (prefill workers and borrowed prefill on decode nodes)."""
    borrowed_prefill_tokens: int = 0
    local_prefill_tokens: int = 0
    """Prompt tokens computed on decode nodes without a lease (a path policy's ``local`` requests)."""
    output_tokens: int = 0
    """Output tokens produced (first tokens included)."""
    first_tokens: int = 0
    ttft_slo_misses: int = 0
    """Requests whose first token came later than ``slo_ttft_s`` after arrival."""
    itl_slo_miss_tokens: int = 0
    """Tokens produced by iterations slower than ``slo_tpot_s``."""
    fallbacks: int = 0
    """Borrowed requests sent back to the normal path before their first token."""
    finished: int = 0
    rejected: int = 0
    """Requests refused at arrival (beyond the context window, or larger than a worker's KV)."""
    shed: int = 0
    """Requests shed at arrival by the path policy's admission control (SLO misses, not rejections)."""


@dataclass
class PrefillWorker:
    """A prefill worker: FCFS queue (requests run once their decode worker pre-allocated), prefix
    cache, the chunks of the iteration in flight, and its KV-transfer link."""

    idx: int
    cache: PrefixCache
    queue: deque[ReqState] = field(default_factory=deque)
    queued_tokens: int = 0
    """Uncomputed tokens queued (estimated from the routing-time cache match)."""
    busy: bool = False
    busy_s: float = 0.0
    batch: list[tuple[ReqState, int]] = field(default_factory=list)
    link_free_s: float = 0.0
    """When this worker's KV-transfer link finishes the transfers already queued on it."""


@dataclass
class StepWindow:
    """A decode worker's iterations that ended in the last ``window_s`` seconds, with their sums: the
    window a real worker's plugin reads its recent step times over (``(now - window_s, now]``, as
    ``serving.sglang_plugin``'s trailing window), kept exactly instead of the simulator's
    per-control-interval counters. What is summed is the simulator's: every iteration's time and
    its decode-only estimate (the plugin's decode-only mean covers pure decode steps only). Only an
    emulated cluster turns it on (``DecodeWorker.step_log``)."""

    window_s: float
    steps: deque[tuple[float, int, int, int]] = field(default_factory=deque)
    """``(end time, step ns, decode-only ns, iterations)`` per accounted piece, oldest first."""
    step_ns: int = 0
    decode_only_ns: int = 0
    count: int = 0

    def add(self, end_s: float, step_ns: int, decode_only_ns: int, iterations: int = 1) -> None:
        self.steps.append((end_s, step_ns, decode_only_ns, iterations))
        self.step_ns += step_ns
        self.decode_only_ns += decode_only_ns
        self.count += iterations
        self._drop_before(end_s - self.window_s)

    def read(self, now_s: float) -> tuple[float, float]:
        """``(mean step s, mean decode-only step s)`` over the iterations that ended in
        ``(now_s - window_s, now_s]``; zeros when none did."""
        self._drop_before(now_s - self.window_s)
        if not self.count:
            return 0.0, 0.0
        return self.step_ns * 1e-9 / self.count, self.decode_only_ns * 1e-9 / self.count

    def _drop_before(self, horizon_s: float) -> None:
        steps = self.steps
        while steps and steps[0][0] <= horizon_s:
            _, step_ns, decode_only_ns, iterations = steps.popleft()
            self.step_ns -= step_ns
            self.decode_only_ns -= decode_only_ns
            self.count -= iterations


@dataclass
class DecodeWorker:
    """A decode worker: pre-allocation queue, waiting and running requests, borrowed prefill tasks,
    KV accounting, its lease's token bucket, and the iteration (or jump of identical iterations) in
    flight."""

    idx: int
    cache: PrefixCache | None
    capacity_tokens: int
    bucket: LeaseTokenBucket
    prealloc: deque[ReqState] = field(default_factory=deque)
    """Dispatched requests waiting for KV room before their prefill may start (SGLang's
    DecodePreallocQueue)."""
    waiting: deque[ReqState] = field(default_factory=deque)
    """Requests whose KV is here (transferred, or borrowed and prefilled), waiting for a running slot."""
    retracted: deque[ReqState] = field(default_factory=deque)
    """Requests retracted for lack of KV, waiting to take their KV back (they resume first)."""
    running: list[ReqState] = field(default_factory=list)
    borrowed: deque[ReqState] = field(default_factory=deque)
    local: deque[ReqState] = field(default_factory=deque)
    """Requests a path policy sent here without a lease, waiting for or in their chunked prefill."""
    kv_used: int = 0
    """KV tokens allocated to requests (pre-allocated inputs included); the prefix cache lives in the rest."""
    n_active: int = 0
    """Requests holding KV here (transferring, waiting with KV, running, borrowed and started); each
    keeps ``num_reserved_decode_tokens`` in reserve at pre-allocation."""
    retracted_tokens: int = 0
    """KV the retracted requests waiting here need to resume (held back from pre-allocation)."""
    busy: bool = False
    busy_ns: int = 0
    """Time spent iterating, in integer nanoseconds (exact and independent of how iterations group)."""
    generation: int = 0
    link_free_s: float = 0.0
    wake_pending: bool = False
    # current iteration, or jump of identical decode-only iterations
    iter_times_s: list[float] | np.ndarray = field(default_factory=list)
    """Duration of each iteration of the jump in flight (one entry for a mixed iteration)."""
    iter_ends_s: list[float] | np.ndarray = field(default_factory=list)
    """End time of each, accumulated one iteration after the other as single events would be."""
    iter_applied: int = 0
    """Iterations of the jump whose tokens are already applied (``Simulator._sync``)."""
    iter_ns: tuple[np.ndarray, np.ndarray, int] | None = None
    """A jump's iteration times in integer nanoseconds, their running sums (from 0) and the index of
    the first iteration over the TPOT SLO, made at its first partial application when its times never
    decrease (``Simulator._account_jump``); ``None`` otherwise and at every new jump."""
    iter_ascending: bool = False
    """The jump's iteration times are known not to decrease (a decode jump's are, when the time per
    context token is not negative), so ``Simulator._account_jump`` need not check them."""
    iter_decode_only_s: float = 0.0
    iter_prefill: list[tuple[ReqState, int]] = field(default_factory=list)
    iter_credit_wait: bool = False
    """The jump in flight waits for borrowed-prefill credit: each iteration's end (the next one's start)
    is where single iterations would have checked the token bucket, so applying it advances the bucket
    there (``Simulator._advance_decode``)."""
    itl: ItlHistogram = field(default_factory=ItlHistogram)
    """Inter-token latencies of this worker's tokens."""
    # per control interval accounting (integer nanoseconds)
    step_time_ns: int = 0
    decode_only_ns: int = 0
    """What the same iterations would have taken without prefill mixed in."""
    step_count: int = 0
    step_log: StepWindow | None = None
    """The iterations of a trailing window, for an emulated worker's reports (``StepWindow``);
    ``None`` in a plain simulation (nothing is logged)."""
    decode_tokens_total: int = 0
    """Decode tokens the iterations produced since the start ..."""
    mixed_decode_tokens_total: int = 0
    """... and of them, those of iterations that mixed in borrowed or local prefill."""
    iterations: int = 0
    """Forward iterations run so far (those inside a jump included)."""
    borrowed_tokens_total: int = 0
    """Borrowed prefill tokens executed on this node (spent from its token bucket)."""
    tick_state: tuple[tuple[int, ...], NodeState] | None = None
    """The state reported at the last control interval while the node was idle, with what it was
    built from (``Simulator._tick_states`` hands it again while that is unchanged)."""


class DecodeCacheMatches(Mapping[int, int]):
    """node id -> prefix tokens of ``req`` cached on that decode node, looked up on first access.

    The scheduler reads it only for nodes whose lease could take the request, and only when the
    prefill pool is congested, so most arrivals never walk the decode caches at all.
    """

    def __init__(self, workers: Sequence[DecodeWorker], req: ReqState) -> None:
        self._workers = {w.idx: w for w in workers if w.cache is not None}
        self._req = req
        self._found: dict[int, int] = {}

    def __getitem__(self, node_id: int) -> int:
        if node_id not in self._found:
            cache = self._workers[node_id].cache
            assert cache is not None
            self._found[node_id] = min(cache.match_tokens(self._req.rid), self._req.input - 1)
        return self._found[node_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)


class RouterKvLoad(Mapping[int, int]):
    """node id -> KV tokens a router counts on that decode node: allocated, plus the inputs of requests
    routed there that hold none yet (waiting to pre-allocate, or borrowed/local and not started).

    Each node is read once, on first access, and kept: one object per simulated instant makes
    decisions taken at the same instant blind to each other, as concurrent decisions are in a router
    that peeks at the load before it books the request.
    """

    def __init__(
        self, workers: Sequence[DecodeWorker], before_read: Callable[[DecodeWorker], None] | None = None
    ) -> None:
        self._workers = workers
        self._before_read = before_read
        """Brings a worker up to date before it is read (the simulator's ``_sync`` of a decode jump)."""
        self._found: dict[int, int] = {}

    def __getitem__(self, node_id: int) -> int:
        if node_id not in self._found:
            if not 0 <= node_id < len(self._workers):
                raise KeyError(node_id)
            w = self._workers[node_id]
            if self._before_read is not None:
                self._before_read(w)
            pending = sum(r.input for r in w.prealloc)
            pending += sum(r.input for q in (w.borrowed, w.local) for r in q if not r.started)
            self._found[node_id] = w.kv_used + pending
        return self._found[node_id]

    def get(self, node_id: int, default: Any = None) -> Any:
        """``Mapping.get`` without its ``try``/``except`` (a path policy reads every node per request)."""
        found = self._found.get(node_id)
        if found is not None:
            return found
        return self[node_id] if 0 <= node_id < len(self._workers) else default

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._workers)))

    def __len__(self) -> int:
        return len(self._workers)

"""Worker selection as SGLang's gateway does it: the rules the simulator and the HTTP router share.

A router keeps, per pool (prefill or decode), how many requests it has dispatched to each worker and
not yet seen finish (``load``: in the prefill pool a request counts until the prefill worker
answers, i.e. through its queue, its prefill and its KV transfer; in the decode pool from the
moment it is dispatched, which under PD dual dispatch is the request's arrival, through prefill,
transfer and decode) and how many it ever dispatched there (``processed``, a tie-break). A
cache-aware rule also needs, for the request at hand, how many of its leading input tokens the
router's approximate tree says each worker holds (``matches``) — the caller computes that
(the simulator from its prefix index, the HTTP router from token ids) and passes it in.

Rules (``make_routing_policy(name)``):

* ``cache_aware`` — smg 1.13.0 with no policy flags (``smg launch --pd-disaggregation ...``), the
  default for both pools. Source: smg-project/smg ``model_gateway/src/policies/cache_aware.rs``
  (``select_worker``, ``select_worker_with_text``, ``select_matched_candidate``,
  ``gate_selected_candidate``) and the 1.13.0 wheel's ``smg/router_args.py`` (defaults, lines
  89-95; the spill-gate help text, lines 688-712). Per request:

  1. ``match_rate = best matched tokens / input tokens``; if it exceeds ``cache_threshold`` (0.3),
     the candidates are the workers holding that longest match ("tenants"), and the least loaded
     of them is chosen (ties broken uniformly at random); otherwise the least-loaded worker of the
     pool (ties: fewer ``processed``, then lower index).
  2. Spill gate on a cache hit: if the chosen worker's load exceeds both
     ``balance_rel_threshold`` (1.5) x the pool's mean load and the mean plus a margin, the request
     goes to the least-loaded worker instead. The margin is ``balance_abs_threshold`` (64) capped at
     the in-flight count's natural swing at the current mean, two standard deviations of a Poisson
     count (``2 sqrt(mean)``), never under 4 unless ``balance_abs_threshold`` itself is lower.

  Overload protection (on by default in smg 1.13.0, ``router_args.py`` lines 271-275 and the
  ``--worker-overload-*`` help): a worker whose polled backend load shows at least 8 waiting
  requests or at least 0.8 KV token usage is left out while another worker is under both; when every
  worker is over them, all are candidates. The caller refreshes ``WorkerPool.overloaded`` from the
  workers' reported loads every ``load_monitor_interval_s`` (10 s).

  Not modelled: smg's warm-up slice for freshly started or emptied ("thin") workers and its KV-usage
  balance triggers (off by default).
* ``sglang_router_cache_aware`` — sglang-router 0.3.2's older rule (no overload protection): if the
  pool is imbalanced (``max - min > 64`` and ``max > 1.5 x min`` in-flight requests) the
  least-loaded worker; otherwise the best match if ``match_rate > 0.3``, else the worker with the
  smallest tree.
* ``round_robin``, ``least_load`` (fewest in-flight requests, smg's tie-break), ``power_of_two``
  (two distinct workers drawn at random, the less loaded wins).

Rules are deterministic given the ``numpy`` generator the caller passes (seeded per simulation).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

ROUTING_POLICIES = ("cache_aware", "sglang_router_cache_aware", "round_robin", "least_load", "power_of_two")
"""Names accepted by ``make_routing_policy`` (and ``ClusterConfig.prefill_routing`` / ``decode_routing``)."""


@dataclass(frozen=True, slots=True)
class OverloadProtection:
    """smg 1.13.0's worker overload protection defaults (``router_args.py`` lines 88, 271-275)."""

    waiting_requests: int = 8
    """A worker with at least this many waiting requests is overloaded."""
    token_usage: float = 0.8
    """A worker whose KV token usage is at least this share is overloaded."""
    load_monitor_interval_s: float = 10.0
    """How often the gateway polls the workers' loads."""

    def is_overloaded(self, waiting_requests: int, token_usage: float) -> bool:
        return waiting_requests >= self.waiting_requests or token_usage >= self.token_usage


SCANNED_POOL_WORKERS = 16
"""Pools of at most this many workers find their least-loaded worker by a scan (``WorkerPool``)."""


class WorkerPool:
    """A router's per-worker view of one pool: in-flight requests, dispatch counts, overload flags.

    Indexed so a choice costs the same in a pool of 4 workers as in one of 256: the least-loaded
    candidate comes from a heap (stale entries dropped lazily), the candidates' mean load from a
    running sum, and the candidate list changes only when a load poll changes the overload flags.
    A pool of at most ``SCANNED_POOL_WORKERS`` keeps no heap: scanning it is cheaper than keeping one
    up to date at every dispatch and finish (the same choice: fewest in-flight, fewest dispatched,
    lowest index).
    """

    __slots__ = (
        "_all_candidates",
        "_by_load",
        "_cand_load",
        "_cand_set",
        "_candidates",
        "_heap",
        "_pending",
        "_pending_at_s",
        "load",
        "overloaded",
        "processed",
        "same_instant_race",
    )

    def __init__(self, n_workers: int, *, same_instant_race: bool = False) -> None:
        if n_workers < 1:
            raise ValueError(f"WorkerPool needs at least one worker, got {n_workers}")
        self.load = [0] * n_workers
        """Requests dispatched to each worker and not finished there."""
        self.processed = [0] * n_workers
        """Requests ever dispatched to each worker."""
        self.overloaded = [False] * n_workers
        """From the last load poll (``OverloadProtection``, set with ``set_overloaded``); overloaded
        workers are skipped while another is not."""
        self._candidates = list(range(n_workers))
        self._cand_set = frozenset(self._candidates)
        self._all_candidates = True
        self._cand_load = 0
        indexed = n_workers > SCANNED_POOL_WORKERS
        self._heap = [(0, 0, i) for i in range(n_workers)] if indexed else None
        self._by_load: dict[int, list[int]] | None = {0: list(range(n_workers))} if indexed else None
        """Workers at each in-flight count, ascending (``None`` with the heap: a scanned pool)."""
        self.same_instant_race = same_instant_race
        """Model smg 1.13.0's race between selection and load accounting: dispatches made at one
        instant become visible to choices made at a later instant only (``dispatched(w, now_s)``
        defers them; ``at(now_s)`` or any ``finished`` applies them). Measured through smg on the
        emulated cluster: ten requests that reach it at once go nine to one prefill worker under
        ``cache_aware`` and under ``least_load``, while the same requests 50 ms apart alternate under
        ``least_load``. Off (every dispatch visible at once) is how Crossflow's router counts."""
        self._pending: list[int] = []
        self._pending_at_s = -math.inf

    def __len__(self) -> int:
        return len(self.load)

    def set_overloaded(self, flags: list[bool]) -> None:
        """The overload flags of a new load poll."""
        if len(flags) != len(self.load):
            raise ValueError(f"{len(flags)} overload flags for {len(self.load)} workers")
        if flags == self.overloaded:
            return
        self.overloaded = list(flags)
        ok = [i for i, over in enumerate(flags) if not over]
        self._candidates = ok if ok else list(range(len(self.load)))
        self._cand_set = frozenset(self._candidates)
        self._all_candidates = not any(flags)
        self._cand_load = sum(self.load[i] for i in self._candidates)

    def candidates(self) -> list[int]:
        """Workers a request may go to: those not overloaded, or every worker if all are (ascending)."""
        return self._candidates

    def is_candidate(self, worker: int) -> bool:
        return worker in self._cand_set

    @property
    def all_candidates(self) -> bool:
        """No worker is left out by overload protection."""
        return self._all_candidates

    def mean_candidate_load(self) -> float:
        return self._cand_load / len(self._candidates)

    def _moved(self, worker: int, delta: int) -> None:
        if worker in self._cand_set:
            self._cand_load += delta
        by_load, load = self._by_load, self.load[worker]
        if by_load is None or self._heap is None:  # a scanned pool
            return
        old = by_load[load - delta]
        if len(old) == 1:  # it was alone at its old load
            del by_load[load - delta]
        else:
            del old[bisect.bisect_left(old, worker)]
        peers = by_load.get(load)
        if peers is None:
            by_load[load] = [worker]
        else:
            bisect.insort(peers, worker)
        heapq.heappush(self._heap, (load, self.processed[worker], worker))
        if len(self._heap) > 4 * len(self.load) + 64:  # drop stale entries
            self._heap = [(self.load[i], self.processed[i], i) for i in range(len(self.load))]
            heapq.heapify(self._heap)

    def at(self, now_s: float) -> None:
        """A choice is about to be made at ``now_s``: dispatches deferred from an earlier instant
        become visible (a no-op unless ``same_instant_race``)."""
        if self._pending and now_s != self._pending_at_s:
            self._apply_pending()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for worker in pending:
            self._count_dispatch(worker)

    def dispatched(self, worker: int, now_s: float | None = None) -> None:
        """A request was sent to ``worker`` (at ``now_s``: needed with ``same_instant_race``, which
        holds the count back from choices made at that same instant)."""
        if self.same_instant_race:
            if now_s is None:
                raise ValueError("WorkerPool(same_instant_race=True).dispatched needs now_s")
            self.at(now_s)
            self._pending.append(worker)
            self._pending_at_s = now_s
            return
        self._count_dispatch(worker)

    def _count_dispatch(self, worker: int) -> None:
        self.load[worker] += 1
        self.processed[worker] += 1
        self._moved(worker, 1)

    def finished(self, worker: int) -> None:
        if self._pending:
            self._apply_pending()
        if self.load[worker] <= 0:
            raise ValueError(f"worker {worker} has no request in flight to finish")
        self.load[worker] -= 1
        self._moved(worker, -1)

    def least_loaded(self, candidates: list[int] | None = None) -> int:
        """smg's min-load pick among ``candidates`` (default: ``candidates()``): fewest in-flight
        requests, then fewest dispatched, then lowest index."""
        load, processed = self.load, self.processed
        if candidates is not None:
            best = candidates[0]
            for i in candidates[1:]:
                if load[i] < load[best] or (load[i] == load[best] and processed[i] < processed[best]):
                    best = i
            return best
        heap, skipped = self._heap, []
        if heap is None:  # a scanned pool
            return self.least_loaded(self._candidates)
        while True:
            entry = heap[0]
            ld, pr, i = entry
            if ld != load[i] or pr != processed[i]:
                heapq.heappop(heap)  # stale
            elif i not in self._cand_set:
                skipped.append(heapq.heappop(heap))
            else:
                break
        for kept in skipped:
            heapq.heappush(heap, kept)
        return i

    def least_loaded_ties(self) -> list[int]:
        """The candidates with the fewest in-flight requests, ascending."""
        lowest = self.load[self.least_loaded()]
        if self._by_load is None:  # a scanned pool
            return [i for i in self._candidates if self.load[i] == lowest]
        return [i for i in self._by_load[lowest] if i in self._cand_set]


Matches = Mapping[int, int]
"""``worker index -> leading input tokens of this request the router's tree holds for that worker``,
for the workers holding any (absent: none)."""


class UniformMatches(Mapping[int, int]):
    """``Matches`` where every eligible worker of a pool matches the same ``tokens`` (a prefix all of
    them cache, such as a common system prompt), answered without listing the pool."""

    __slots__ = ("_eligible", "_n", "tokens")

    def __init__(self, tokens: int, n_workers: int, eligible: Callable[[int], bool] | None = None) -> None:
        self.tokens = tokens
        self._n = n_workers
        self._eligible = eligible

    def __contains__(self, worker: object) -> bool:
        return (
            isinstance(worker, int)
            and 0 <= worker < self._n
            and (self._eligible is None or self._eligible(worker))
        )

    def __getitem__(self, worker: int) -> int:
        if worker not in self:
            raise KeyError(worker)
        return self.tokens

    def __iter__(self) -> Iterator[int]:
        return (i for i in range(self._n) if i in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


TreeSizeFn = Callable[[int], int]
"""``worker index -> tokens in the router's tree for that worker`` (only the legacy rule asks)."""


class RoutingPolicy(Protocol):
    """Picks a worker of ``pool`` for one request."""

    @property
    def name(self) -> str: ...

    @property
    def uses_prefix_match(self) -> bool:
        """True when ``choose`` reads ``matches`` (the caller may skip computing them otherwise)."""
        ...

    def choose(
        self,
        pool: WorkerPool,
        input_tokens: int,
        matches: Matches,
        rng: np.random.Generator,
        tree_tokens: TreeSizeFn | None = None,
    ) -> int: ...


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """smg 1.13.0's command-line defaults for ``cache_aware`` (``smg/router_args.py``, lines 89-95)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 2**26
    """Characters in the router's approximate tree, shared by all workers of the model."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(
                f"CacheAwareConfig.cache_threshold must be in [0, 1], got {self.cache_threshold}"
            )
        if self.balance_abs_threshold < 0 or not self.balance_rel_threshold >= 1.0:
            raise ValueError("CacheAwareConfig: balance_abs_threshold >= 0 and balance_rel_threshold >= 1")
        if self.eviction_interval_s <= 0 or self.max_tree_size < 1:
            raise ValueError("CacheAwareConfig: eviction_interval_s and max_tree_size must be positive")

    def spill_margin(self, mean_load: float) -> float:
        """Absolute part of the spill gate at a pool mean of ``mean_load`` in-flight requests."""
        floor = min(4.0, float(self.balance_abs_threshold))
        swing = 2.0 * math.sqrt(max(mean_load, 0.0))
        return min(float(self.balance_abs_threshold), max(swing, floor))


@dataclass(frozen=True, slots=True)
class CacheAware:
    """smg's ``cache_aware`` (see the module docstring)."""

    config: CacheAwareConfig = CacheAwareConfig()
    name: str = "cache_aware"
    uses_prefix_match: bool = True

    def choose(
        self,
        pool: WorkerPool,
        input_tokens: int,
        matches: Matches,
        rng: np.random.Generator,
        tree_tokens: TreeSizeFn | None = None,
    ) -> int:
        if len(pool) == 1:
            return 0
        cands = pool.candidates()
        if len(cands) == 1:
            return cands[0]
        load = pool.load
        if isinstance(matches, UniformMatches) and pool.all_candidates and matches.tokens > 0:
            # every candidate holds the same match: the least-loaded ones are the tenants, and a
            # least-loaded worker never trips the spill gate (its load is at most the mean)
            if input_tokens <= 0 or matches.tokens / input_tokens <= self.config.cache_threshold:
                return pool.least_loaded()
            ties = pool.least_loaded_ties()
            return ties[0] if len(ties) == 1 else ties[int(rng.integers(len(ties)))]
        # the candidates holding the longest match, ascending (tenants), and that match
        best, tenants = 0, []
        for i, m in matches.items():
            if m >= best and m > 0 and pool.is_candidate(i):
                if m > best:
                    best, tenants = m, [i]
                else:
                    tenants.append(i)
        if input_tokens <= 0 or best / input_tokens <= self.config.cache_threshold:
            return pool.least_loaded()
        if len(tenants) == 1:
            chosen = tenants[0]
        else:
            tenants.sort()
            lowest = min(load[i] for i in tenants)
            holders = [i for i in tenants if load[i] == lowest]
            chosen = holders[0] if len(holders) == 1 else holders[int(rng.integers(len(holders)))]
        mean = pool.mean_candidate_load()
        cfg = self.config
        if load[chosen] > mean * cfg.balance_rel_threshold and load[chosen] > mean + cfg.spill_margin(mean):
            return pool.least_loaded()
        return chosen


@dataclass(frozen=True, slots=True)
class SglangRouterCacheAware:
    """sglang-router 0.3.2's ``cache_aware``: global imbalance check, then best match or smallest tree."""

    config: CacheAwareConfig = CacheAwareConfig()
    name: str = "sglang_router_cache_aware"
    uses_prefix_match: bool = True

    def choose(
        self,
        pool: WorkerPool,
        input_tokens: int,
        matches: Matches,
        rng: np.random.Generator,
        tree_tokens: TreeSizeFn | None = None,
    ) -> int:
        n = len(pool)
        if n == 1:
            return 0
        load, cfg = pool.load, self.config
        hi, lo = max(load), min(load)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            return pool.least_loaded(list(range(n)))
        best = max(range(n), key=lambda i: (matches.get(i, 0), -i))
        if input_tokens > 0 and matches.get(best, 0) / input_tokens > cfg.cache_threshold:
            return best
        if tree_tokens is None:
            raise ValueError("sglang_router_cache_aware needs the router tree's size per worker")
        return min(range(n), key=lambda i: (tree_tokens(i), i))


class RoundRobin:
    """Each pool cycles through its workers (one counter per policy object)."""

    name = "round_robin"
    uses_prefix_match = False

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        pool: WorkerPool,
        input_tokens: int,
        matches: Matches,
        rng: np.random.Generator,
        tree_tokens: TreeSizeFn | None = None,
    ) -> int:
        cands = pool.candidates()
        chosen = cands[self._next % len(cands)]
        self._next += 1
        return chosen


@dataclass(frozen=True, slots=True)
class LeastLoad:
    """Fewest in-flight requests (smg's min-load tie-break)."""

    name: str = "least_load"
    uses_prefix_match: bool = False

    def choose(
        self,
        pool: WorkerPool,
        input_tokens: int,
        matches: Matches,
        rng: np.random.Generator,
        tree_tokens: TreeSizeFn | None = None,
    ) -> int:
        return pool.least_loaded()


@dataclass(frozen=True, slots=True)
class PowerOfTwo:
    """Two distinct workers drawn uniformly at random; the one with fewer in-flight requests wins."""

    name: str = "power_of_two"
    uses_prefix_match: bool = False

    def choose(
        self,
        pool: WorkerPool,
        input_tokens: int,
        matches: Matches,
        rng: np.random.Generator,
        tree_tokens: TreeSizeFn | None = None,
    ) -> int:
        cands = pool.candidates()
        if len(cands) == 1:
            return cands[0]
        a, b = (cands[int(x)] for x in rng.choice(len(cands), size=2, replace=False))
        load = pool.load
        return a if (load[a], a) <= (load[b], b) else b


def make_routing_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> RoutingPolicy:
    """A fresh routing rule by name (see ``ROUTING_POLICIES``); a new object per pool."""
    cfg = cache_aware or CacheAwareConfig()
    if name == "cache_aware":
        return CacheAware(cfg)
    if name == "sglang_router_cache_aware":
        return SglangRouterCacheAware(cfg)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo()
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTING_POLICIES)}")


def check_routing_name(field: str, name: str) -> None:
    """Raise ``ValueError`` naming ``field`` when ``name`` is not a routing policy."""
    if name not in ROUTING_POLICIES:
        raise ValueError(
            f"{field}: unknown routing policy {name!r}; choose from {', '.join(ROUTING_POLICIES)}"
        )


__all__ = [
    "ROUTING_POLICIES",
    "CacheAware",
    "CacheAwareConfig",
    "LeastLoad",
    "OverloadProtection",
    "PowerOfTwo",
    "RoundRobin",
    "RoutingPolicy",
    "SglangRouterCacheAware",
    "WorkerPool",
    "check_routing_name",
    "make_routing_policy",
]

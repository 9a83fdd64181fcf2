"""Prefix caching over a trace's compact prefix identity.

Every request names the earlier request whose input prefix it extends (``parent_id``) and how many
leading tokens they share. Cutting inputs into pages of ``page_tokens``, page ``j`` of request ``r``
is the *same* KV as page ``j`` of its parent when it lies wholly inside the shared prefix, and a new
page otherwise. So a request's pages form a short list of **segments** ``(origin, first_page,
end_page)``: runs of pages first computed by request ``origin``.

A worker's cache holds, per origin, how far that origin's run is cached. Lookups walk the segments
from the root, as a radix tree would, and stop at the first page that is missing. Eviction is LRU
over origins; a lookup touches ancestors after descendants, so the least recently used entries are
always leaves and a cached run never loses the pages under it (SGLang's radix cache evicts leaves
first for the same reason).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from envs.request import Request
from policies.routing import UniformMatches

Segment = tuple[int, int, int]
"""(origin request id, first page, end page) — pages [first, end) were first computed by origin."""


class PrefixIndex:
    """Page segments of every request of one trace (built once, shared by all workers)."""

    def __init__(self, requests: Sequence[Request], page_tokens: int = 256, memo_size: int = 16384) -> None:
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        self.page_tokens = page_tokens
        self._parent = [r.parent_id for r in requests]
        self._shared_pages = [r.shared_prefix_tokens // page_tokens for r in requests]
        self._pages = [r.input_tokens // page_tokens for r in requests]
        self._memo: dict[int, tuple[Segment, ...]] = {}
        self._memo_size = memo_size

    def add(self, request: Request) -> None:
        """Index one more request (a live cluster's arrivals): its id must be the next one, and its
        parent an earlier request."""
        rid = len(self._parent)
        if request.request_id != rid:
            raise ValueError(
                f"PrefixIndex.add: request_id must be {rid} (the next id), got {request.request_id}"
            )
        if request.parent_id >= rid:
            raise ValueError(f"PrefixIndex.add: parent_id {request.parent_id} is not an earlier request")
        self._parent.append(request.parent_id)
        self._shared_pages.append(request.shared_prefix_tokens // self.page_tokens)
        self._pages.append(request.input_tokens // self.page_tokens)

    def pages(self, request_id: int) -> int:
        """Whole input pages of the request (a trailing partial page is never cached)."""
        return self._pages[request_id]

    def segments(self, request_id: int) -> tuple[Segment, ...]:
        """The request's page runs, root first.

        A request's runs are its parent's runs cut at the shared prefix, plus its own new pages, so they
        are built from the parent's (memoised for recently used requests: a session's next turn almost
        always follows its parent closely).
        """
        memo = self._memo
        found = memo.get(request_id)
        if found is not None:
            return found
        chain = [request_id]  # walk up to a memoised ancestor or a root
        while True:
            parent = self._parent[chain[-1]]
            if parent < 0 or self._shared_pages[chain[-1]] == 0 or parent in memo:
                break
            chain.append(parent)
        segs: tuple[Segment, ...] = ()
        for rid in reversed(chain):
            end = self._pages[rid]
            parent = self._parent[rid]
            shared = min(self._shared_pages[rid], end) if parent >= 0 else 0
            if shared > 0:
                base = memo[parent] if parent in memo else segs
                i = len(base)
                while i and base[i - 1][1] >= shared:
                    i -= 1
                kept = list(base[:i])
                if kept and kept[-1][2] > shared:
                    origin, first, _ = kept[-1]
                    kept[-1] = (origin, first, shared)
                if end > shared:
                    kept.append((rid, shared, end))
                segs = tuple(kept)
            else:
                segs = ((rid, 0, end),) if end > 0 else ()
            memo[rid] = segs
        while len(memo) > self._memo_size:  # FIFO bound on memory
            del memo[next(iter(memo))]
        return segs


class PoolHolders:
    """For the caches of one pool: which workers hold each origin's run, and how far (a count per
    cached end), so a router finds the workers that can match a request without asking every one."""

    __slots__ = ("ends", "owners")

    def __init__(self) -> None:
        self.owners: dict[int, set[int]] = {}
        self.ends: dict[int, dict[int, int]] = {}
        """origin -> {cached end page: how many workers cache the run that far}."""

    def add(self, origin: int, owner: int, end: int) -> None:
        self.owners.setdefault(origin, set()).add(owner)
        ends = self.ends.setdefault(origin, {})
        ends[end] = ends.get(end, 0) + 1

    def extend(self, origin: int, old_end: int, new_end: int) -> None:
        ends = self.ends[origin]
        ends[old_end] -= 1
        if not ends[old_end]:
            del ends[old_end]
        ends[new_end] = ends.get(new_end, 0) + 1

    def remove(self, origin: int, owner: int, end: int) -> None:
        owners = self.owners[origin]
        owners.discard(owner)
        ends = self.ends[origin]
        ends[end] -= 1
        if not ends[end]:
            del ends[end]
        if not owners:
            del self.owners[origin], self.ends[origin]

    def holding_at_least(self, origin: int, end: int) -> int:
        """Workers whose cache holds ``origin``'s run up to ``end`` or further."""
        return sum(n for e, n in self.ends.get(origin, {}).items() if e >= end)


class PrefixCache:
    """One worker's LRU prefix cache, counted in pages.

    ``holders``/``owner``: the caches of one pool may share a ``PoolHolders`` (``owner`` is this
    cache's worker), see ``pool_caches`` and ``match_in_pool``.
    """

    def __init__(
        self,
        index: PrefixIndex,
        capacity_pages: int,
        *,
        holders: PoolHolders | None = None,
        owner: int = -1,
    ) -> None:
        self.index = index
        self.capacity_pages = capacity_pages
        self.used_pages = 0
        self._cached_end: OrderedDict[int, int] = OrderedDict()
        self._first: dict[int, int] = {}
        self._holders = holders
        self._owner = owner

    def match_tokens(self, request_id: int, *, touch: bool = False) -> int:
        """Leading input tokens of the request already cached here."""
        cached_end_of, first_of = self._cached_end, self._first
        matched = 0
        hit: list[int] = []
        for origin, first, end in self.index.segments(request_id):
            cached_end = cached_end_of.get(origin)
            if cached_end is None or first_of[origin] > first:
                break
            upto = cached_end if cached_end < end else end
            matched += upto - first
            hit.append(origin)
            if upto < end:
                break
        if touch and hit:
            move = cached_end_of.move_to_end
            for origin in reversed(hit):
                move(origin)
        return matched * self.index.page_tokens

    def insert(self, request_id: int) -> None:
        """Cache all of the request's input pages (after its prefill), evicting LRU runs as needed."""
        segs = self.index.segments(request_id)
        cached_end_of, holders = self._cached_end, self._holders
        for origin, first, end in segs:
            cached_end = cached_end_of.get(origin)
            if cached_end is None:
                cached_end_of[origin] = end
                self._first[origin] = first
                self.used_pages += end - first
                if holders is not None:
                    holders.add(origin, self._owner, end)
            elif end > cached_end:
                cached_end_of[origin] = end
                self.used_pages += end - cached_end
                if holders is not None:
                    holders.extend(origin, cached_end, end)
        move = cached_end_of.move_to_end
        for origin, _, _ in reversed(segs):
            move(origin)
        if self.used_pages > self.capacity_pages:
            self.evict_to(self.capacity_pages, keep=segs[0][0] if segs else -1)

    def evict_to(self, capacity_pages: int, keep: int = -1) -> None:
        """Evict least recently used runs until at most ``capacity_pages`` are held.

        ``keep`` is an origin that survives as the last entry standing: ``insert`` passes the root
        run of the request it just cached, so a request larger than the cache keeps its prefix start.
        """
        self.capacity_pages = capacity_pages
        while self.used_pages > capacity_pages and self._cached_end:
            origin, end = next(iter(self._cached_end.items()))
            if origin == keep and len(self._cached_end) == 1:
                break
            del self._cached_end[origin]
            self.used_pages -= end - self._first.pop(origin)
            if self._holders is not None:
                self._holders.remove(origin, self._owner, end)


def pool_caches(index: PrefixIndex, n_workers: int, capacity_pages: int) -> list[PrefixCache]:
    """One cache per worker of a pool, sharing a holders map (see ``PrefixCache``)."""
    holders = PoolHolders()
    return [PrefixCache(index, capacity_pages, holders=holders, owner=i) for i in range(n_workers)]


def _walk(cache: PrefixCache, segs: Sequence[Segment]) -> tuple[int, int]:
    """(matched pages, index of the segment the walk stopped in or ``len(segs)``)."""
    cached_end_of, first_of = cache._cached_end, cache._first
    matched = 0
    for j, (origin, first, end) in enumerate(segs):
        cached_end = cached_end_of.get(origin)
        if cached_end is None or first_of[origin] > first:
            return matched, j
        upto = cached_end if cached_end < end else end
        matched += upto - first
        if upto < end:
            return matched, j
    return matched, len(segs)


def match_in_pool(
    caches: Sequence[PrefixCache],
    request_id: int,
    eligible: Callable[[int], bool] | None = None,
    *,
    all_eligible: bool = False,
) -> Mapping[int, int]:
    """``{worker: tokens}`` for the ``eligible`` workers of a pool (made by ``pool_caches``) whose cache
    holds the longest match of the request's prefix among them — exactly the workers a cache-aware
    router can pick on a hit.

    Only the eligible holders of the deepest run any of them holds are walked: a worker without that
    run matches at most up to where it starts, less than any holder. (A holder whose walk stops
    earlier would break that argument; then every eligible worker is walked.) When every worker
    holds that run to its end and ``all_eligible`` says no worker is left out, the answer is a
    ``policies.routing.UniformMatches`` (constant time in the pool size).
    """
    if not caches:
        return {}
    holders = caches[0]._holders
    if holders is None:
        raise ValueError("match_in_pool needs caches made by pool_caches")
    segs = caches[0].index.segments(request_id)
    page = caches[0].index.page_tokens
    for j in range(len(segs) - 1, -1, -1):
        origin, first, end = segs[j]
        owners = holders.owners.get(origin)
        if owners and len(owners) == len(caches) and (eligible is None or all_eligible):
            # Every worker holds the deepest run anyone holds. Its ancestors' runs too (a tree is
            # evicted leaves first, so holding a run means holding the runs above it), so when each
            # caches the run to its end here, all match the same; no need to walk them one by one.
            if holders.holding_at_least(origin, end) == len(caches):
                base = sum(e - f for _, f, e in segs[:j])
                return UniformMatches((base + end - first) * page, len(caches), eligible)
        if owners and eligible is not None:
            owners = {i for i in owners if eligible(i)}
        if not owners:
            continue
        out: dict[int, int] = {}
        for i in owners:
            matched, stop = _walk(caches[i], segs)
            if stop < j:
                break
            out[i] = matched * page
        else:
            return out
        everyone = {
            i: _walk(c, segs)[0] * page for i, c in enumerate(caches) if eligible is None or eligible(i)
        }
        return {i: m for i, m in everyone.items() if m}
    return {}

"""Prefix caching over a trace's compact prefix identity.

Every request names the earlier request whose input prefix it extends (``parent_id``) and how many
leading tokens they share. Cutting inputs into pages of ``page_tokens``, page ``j`` of request ``r``
is the *same* KV as page ``j`` of its parent when it lies wholly inside the shared prefix, and a new
page otherwise. So a request's pages form a short list of **segments** ``(origin, first_page,
end_page)``: runs of pages first computed by request ``origin``.

A worker's cache holds, per origin, how far that origin's run is cached. A lookup matches the
segments from the root, as a radix tree would, and stops at the first page that is missing. Eviction
is LRU over origins; a lookup touches ancestors after descendants, so the least recently used entries
are always leaves and a cached run never loses the pages under it (SGLang's radix cache evicts leaves
first for the same reason).

Two facts make a lookup cost a few dictionary reads however long the request's chain (an agent
session's hundredth turn has about a hundred segments):

* **Cached origins are closed under ancestors.** An origin's run appears in every request that
  contains it behind the same segments (its own chain's, cut at the same pages), an insert caches
  all of a request's segments, and eviction takes leaves only. So along a request's segments the
  cached ones are a prefix, found by bisection, and every one before the deepest is cached at least
  to its segment's end: the match is the pages before the deepest cached segment plus what is cached
  of that one (``PrefixCache._deepest``).
* **LRU order is a touch counter.** A touch moves a root path's origins to the most recent end,
  deepest first, so the LRU entry is always the leaf touched least recently. A touch stamps only its
  deepest origin; an ancestor's last touch is the latest of its own stamp and its evicted
  descendants', handed up when each is evicted; a heap of leaves by stamp gives the LRU entry.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from envs.request import Request
from policies.routing import UniformMatches

Segment = tuple[int, int, int]
"""(origin request id, first page, end page) — pages [first, end) were first computed by origin."""

Runs = tuple[tuple[Segment, ...], tuple[int, ...], tuple[int, ...]]
"""A request's segments, their origins, and the pages of the segments before each (a running sum)."""


class PrefixIndex:
    """Page segments of every request of one trace (built once, shared by all workers)."""

    def __init__(self, requests: Sequence[Request], page_tokens: int = 256, memo_size: int = 16384) -> None:
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        self.page_tokens = page_tokens
        self._parent = [r.parent_id for r in requests]
        self._shared_pages = [r.shared_prefix_tokens // page_tokens for r in requests]
        self._pages = [r.input_tokens // page_tokens for r in requests]
        self._memo: dict[int, Runs] = {}
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
        """The request's page runs, root first."""
        return self.runs(request_id)[0]

    def runs(self, request_id: int) -> Runs:
        """The request's page runs, root first, with their origins and the pages before each.

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
        runs: Runs = ((), (), ())
        for rid in reversed(chain):
            end = self._pages[rid]
            parent = self._parent[rid]
            shared = min(self._shared_pages[rid], end) if parent >= 0 else 0
            if shared > 0:
                base, base_origins, base_before = memo[parent] if parent in memo else runs
                i = len(base)
                while i and base[i - 1][1] >= shared:
                    i -= 1
                segs, origins, before = base[:i], base_origins[:i], base_before[:i]
                if i and segs[-1][2] > shared:
                    origin, first, _ = segs[-1]
                    segs = (*segs[:-1], (origin, first, shared))
                if end > shared:
                    pages_before = before[-1] + segs[-1][2] - segs[-1][1] if i else 0
                    segs += ((rid, shared, end),)
                    origins += (rid,)
                    before += (pages_before,)
                runs = (segs, origins, before)
            else:
                runs = (((rid, 0, end),), (rid,), (0,)) if end > 0 else ((), (), ())
            memo[rid] = runs
        while len(memo) > self._memo_size:  # FIFO bound on memory
            del memo[next(iter(memo))]
        return runs


class PoolHolders:
    """For the caches of one pool: which workers hold each origin's run, and how far (a count per
    cached end), so a router finds the workers that can match a request without asking every one."""

    __slots__ = ("ends", "owners")

    def __init__(self) -> None:
        self.owners: dict[int, set[int]] = {}
        self.ends: dict[int, dict[int, int]] = {}
        """origin -> {cached end page: how many workers cache the run that far}."""

    def add(self, origin: int, owner: int, end: int) -> None:
        owners = self.owners.get(origin)
        if owners is None:
            self.owners[origin] = {owner}
            self.ends[origin] = {end: 1}
            return
        owners.add(owner)
        ends = self.ends[origin]
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


_END, _FIRST, _UP, _KIDS, _STAMP = range(5)
"""Fields of a cached origin's node (a list, so one dictionary read reaches them all): the end page up
to which its run is cached; the first page of its run (the same in every request that holds it); the
origin of the run before it (its parent in the tree; -1 for a root); how many cached origins have it
as their parent (0: a leaf); its last touch as far as known (touches stamp their deepest origin only,
and an evicted origin hands its stamp up to its parent: see the module docstring)."""


class PrefixCache:
    """One worker's LRU prefix cache, counted in pages (the module docstring says how it is indexed).

    ``holders``/``owner``: the caches of one pool may share a ``PoolHolders`` (``owner`` is this
    cache's worker), see ``pool_caches`` and ``match_in_pool``.
    """

    __slots__ = ("_heap", "_holders", "_nodes", "_owner", "_touches", "capacity_pages", "index", "used_pages")

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
        self._nodes: dict[int, list[int]] = {}
        """origin -> its node (``_END``, ``_FIRST``, ``_UP``, ``_KIDS``, ``_STAMP``), for cached origins."""
        self._heap: list[tuple[int, int]] = []
        """``(stamp, origin)`` of leaves, the least recently touched first; entries whose origin has
        since been touched again, got a child or was evicted are stale and skipped."""
        self._touches = 0
        self._holders = holders
        self._owner = owner

    def cached_ends(self) -> dict[int, int]:
        """origin -> the end page up to which its run is cached, for every cached origin."""
        return {origin: node[_END] for origin, node in self._nodes.items()}

    def _deepest(self, origins: tuple[int, ...]) -> int:
        """Index of the deepest of a request's segments whose origin is cached here (-1: none). The
        cached ones are a prefix of the segments, so the last two are tried and then a bisection."""
        nodes = self._nodes
        n = len(origins)
        if not n or origins[0] not in nodes:
            return -1
        if origins[n - 1] in nodes:
            return n - 1
        if n < 3 or origins[n - 2] in nodes:
            return n - 2
        lo, hi = 0, n - 2  # origins[lo] cached, origins[hi] not
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if origins[mid] in nodes:
                lo = mid
            else:
                hi = mid
        return lo

    def _touch(self, origin: int, node: list[int]) -> None:
        """A lookup or insert touched the root path down to ``origin`` (most recent now)."""
        self._touches += 1
        stamp = node[_STAMP] = self._touches
        if not node[_KIDS]:
            heap = self._heap
            heapq.heappush(heap, (stamp, origin))
            if len(heap) > 2 * len(self._nodes) + 64:  # drop the stale entries
                self._heap = [(n[_STAMP], o) for o, n in self._nodes.items() if not n[_KIDS]]
                heapq.heapify(self._heap)

    def match_tokens(self, request_id: int, *, touch: bool = False) -> int:
        """Leading input tokens of the request already cached here."""
        segs, origins, before = self.index.runs(request_id)
        j = self._deepest(origins)
        if j < 0:
            return 0
        origin, first, end = segs[j]
        node = self._nodes[origin]
        if touch:
            self._touch(origin, node)
        cached_end = node[_END]
        return (before[j] + (cached_end if cached_end < end else end) - first) * self.index.page_tokens

    def insert(self, request_id: int) -> None:
        """Cache all of the request's input pages (after its prefill), evicting LRU runs as needed."""
        segs, origins, _ = self.index.runs(request_id)
        if not segs:  # nothing to cache (an earlier ``keep`` may have left the cache over capacity)
            if self.used_pages > self.capacity_pages:
                self.evict_to(self.capacity_pages)
            return
        j = self._deepest(origins)
        nodes, holders = self._nodes, self._holders
        if j >= 0:  # the segments before j are cached to their ends already (module docstring)
            origin, _, end = segs[j]
            node = nodes[origin]
            cached_end = node[_END]
            if end > cached_end:
                node[_END] = end
                self.used_pages += end - cached_end
                if holders is not None:
                    holders.extend(origin, cached_end, end)
        up = origins[j] if j >= 0 else -1
        for k in range(j + 1, len(segs)):
            origin, first, end = segs[k]
            # stamp 0: touched below through its deepest descendant (module docstring)
            node = nodes[origin] = [end, first, up, 0, 0]
            if up >= 0:
                nodes[up][_KIDS] += 1
            up = origin
            self.used_pages += end - first
            if holders is not None:
                holders.add(origin, self._owner, end)
        self._touch(origins[-1], nodes[origins[-1]])
        if self.used_pages > self.capacity_pages:
            self.evict_to(self.capacity_pages, keep=origins[0])

    def evict_to(self, capacity_pages: int, keep: int = -1) -> None:
        """Evict least recently used runs until at most ``capacity_pages`` are held.

        ``keep`` is an origin that survives as the last entry standing: ``insert`` passes the root
        run of the request it just cached, so a request larger than the cache keeps its prefix start.
        """
        self.capacity_pages = capacity_pages
        nodes, heap, holders = self._nodes, self._heap, self._holders
        nxt = -1  # a leaf known to be the LRU entry without asking the heap (it is not in it)
        while self.used_pages > capacity_pages and nodes:
            if nxt >= 0:
                origin = nxt
                stamp = nodes[origin][_STAMP]
            else:
                stamp, origin = heap[0]
                node = nodes.get(origin)
                if node is None or node[_KIDS] or node[_STAMP] != stamp:
                    heapq.heappop(heap)  # stale
                    continue
            if origin == keep and len(nodes) == 1:
                break
            if nxt >= 0:
                nxt = -1
            else:
                heapq.heappop(heap)
            end, first, up, _, _ = nodes.pop(origin)
            self.used_pages -= end - first
            if up >= 0:  # the parent was touched whenever this was: it inherits the later stamp
                parent = nodes[up]
                if parent[_STAMP] < stamp:
                    parent[_STAMP] = stamp
                parent[_KIDS] -= 1
                if not parent[_KIDS]:
                    # a leaf now; with the stamp just evicted (no other leaf has it) it is the LRU one
                    if parent[_STAMP] == stamp:
                        nxt = up
                    else:
                        heapq.heappush(heap, (parent[_STAMP], up))
            if holders is not None:
                holders.remove(origin, self._owner, end)
        if nxt >= 0:
            heapq.heappush(heap, (nodes[nxt][_STAMP], nxt))


def pool_caches(index: PrefixIndex, n_workers: int, capacity_pages: int) -> list[PrefixCache]:
    """One cache per worker of a pool, sharing a holders map (see ``PrefixCache``)."""
    holders = PoolHolders()
    return [PrefixCache(index, capacity_pages, holders=holders, owner=i) for i in range(n_workers)]


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

    Only the eligible holders of the deepest run any of them holds are answered: a worker without that
    run matches at most up to where it starts, less than any holder. A holder's match is the pages
    before that run plus what it caches of it: cached runs are closed under ancestors, and it holds
    no deeper run of the request. When every worker holds that run to its end and ``all_eligible``
    says no worker is left out, the answer is a ``policies.routing.UniformMatches`` (constant time in
    the pool size).
    """
    if not caches:
        return {}
    holders = caches[0]._holders
    if holders is None:
        raise ValueError("match_in_pool needs caches made by pool_caches")
    runs = caches[0].index.runs(request_id)
    segs = runs[0]
    page = caches[0].index.page_tokens
    for j in range(len(segs) - 1, -1, -1):
        origin, first, end = segs[j]
        owners = holders.owners.get(origin)
        if owners and len(owners) == len(caches) and (eligible is None or all_eligible):
            # Every worker holds the deepest run anyone holds. Its ancestors' runs too (a tree is
            # evicted leaves first, so holding a run means holding the runs above it), so when each
            # caches the run to its end here, all match the same; no need to walk them one by one.
            if holders.holding_at_least(origin, end) == len(caches):
                return UniformMatches((runs[2][j] + end - first) * page, len(caches), eligible)
        if owners and eligible is not None and not all_eligible:
            owners = {i for i in owners if eligible(i)}
        if not owners:
            continue
        pages_before = runs[2][j] - first
        out: dict[int, int] = {}
        for i in owners:
            cached_end = caches[i]._nodes[origin][_END]
            out[i] = (pages_before + (cached_end if cached_end < end else end)) * page
        return out
    return {}

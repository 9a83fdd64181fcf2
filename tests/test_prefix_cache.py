"""The indexed prefix cache (bisection over a request's runs, LRU by touch stamps) answers, caches and
evicts exactly as a plain LRU walk over the runs does: random forests of requests, random inserts,
lookups, evictions and capacity changes, against a small reference implementation."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from envs.prefix_cache import PrefixCache, PrefixIndex, match_in_pool, pool_caches
from envs.request import Request
from tests.fakes import assert_pool_matches_agree


class WalkingCache:
    """The reference: per origin how far its run is cached, in LRU order; a lookup walks the runs from
    the root and touches the hit ones deepest first (so ancestors are more recent); eviction pops the
    least recently used origin."""

    def __init__(self, index: PrefixIndex, capacity_pages: int) -> None:
        self.index = index
        self.capacity_pages = capacity_pages
        self.used_pages = 0
        self.end: OrderedDict[int, int] = OrderedDict()
        self.first: dict[int, int] = {}

    def match_tokens(self, rid: int, *, touch: bool = False) -> int:
        matched, hit = 0, []
        for origin, first, end in self.index.segments(rid):
            cached = self.end.get(origin)
            if cached is None or self.first[origin] > first:
                break
            upto = min(cached, end)
            matched += upto - first
            hit.append(origin)
            if upto < end:
                break
        if touch:
            for origin in reversed(hit):
                self.end.move_to_end(origin)
        return matched * self.index.page_tokens

    def insert(self, rid: int) -> None:
        segs = self.index.segments(rid)
        for origin, first, end in segs:
            cached = self.end.get(origin)
            if cached is None:
                self.end[origin], self.first[origin] = end, first
                self.used_pages += end - first
            elif end > cached:
                self.end[origin] = end
                self.used_pages += end - cached
        for origin, _, _ in reversed(segs):
            self.end.move_to_end(origin)
        if self.used_pages > self.capacity_pages:
            self.evict_to(self.capacity_pages, keep=segs[0][0] if segs else -1)

    def evict_to(self, capacity_pages: int, keep: int = -1) -> None:
        self.capacity_pages = capacity_pages
        while self.used_pages > capacity_pages and self.end:
            origin, end = next(iter(self.end.items()))
            if origin == keep and len(self.end) == 1:
                break
            del self.end[origin]
            self.used_pages -= end - self.first.pop(origin)


def _forest(rng: np.random.Generator, n: int, page: int) -> list[Request]:
    """Sessions (a request extending the one before), branches off random earlier requests, roots, and
    shared prefixes that end anywhere, past the parent's input included."""
    reqs: list[Request] = []
    for i in range(n):
        kind = rng.random()
        if i == 0 or kind < 0.1:
            reqs.append(Request(i, 0, i, 0.0, int(rng.integers(1, 40 * page)), 1))
            continue
        parent = i - 1 if kind < 0.6 else int(rng.integers(0, i))
        n_in = reqs[parent].input_tokens
        if rng.random() < 0.5:
            shared = int(rng.integers(0, n_in + 3 * page))
        else:
            shared = n_in - int(rng.integers(0, min(n_in, 2 * page) + 1))
        reqs.append(Request(i, 0, i, 0.0, shared + int(rng.integers(0, 10 * page)), 1, parent, shared))
    return reqs


@pytest.mark.parametrize("seed", range(40))
def test_indexed_cache_matches_a_walking_lru(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 4, 16]))
    n = int(rng.integers(5, 200))
    reqs = _forest(rng, n, page)
    index = PrefixIndex(reqs, page, memo_size=int(rng.choice([2, 8, 16384])))
    n_workers, cap = int(rng.integers(1, 5)), int(rng.integers(1, 200))
    caches = pool_caches(index, n_workers, cap)
    refs = [WalkingCache(index, cap) for _ in range(n_workers)]
    for _ in range(400):
        op, rid, w = rng.random(), int(rng.integers(0, n)), int(rng.integers(0, n_workers))
        if op < 0.4:
            caches[w].insert(rid)
            refs[w].insert(rid)
        elif op < 0.7:
            touch = bool(rng.random() < 0.5)
            assert caches[w].match_tokens(rid, touch=touch) == refs[w].match_tokens(rid, touch=touch)
        elif op < 0.8:
            to = int(rng.integers(0, cap + 1))
            caches[w].evict_to(to)
            refs[w].evict_to(to)
        elif op < 0.85:  # a capacity change without eviction (the next insert evicts)
            caches[w].capacity_pages = refs[w].capacity_pages = int(rng.integers(0, 3 * cap + 1))
        else:
            walked = {i: r.match_tokens(rid) for i, r in enumerate(refs)}
            assert_pool_matches_agree(match_in_pool(caches, rid), walked)
        for cache, ref in zip(caches, refs, strict=True):
            assert cache.used_pages == ref.used_pages
            assert {o: cache.match_tokens(o) for o in ref.end} == {o: ref.match_tokens(o) for o in ref.end}
            assert cache.cached_ends() == dict(ref.end)


def test_a_plain_cache_without_holders_matches_too() -> None:
    rng = np.random.default_rng(123)
    reqs = _forest(rng, 150, 4)
    index = PrefixIndex(reqs, 4)
    cache, ref = PrefixCache(index, 60), WalkingCache(index, 60)
    for rid in rng.integers(0, 150, 600):
        assert cache.match_tokens(int(rid), touch=True) == ref.match_tokens(int(rid), touch=True)
        cache.insert(int(rid))
        ref.insert(int(rid))
        assert cache.cached_ends() == dict(ref.end) and cache.used_pages == ref.used_pages

"""Gateway routing rules (policies/routing.py) on hand-built pools; their defaults against smg's source."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from policies.routing import (
    ROUTING_POLICIES,
    CacheAware,
    CacheAwareConfig,
    OverloadProtection,
    PowerOfTwo,
    RoundRobin,
    SglangRouterCacheAware,
    WorkerPool,
    make_routing_policy,
)


def _pool(loads: list[int], processed: list[int] | None = None) -> WorkerPool:
    """A pool whose workers had ``loads`` requests in flight after ``processed`` dispatches each."""
    pool = WorkerPool(len(loads))
    done = processed if processed is not None else loads
    for i, (n_load, n_done) in enumerate(zip(loads, done, strict=True)):
        for _ in range(n_done):
            pool.dispatched(i)
        for _ in range(n_done - n_load):
            pool.finished(i)
    return pool


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _router_args_defaults() -> dict[str, object]:
    spec = importlib.util.find_spec("smg")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("smg is not installed (pip install 'crossflow[serving]')")
    source = Path(spec.submodule_search_locations[0], "router_args.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RouterArgs")
    values: dict[str, object] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            try:  # constants and constant arithmetic such as 2**26; skip factories and names
                values[node.target.id] = eval(  # a literal expression from the file, no names in scope
                    compile(ast.Expression(node.value), "<router_args>", "eval"), {"__builtins__": {}}
                )
            except (NameError, TypeError):
                continue
    return values


def test_defaults_are_smg_1_13_command_line_defaults() -> None:
    """The parameters are read from the installed smg wheel's ``router_args.py`` (not restated)."""
    smg = _router_args_defaults()
    cfg, over = CacheAwareConfig(), OverloadProtection()
    assert smg["policy"] == "cache_aware" and smg["prefill_policy"] is None and smg["decode_policy"] is None
    assert cfg.cache_threshold == smg["cache_threshold"] == 0.3
    assert cfg.balance_abs_threshold == smg["balance_abs_threshold"] == 64
    assert cfg.balance_rel_threshold == smg["balance_rel_threshold"] == 1.5
    assert cfg.eviction_interval_s == smg["eviction_interval_secs"]
    assert cfg.max_tree_size == smg["max_tree_size"]
    assert smg["worker_overload_protection"] is True
    assert over.waiting_requests == smg["worker_overload_waiting_requests"] == 8
    assert over.token_usage == smg["worker_overload_token_usage"] == 0.8
    assert over.load_monitor_interval_s == smg["load_monitor_interval"]


def test_cache_hit_goes_to_the_least_loaded_tenant_holding_the_longest_match() -> None:
    rule = CacheAware()
    matches = {0: 800, 1: 800, 2: 100, 3: 0}
    # workers 0 and 1 hold the 800-token match (80 % of 1000 > 0.3); 1 is less loaded
    assert rule.choose(_pool([5, 3, 0, 0]), 1000, matches, _rng()) == 1
    # ties among tenants are broken at random, reproducibly per seed
    tie = _pool([2, 2, 0, 0])
    picks = {rule.choose(tie, 1000, matches, np.random.default_rng(s)) for s in range(20)}
    assert picks == {0, 1}


def test_cache_miss_goes_to_the_least_loaded_worker_with_smg_tie_break() -> None:
    rule = CacheAware()
    weak = {0: 300}  # 300 / 1000 = 0.3 is not above the threshold
    assert rule.choose(_pool([0, 2, 1]), 1000, weak, _rng()) == 0
    # equal in-flight counts: fewer requests ever dispatched wins, then the lower index
    assert rule.choose(_pool([1, 1, 1], processed=[9, 4, 4]), 1000, weak, _rng()) == 1


def test_spill_gate_needs_both_the_relative_and_the_absolute_margin() -> None:
    cfg = CacheAwareConfig()
    # margin at mean 5: 64 capped at the natural swing 2 sqrt(5) = 4.47 (never under 4)
    assert cfg.spill_margin(5.0) == pytest.approx(2 * np.sqrt(5.0))
    assert cfg.spill_margin(1.0) == 4.0
    assert cfg.spill_margin(10_000.0) == 64.0
    assert CacheAwareConfig(balance_abs_threshold=2).spill_margin(100.0) == 2.0
    rule = CacheAware(cfg)
    hit = {0: 900}
    # 20 > 1.5 x 5 and 20 > 5 + 4.47: spill to the least loaded
    assert rule.choose(_pool([20, 0, 0, 0]), 1000, hit, _rng()) == 1
    # 8 > 1.5 x 5 but 8 < 5 + 4.47: stay with the cache
    assert rule.choose(_pool([8, 4, 4, 4]), 1000, hit, _rng()) == 0


def test_overload_protection_leaves_out_overloaded_workers_unless_all_are() -> None:
    over = OverloadProtection()
    assert over.is_overloaded(8, 0.1) and over.is_overloaded(0, 0.8) and not over.is_overloaded(7, 0.79)
    pool = _pool([0, 5, 6])
    pool.set_overloaded([True, False, False])
    hit0 = {0: 900}
    assert CacheAware().choose(pool, 1000, hit0, _rng()) == 1  # the cache holder is vetoed
    pool.set_overloaded([True, True, True])
    assert CacheAware().choose(pool, 1000, hit0, _rng()) == 0  # all over: every worker is a candidate
    assert pool.candidates() == [0, 1, 2]


def test_sglang_router_0_3_2_rule_balances_globally_then_smallest_tree() -> None:
    rule = SglangRouterCacheAware()
    sizes = {0: 5000, 1: 100, 2: 700}.__getitem__
    miss: dict[int, int] = {}
    assert rule.choose(_pool([0, 3, 0]), 1000, miss, _rng(), sizes) == 1  # smallest tree, not least loaded
    hit = {2: 600}
    assert rule.choose(_pool([0, 3, 0]), 1000, hit, _rng(), sizes) == 2
    # imbalanced (100 - 0 > 64 and 100 > 1.5 x 0): least loaded whatever the cache says
    assert rule.choose(_pool([100, 3, 0]), 1000, {0: 900}, _rng(), sizes) == 2


def test_round_robin_and_power_of_two() -> None:
    rr = RoundRobin()
    pool = _pool([0, 0, 0])
    assert [rr.choose(pool, 10, {}, _rng()) for _ in range(4)] == [0, 1, 2, 0]
    p2 = PowerOfTwo()
    pool = _pool([9, 0, 9, 9])
    rng = np.random.default_rng(3)
    picks = [p2.choose(pool, 10, {}, rng) for _ in range(200)]
    assert 0 in set(picks) and picks.count(1) > 80  # worker 1 wins every draw that includes it
    again = np.random.default_rng(3)
    assert picks == [p2.choose(pool, 10, {}, again) for _ in range(200)]


def test_registry_and_pool_counters() -> None:
    for name in ROUTING_POLICIES:
        assert make_routing_policy(name).name == name
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_routing_policy("fastest")
    pool = WorkerPool(2)
    pool.dispatched(1)
    pool.dispatched(1)
    pool.finished(1)
    assert pool.load == [0, 1] and pool.processed == [0, 2]
    with pytest.raises(ValueError, match="no request in flight"):
        pool.finished(0)


@pytest.mark.parametrize("n", [9, 40])
def test_indexed_pool_agrees_with_a_scan_under_random_traffic(n: int) -> None:
    """The least-loaded pick and its ties equal a plain scan, with overload flags changing too: in a
    pool of 40 from the heap and the per-load lists, in one of 9 (a scanned pool) by its own scan."""
    from policies.routing import SCANNED_POOL_WORKERS

    assert (n > SCANNED_POOL_WORKERS) == (n == 40)
    rng = np.random.default_rng(11)
    pool = WorkerPool(n)
    for step in range(3000):
        i = int(rng.integers(n))
        if pool.load[i] and rng.random() < 0.45:
            pool.finished(i)
        else:
            pool.dispatched(i)
        if step % 97 == 0:
            pool.set_overloaded([bool(x) for x in rng.random(n) < 0.3])
        cands = [j for j in range(n) if not pool.overloaded[j]] or list(range(n))
        scan = min(cands, key=lambda j: (pool.load[j], pool.processed[j], j))
        assert pool.least_loaded() == scan
        assert pool.least_loaded_ties() == [j for j in cands if pool.load[j] == pool.load[scan]]
        assert pool.mean_candidate_load() == pytest.approx(sum(pool.load[j] for j in cands) / len(cands))


def test_uniform_matches_choose_what_the_explicit_matches_choose() -> None:
    """The constant-time answer for a prefix every worker holds picks exactly what listing them does."""
    from policies.routing import UniformMatches

    rng_loads = np.random.default_rng(5)
    for trial in range(200):
        pool = _pool([int(x) for x in rng_loads.integers(0, 4, 7)])
        tokens = int(rng_loads.choice([100, 400, 900]))
        seed = trial
        explicit = CacheAware().choose(
            pool, 1000, dict.fromkeys(range(7), tokens), np.random.default_rng(seed)
        )
        uniform = CacheAware().choose(pool, 1000, UniformMatches(tokens, 7), np.random.default_rng(seed))
        assert uniform == explicit, (pool.load, tokens)
    m = UniformMatches(300, 4, lambda i: i != 2)
    assert 1 in m and 2 not in m and m[3] == 300 and sorted(m) == [0, 1, 3] and len(m) == 3
    with pytest.raises(KeyError):
        m[2]


def test_pool_matches_agree_with_walking_every_worker() -> None:
    """match_in_pool (holders of the deepest run, or a uniform answer) equals each cache's own match."""
    from envs.prefix_cache import PrefixIndex, match_in_pool, pool_caches
    from envs.request import Request
    from tests.fakes import assert_pool_matches_agree

    rng = np.random.default_rng(9)
    reqs = [Request(0, 0, 0, 0.0, 2048, 1)]  # a common root every worker will hold
    for i in range(1, 400):
        parent = int(rng.integers(0, i))
        shared = int(rng.integers(0, reqs[parent].input_tokens + 1))
        reqs.append(Request(i, 0, i, 0.0, shared + int(rng.integers(1, 3000)), 1, parent, shared))
    index = PrefixIndex(reqs, page_tokens=64)
    caches = pool_caches(index, 6, capacity_pages=600)
    for c in caches:
        c.insert(0)
    for rid in range(1, 400):
        walked = {w: c.match_tokens(rid) for w, c in enumerate(caches)}
        assert_pool_matches_agree(match_in_pool(caches, rid), walked)
        caches[int(rng.integers(0, 6))].insert(rid)


def test_same_instant_race_hides_dispatches_until_a_later_instant() -> None:
    """smg's race: choices made at one instant see the counts from before it; a later instant sees all."""
    pool = WorkerPool(2, same_instant_race=True)
    rule = make_routing_policy("least_load")
    picks = []
    for _ in range(3):
        pool.at(0.0)
        w = rule.choose(pool, 100, {}, _rng())
        pool.dispatched(w, 0.0)
        picks.append(w)
    assert picks == [0, 0, 0]
    pool.at(0.5)
    assert pool.load == [3, 0] and pool.processed == [3, 0]
    assert rule.choose(pool, 100, {}, _rng()) == 1
    with pytest.raises(ValueError, match="now_s"):
        pool.dispatched(1)


def test_without_the_race_every_dispatch_counts_at_once() -> None:
    pool = WorkerPool(2)
    rule = make_routing_policy("least_load")
    picks = []
    for _ in range(4):
        w = rule.choose(pool, 100, {}, _rng())
        pool.dispatched(w, 0.0)
        picks.append(w)
    assert picks == [0, 1, 0, 1]


def test_a_finish_applies_deferred_dispatches_first() -> None:
    pool = WorkerPool(2, same_instant_race=True)
    pool.dispatched(1, 0.0)
    pool.finished(1)  # e.g. a fallback in the same instant: the count is applied, then released
    assert pool.load == [0, 0] and pool.processed == [0, 1]

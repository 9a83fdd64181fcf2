"""The PD cluster simulator: conservation, determinism, exact timing by hand, caching, retraction."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from envs.cluster_config import ClusterConfig, parse_shape
from envs.metrics import weighted_quantile
from envs.prefix_cache import PrefixCache, PrefixIndex
from envs.request import Request
from envs.simulator import Simulator, simulate
from policies.node_state import NodeState
from policies.scheduler import ClusterScheduler
from tests.fakes import ConstantPredictor, LinearCostModel, open_trace, session_trace


def _cfg(**kw: object) -> ClusterConfig:
    base: dict[str, object] = {"n_prefill": 1, "n_decode": 1, "page_tokens": 16, "prefill_chunk_tokens": 4096}
    base.update(kw)
    return ClusterConfig(**base)  # type: ignore[arg-type]


def test_parse_shape() -> None:
    assert parse_shape("2P4D") == (2, 4)
    assert parse_shape("4p2d") == (4, 2)
    assert ClusterConfig.from_shape("1P5D").n_decode == 5
    with pytest.raises(ValueError, match="2P4D"):
        parse_shape("2x4")


def test_single_request_timing_by_hand() -> None:
    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, per_decode_request_s=0.0)
    trace = open_trace([(1.0, 1000, 5)])
    res = simulate(trace, _cfg(kv_transfer_latency_s=0.005), cost_model=cm)  # type: ignore[arg-type]
    row = res.requests.iloc[0]
    prefill_s = 0.01 + 1000 * 1e-5
    assert row["first_token_s"] == pytest.approx(1.0 + prefill_s + 0.005)
    # tokens 2..5 come from four decode iterations of 0.01 s each
    assert row["finish_s"] == pytest.approx(row["first_token_s"] + 4 * 0.01)
    assert res.metrics.itl_mean_s == pytest.approx(0.01)
    assert res.metrics.ttft_mean_s == pytest.approx(prefill_s + 0.005)


def test_chunked_prefill_splits_long_prompt() -> None:
    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5)
    cfg = _cfg(prefill_chunk_tokens=4096, kv_transfer_latency_s=0.0)
    res = simulate(open_trace([(0.0, 10_000, 1)]), cfg, cost_model=cm)  # type: ignore[arg-type]
    # three chunks: 4096 + 4096 + 1808 -> three iteration overheads
    assert res.requests.iloc[0]["first_token_s"] == pytest.approx(3 * 0.01 + 10_000 * 1e-5)


def test_conservation_and_token_counts_closed_loop() -> None:
    trace = session_trace(n_sessions=6, turns=5)
    sim = Simulator(
        trace, ClusterConfig(n_prefill=2, n_decode=3, page_tokens=256), session_rate_per_s=2.0, seed=3
    )
    res = sim.run()
    assert res.metrics.n_finished == len(trace)
    assert all(r.generated == r.output for r in sim.reqs)
    df = res.requests
    assert df["request_id"].is_unique and len(df) == len(trace)
    assert (df["first_token_s"] >= df["arrival_s"]).all() and (df["finish_s"] >= df["first_token_s"]).all()
    # closed loop: a turn arrives at least its think time after the previous turn finished
    by_id = df.set_index("request_id")
    for r in trace.requests:
        if r.depends_on >= 0:
            assert (
                by_id.loc[r.request_id, "arrival_s"]
                >= by_id.loc[r.depends_on, "finish_s"] + r.think_time_s - 1e-9
            )


def test_same_seed_same_result_and_seed_matters() -> None:
    trace = session_trace(n_sessions=8, turns=4)
    cfg = ClusterConfig(n_prefill=1, n_decode=2, page_tokens=256)
    a = simulate(trace, cfg, session_rate_per_s=1.0, seed=11).metrics
    b = simulate(trace, cfg, session_rate_per_s=1.0, seed=11).metrics
    c = simulate(trace, cfg, session_rate_per_s=1.0, seed=12).metrics
    assert a == b
    assert a != c


def test_decode_jumps_are_exact() -> None:
    """Simulating identical iterations as one jump gives bit-identical results to one by one."""
    rng = np.random.default_rng(0)
    rows = [
        (float(t), int(n), int(o))
        for t, n, o in zip(
            np.sort(rng.uniform(0, 5, 40)), rng.integers(100, 3000, 40), rng.integers(1, 300, 40), strict=True
        )
    ]
    cm = LinearCostModel(per_context_token_s=1e-7, per_decode_request_s=2e-4)
    cfg = _cfg(n_decode=2)
    jumped = simulate(open_trace(rows), cfg, cost_model=cm)  # type: ignore[arg-type]
    single = simulate(open_trace(rows), cfg.with_(max_decode_jump_iters=1), cost_model=cm)  # type: ignore[arg-type]
    for col in ("first_token_s", "finish_s", "decode_worker", "retractions"):
        np.testing.assert_array_equal(jumped.requests[col], single.requests[col])
    assert jumped.metrics == single.metrics


def test_prefix_cache_hit_reduces_computed_tokens() -> None:
    reqs = [
        Request(0, 0, 0, 0.0, 1000, 2),
        Request(1, 0, 1, 5.0, 1500, 2, parent_id=0, shared_prefix_tokens=1000),
    ]
    from envs.request import Trace

    res = simulate(Trace("t", reqs), _cfg(page_tokens=16), cost_model=LinearCostModel())  # type: ignore[arg-type]
    assert res.requests["cached_tokens"].tolist() == [0, 992]  # 62 whole pages of 16 tokens


def test_prefix_cache_lru_evicts_leaves_first() -> None:
    reqs = [
        Request(0, 0, 0, 0.0, 64, 1),
        Request(1, 0, 1, 0.0, 96, 1, parent_id=0, shared_prefix_tokens=64),
        Request(2, 1, 0, 0.0, 64, 1),
    ]
    idx = PrefixIndex(reqs, page_tokens=16)
    assert idx.segments(1) == ((0, 0, 4), (1, 4, 6))
    cache = PrefixCache(idx, capacity_pages=8)
    cache.insert(1)  # caches request 0's 4 pages and request 1's 2 pages
    assert cache.match_tokens(0) == 64 and cache.match_tokens(1) == 96
    cache.insert(2)  # 4 more pages: over capacity by 2 -> the leaf run of request 1 goes first
    assert cache.used_pages == 8
    assert cache.match_tokens(1) == 64
    assert cache.match_tokens(0) == 64


def test_retraction_when_kv_runs_out_still_finishes_everything() -> None:
    cm = LinearCostModel(kv_capacity_tokens=6000)
    rows = [(0.0, 1000, 400) for _ in range(6)]
    # no decode-token reservation: all six pre-allocate, and their growth outruns the KV
    sim = Simulator(open_trace(rows), _cfg(num_reserved_decode_tokens=0), cost_model=cm)  # type: ignore[arg-type]
    res = sim.run()
    assert res.metrics.retractions > 0
    assert res.metrics.n_finished == 6
    assert all(r.generated == r.output for r in sim.reqs)


def test_weighted_quantile_by_hand() -> None:
    values, weights = np.array([1.0, 1.5, 2.0, 10.0]), np.array([2, 2, 2, 1])
    assert weighted_quantile(values, weights, 0.5) == 1.5
    assert weighted_quantile(values, weights, 0.99) == 10.0
    assert math.isnan(weighted_quantile(np.zeros(0), np.zeros(0), 0.5))


def test_offered_ratio_timeline() -> None:
    trace = open_trace([(0.0, 1000, 10), (30.0, 500, 10), (61.0, 200, 100)])
    res = simulate(trace, _cfg(), cost_model=LinearCostModel())  # type: ignore[arg-type]
    tl = res.timeline.set_index("minute")
    assert tl.loc[0, "uncached_input_tokens"] == 1500 and tl.loc[0, "output_tokens"] == 20
    assert tl.loc[1, "uncached_to_output"] == pytest.approx(2.0)


def test_prefix_segments_match_a_naive_walk_on_a_random_forest() -> None:
    rng = np.random.default_rng(5)
    reqs: list[Request] = []
    for i in range(400):
        n_in = int(rng.integers(1, 5000))
        parent = int(rng.integers(-1, i)) if i else -1
        shared = int(rng.integers(0, min(n_in, reqs[parent].input_tokens) + 1)) if parent >= 0 else 0
        reqs.append(Request(i, 0, i, 0.0, n_in, 1, parent_id=parent, shared_prefix_tokens=shared))
    idx = PrefixIndex(reqs, page_tokens=64, memo_size=8)

    def naive(rid: int) -> tuple[tuple[int, int, int], ...]:
        segs, origin, end = [], rid, reqs[rid].input_tokens // 64
        while True:
            r = reqs[origin]
            first = min(r.shared_prefix_tokens // 64, end) if r.parent_id >= 0 else 0
            if end > first:
                segs.append((origin, first, end))
            if first == 0:
                return tuple(reversed(segs))
            origin, end = r.parent_id, first

    for rid in list(range(400)) + [int(x) for x in rng.integers(0, 400, 400)]:
        assert idx.segments(rid) == naive(rid)


@pytest.mark.parametrize("name", ["agent", "mooncake", "mooncake-synthetic", "azure-code"])
def test_every_bundled_trace_replays(name: str) -> None:
    from train.experiment import Point, run_point

    res = run_point(Point(trace=name, max_requests=40 if name == "agent" else 300, session_rate_per_s=0.01))
    m = res.metrics
    assert m.n_finished == m.n_requests > 0
    assert m.input_tokens_per_s > 0 and m.output_tokens_per_s > 0
    assert 0 < m.ttft_p50_s <= m.ttft_p99_s and 0 < m.itl_p50_s <= m.itl_p99_s


def test_session_rate_curve_shapes_session_starts() -> None:
    """A curve with all its rate in the second hour starts every session in the second hour."""
    trace = session_trace(n_sessions=20, turns=1)
    curve = (np.array([0.0, 3600.0, 7200.0]), np.array([0.0, 1.0, 0.0]))
    res = simulate(
        trace,
        _cfg(n_decode=2),
        cost_model=LinearCostModel(),
        session_rate_per_s=0.005,  # type: ignore[arg-type]
        session_rate_curve=curve,
        seed=1,
    )
    starts = res.requests["arrival_s"] - 1.0  # think time of a first turn is 1 s
    assert (starts >= 3600.0).all() and (starts < 7200.0).all()


def test_prefill_queue_load_stays_exact() -> None:
    """A prefill worker's queued-token count equals what its queue really has left, at every step."""
    trace = session_trace(n_sessions=12, turns=6, first_input=6000, grow=3000)
    cfg = ClusterConfig(n_prefill=2, n_decode=2, page_tokens=256, prefill_cache_fraction=0.002)
    sim = Simulator(trace, cfg, session_rate_per_s=0.5, seed=2)
    t = 0.0
    while sim.step_until(t):
        for pw in sim.prefill:
            left = sum((r.input - r.done) if r.started else r.queued_estimate for r in pw.queue)
            assert pw.queued_tokens == left >= 0
        t += 0.37
    assert sim.done


def test_request_larger_than_kv_is_rejected_with_a_reason_and_its_session_goes_on() -> None:
    trace = session_trace(n_sessions=1, turns=3, first_input=1000, grow=5000, output=10)
    cm = LinearCostModel(kv_capacity_tokens=8000)  # turn 1 needs 6000+17, turn 2 11000+24 tokens
    res = simulate(trace, _cfg(), cost_model=cm, session_rate_per_s=1.0)  # type: ignore[arg-type]
    df = res.requests.set_index("request_id")
    # turn 2: 11000 + 24 tokens plus the 512 reserved for its output cannot ever fit 8000
    assert df.loc[2, "error"].startswith(
        "input + output + reserved decode tokens = 11536 exceed a worker's KV capacity (8000"
    )
    assert df.loc[[0, 1], "error"].eq("").all() and df.loc[[0, 1], "finish_s"].notna().all()
    assert res.metrics.n_rejected == 1 and res.metrics.n_finished == 2
    assert res.metrics.slo_attainment == res.metrics.n_slo_met / 2  # the rejected one is not counted


def test_conservation_with_borrowing_and_revocations() -> None:
    """With a lease scheduler, borrowed and fallen-back requests still finish exactly once."""
    from envs.cost_model import CostModel
    from envs.estimator import ClusterEstimator
    from policies.ledger import LeaseLedger
    from policies.node_policies import HeuristicPolicy
    from policies.scheduler import ClusterScheduler

    # two decode slots per node: decode requests queue up, so leases are revoked under decode pressure
    trace = session_trace(n_sessions=16, turns=5, first_input=8000, grow=4000, output=200, think_s=0.5)
    cfg = ClusterConfig(
        n_prefill=1, n_decode=3, page_tokens=256, control_interval_s=0.5, max_running_requests=2
    )
    cm = CostModel(cfg.gpu, cfg.model, cfg.tp)
    policy = HeuristicPolicy(ConstantPredictor(40_000.0), ttl_s=2.0, max_tasks=2, batch_high_fraction=1.0)
    scheduler = ClusterScheduler(
        policy, LeaseLedger(), ClusterEstimator(cfg, cm), control_interval_s=0.5, congestion_wait_s=0.05
    )
    sim = Simulator(trace, cfg, scheduler=scheduler, cost_model=cm, session_rate_per_s=8.0, seed=5)
    res = sim.run()
    assert res.metrics.n_finished == len(trace)
    assert all(r.generated == r.output for r in sim.reqs)
    paths = res.requests["path"].value_counts()
    assert paths.get("borrowed", 0) > 0 and paths.get("fallback", 0) > 0  # both paths exercised
    assert sim.counters.fallbacks == paths["fallback"]
    assert sim.counters.borrowed_prefill_tokens > 0
    assert not scheduler.ledger.active_ids()  # every reservation was released


def _small_agent_heuristic() -> Simulator:
    """A simulator of the first 6 agent requests under the heuristic on the default cluster."""
    from train.experiment import Point, build_scheduler, prepare_trace, session_rate

    point = Point(policy="heuristic", trace="agent", max_requests=6, session_rate_per_s=0.02)
    trace = prepare_trace(point)
    config, cost_model = point.cluster(), point.cost_model()
    return Simulator(
        trace,
        config,
        scheduler=build_scheduler(point.policy, config, cost_model),
        cost_model=cost_model,
        session_rate_per_s=session_rate(point, trace),
    )


def _assert_same_run(x: Simulator, y: Simulator) -> None:
    """Two finished runs are identical: requests, metrics, node timeline, granted tokens, counters
    and the scheduler's records."""
    a, b = x.result(), y.result()
    pd.testing.assert_frame_equal(a.requests, b.requests)
    assert a.metrics == b.metrics
    assert x.node_timeline == y.node_timeline
    assert x.granted_prefill_tokens() == y.granted_prefill_tokens()
    assert x.counters == y.counters
    assert list(x.scheduler.records) == list(y.scheduler.records)  # type: ignore[union-attr]


def test_replayed_control_intervals_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control intervals that see every decode node idle and unchanged since the last one (including
    intervals that only prefill iterations separate) are replayed by the scheduler, and the run is
    identical to one where every interval runs in full: requests, metrics, node timeline, granted
    tokens, counters and the scheduler's records."""
    busy_prefill_at_replay = []
    replay = ClusterScheduler.replay_control_interval

    def watched(self: ClusterScheduler, now_s: float) -> bool:
        busy_prefill_at_replay.append(any(pw.busy for pw in sims[0].prefill))
        return replay(self, now_s)

    monkeypatch.setattr(ClusterScheduler, "replay_control_interval", watched)
    sims = []
    for replays in (True, False):
        sim = _small_agent_heuristic()
        if not replays:
            sim._replay_interval = None
        sims.append(sim)
        sim.run()
    replayed, full = sims
    assert replayed.ticks == full.ticks and full.ticks_replayed == 0
    assert 0 < replayed.ticks_replayed < replayed.ticks
    assert any(busy_prefill_at_replay)  # prefill iterations between intervals do not prevent a replay
    _assert_same_run(replayed, full)


def test_unchanged_idle_nodes_keep_their_state_object_exactly() -> None:
    """At a full control interval an idle node whose state is unchanged since an earlier one is handed
    that interval's ``NodeState`` object again (its clock stale); the run is identical to one where
    every state is built anew: requests, metrics, node timeline, granted tokens, counters, records."""
    sims = []
    for reuse in (True, False):
        sim = _small_agent_heuristic()
        sim._replay_interval = None  # every interval in full
        if not reuse:
            sim._accepts_unchanged = None
        sims.append(sim)
    reused, built = sims
    stale = []
    handed = reused.scheduler.on_control_interval  # type: ignore[union-attr]

    def watched(now_s: float, states: list[NodeState]) -> list[int]:
        stale.extend(s for s in states if s.time_s < now_s)
        return handed(now_s, states)

    reused.scheduler.on_control_interval = watched  # type: ignore[union-attr,method-assign]
    reused.run()
    built.run()
    assert stale
    _assert_same_run(reused, built)


def test_jumps_accounted_in_pieces_from_their_running_sums_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A jump applied in pieces (control intervals read the node mid-jump) is accounted from its
    nanosecond counts and running sums made once; the run equals one that rounds and sums every
    piece anew (busy time, ITL histogram, SLO misses, counters, requests)."""
    pieces = []
    account_jump = Simulator._account_jump

    def counted(self: Simulator, *args: int) -> bool:
        done = account_jump(self, *args)  # type: ignore[arg-type]
        pieces.append(done)
        return done

    def run(fast: bool) -> Simulator:
        monkeypatch.setattr(Simulator, "_account_jump", counted if fast else lambda *a: False)
        sim = _small_agent_heuristic()
        sim.run()
        return sim

    fast, slow = run(True), run(False)
    assert any(pieces)
    a, b = fast.result(), slow.result()
    pd.testing.assert_frame_equal(a.requests, b.requests)
    assert a.metrics == b.metrics and fast.counters == slow.counters
    for u, v in zip(fast.decode, slow.decode, strict=True):
        assert (u.busy_ns, u.decode_tokens_total, u.iterations) == (
            v.busy_ns,
            v.decode_tokens_total,
            v.iterations,
        )
        assert (u.itl._counts, u.itl.weighted_ns, u.itl.tokens) == (
            v.itl._counts,
            v.itl.weighted_ns,
            v.itl.tokens,
        )

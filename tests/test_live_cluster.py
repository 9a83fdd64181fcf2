"""``envs.live`` and the simulator's injection API: a request injected at its arrival, placed where the
simulator would have routed it, is simulated exactly as the trace-driven run simulates it; the live
prefix resolver gives the caches the trace's sharing; the live clock, lag and borrowed intake."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np
import pytest

from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.live import LiveCluster, PrefixResolver, lag_check, local_prefill_demand
from envs.prefix_cache import PrefixCache, PrefixIndex
from envs.request import Request, Trace
from envs.sim_state import StepWindow
from envs.simulator import Simulator
from envs.traces import load_trace
from policies.lease import LeaseBudgets
from serving.replay import PromptTokens
from train.experiment import build_scheduler, head

MODEL = ("H200", "gpt-oss-120b", 1)


def _placed_run(trace: Trace, config: ClusterConfig) -> tuple[Simulator, list[tuple[int, int]]]:
    sim = Simulator(trace, config)
    sim.run()
    return sim, [(r.prefill_worker, r.decode_worker) for r in sim.reqs]


@pytest.mark.parametrize("routing", ["round_robin", "cache_aware"])
def test_injected_requests_are_simulated_exactly_as_trace_requests(routing: str) -> None:
    trace = head(load_trace("mooncake"), 120)
    config = ClusterConfig(prefill_routing=routing, decode_routing=routing, max_decode_jump_iters=1)
    ref, placement = _placed_run(trace, config)
    live = Simulator(Trace("live", []), config)
    live.open_ended = True
    for r in sorted(trace.requests, key=lambda r: (r.arrival_s, r.request_id)):
        live.step_until(r.arrival_s)
        p, d = placement[r.request_id]
        live.inject(r, prefill_worker=p, decode_worker=d)
    live.step_until(float("inf"))
    assert live.finished == len(trace.requests)
    for a, b in zip(ref.reqs, live.reqs, strict=True):
        assert (a.first_token_s, a.finish_s, a.cached) == (b.first_token_s, b.finish_s, b.cached), a.rid
    assert ref.result().metrics == live.result().metrics


def test_inject_checks_its_arguments() -> None:
    sim = Simulator(Trace("live", []), ClusterConfig(n_prefill=1, n_decode=1))
    r = Request(0, -1, 0, 0.0, 100, 5)
    with pytest.raises(ValueError, match="exactly one of"):
        sim.inject(r, decode_worker=0)
    with pytest.raises(ValueError, match="next id"):
        sim.inject(dataclasses.replace(r, request_id=3), decode_worker=0, prefill_worker=0)
    with pytest.raises(ValueError, match="out of range"):
        sim.inject(r, decode_worker=1, prefill_worker=0)
    with pytest.raises(ValueError, match="needs a simulator with a scheduler"):
        sim.inject(r, decode_worker=0, reservation_id=1)
    assert sim.refusal_reason(sim.cm.kv_capacity_tokens, 1) is not None
    assert sim.refusal_reason(100, 5) is None


def test_prefix_resolver_gives_the_caches_the_traces_sharing() -> None:
    trace = head(load_trace("mooncake"), 300)
    page = 256
    prompts = PromptTokens(trace.requests, seed=1)
    resolver = PrefixResolver(page)
    resolved: list[Request] = []
    for r in trace.requests:
        ids = prompts.ids(r.request_id)
        hashes = resolver.page_hashes(ids)
        parent, shared = resolver.resolve(hashes, len(ids))
        resolver.add(hashes, r.request_id, len(ids))
        resolved.append(dataclasses.replace(r, parent_id=parent, shared_prefix_tokens=shared))
    assert sum(r.parent_id >= 0 for r in resolved) > 50, "the fixture must share prefixes"
    # an unbounded cache that holds every earlier request sees the same hit for every request
    by_trace, by_ids = (PrefixCache(PrefixIndex(reqs, page), 10**9) for reqs in (trace.requests, resolved))
    for r in trace.requests:
        assert by_ids.match_tokens(r.request_id) == by_trace.match_tokens(r.request_id), r.request_id
        by_trace.insert(r.request_id)
        by_ids.insert(r.request_id)
    # identical prompts share their whole length, a partial last page included
    again = resolver.page_hashes(prompts.ids(5))
    assert resolver.resolve(again, trace.requests[5].input_tokens)[1] == trace.requests[5].input_tokens


def test_lag_check_and_demand() -> None:
    assert lag_check(0.04, 1.0) is None
    assert "lagged 0.060 s" in (lag_check(0.06, 1.0) or "")
    d = local_prefill_demand(1000, 50, cached_tokens=200)
    assert (d.prefill_tokens, d.kv_tokens, d.decode_tokens, d.tasks) == (800, 1050, 50, 1)


async def _run_live(cluster: LiveCluster, body: object) -> object:
    driver = asyncio.create_task(cluster.run())
    await asyncio.sleep(0)
    try:
        return await body  # type: ignore[misc]
    finally:
        driver.cancel()


def test_live_cluster_streams_tokens_at_the_cost_models_times() -> None:
    cm = CostModel(*MODEL)
    scale = 8.0
    cluster = LiveCluster(ClusterConfig(n_prefill=1, n_decode=1), cost_model=cm, time_scale=scale)
    n_in, n_out = 3000, 30

    async def body() -> tuple[list[tuple[int, float]], float, float]:
        t0 = time.perf_counter()
        live = cluster.submit(np.arange(n_in), n_out, prefill_worker=0, decode_worker=0)
        seen: list[tuple[int, float]] = []
        landed_s = 0.0
        while not live.done:
            await live.changed()
            if live.kv_landed.is_set() and not landed_s:
                landed_s = time.perf_counter() - t0
            seen.append((live.generated, (time.perf_counter() - t0) / scale))
        return seen, landed_s / scale, cluster.now_s()

    seen, landed_s, _ = asyncio.run(_run_live(cluster, body()))  # type: ignore[misc]
    assert 0 < landed_s <= seen[0][1] + 0.004, "the KV lands before the first token is delivered"
    req = cluster.sim.reqs[0]
    assert req.generated == n_out and seen[-1][0] == n_out
    assert [g for g, _ in seen] == list(range(1, n_out + 1)), "one event per token at stream interval 1"
    first_s = seen[0][1]
    assert first_s == pytest.approx(req.first_token_s, abs=0.004)  # delivered when simulated (8x slower)
    assert seen[-1][1] == pytest.approx(req.finish_s, abs=0.004)
    assert req.first_token_s > cm.iteration_time_s([(n_in, 0)], 0, 0), "first token after prefill + transfer"
    lag = cluster.lag_report("decode", 0)
    assert lag["iterations"] >= n_out - 1 and lag["check"] is None


def test_lag_beyond_five_percent_of_the_run_fails_its_check() -> None:
    cluster = LiveCluster(
        ClusterConfig(n_prefill=1, n_decode=1), cost_model=CostModel(*MODEL), time_scale=2.0
    )

    async def body() -> None:
        live = cluster.submit(np.arange(500), 200, prefill_worker=0, decode_worker=0)
        while live.generated < 20:
            await live.changed()
        time.sleep(0.4)  # the host stalls: the iterations due meanwhile are processed late
        while not live.done:
            await live.changed()

    asyncio.run(_run_live(cluster, body()))  # type: ignore[misc]
    report = cluster.lag_report("decode", 0)
    assert report["max_s"] >= 0.35
    assert report["check"] is not None and "not trustworthy" in report["check"]


def test_borrowed_requests_run_on_the_nodes_lease_or_are_refused() -> None:
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1)
    scheduler = build_scheduler("utilisation", config, cm)
    cluster = LiveCluster(config, cost_model=cm, scheduler=scheduler, time_scale=2.0)
    no_lease = LiveCluster(config, cost_model=cm, time_scale=2.0)
    assert no_lease.reserve_borrowed(0, 1000, 10) is None

    async def body() -> tuple[Any, int]:
        # the node's control ticks start with the cluster: its lease is out before any request
        at_start = scheduler.ledger.lease(0)
        await asyncio.sleep(config.control_interval_s * 2.0 * 1.5)
        warm = cluster.submit(np.arange(200), 400, prefill_worker=0, decode_worker=0)  # keeps ticks going
        await asyncio.sleep(config.control_interval_s * 2.0 * 1.5)
        reservation = cluster.reserve_borrowed(0, 1000, 10)
        assert reservation is not None
        live = cluster.submit_borrowed(
            np.arange(10_000, 11_000), 10, decode_worker=0, reservation_id=reservation
        )
        while not live.done:
            await live.changed()
        while not warm.done:
            await warm.changed()
        return at_start, live.generated

    at_start, generated = asyncio.run(_run_live(cluster, body()))  # type: ignore[misc]
    assert at_start is not None and not at_start.budgets.is_zero() and at_start.is_live(0.0)
    assert generated == 10
    req = cluster.sim.reqs[1]
    assert req.path == 1 and cluster.sim.counters.borrowed_prefill_tokens == 1000


class _Refusals:
    """A simulator listener that records refused requests (the emulated worker answers them 503)."""

    def __init__(self) -> None:
        self.refused: list[int] = []

    def __getattr__(self, name: str) -> object:
        return lambda *args: None

    def on_reject(self, req: object) -> None:
        self.refused.append(req.rid)  # type: ignore[attr-defined]


def _wire_fed_node() -> tuple[Simulator, Any, _Refusals]:
    """A one-node cluster whose node installs pushed leases (``WireLeases``), refusing fallbacks as
    the emulated worker does, with a listener that records the refusals."""
    from serving.node_leases import WireLeases

    config = ClusterConfig(n_prefill=1, n_decode=1, control_interval_s=0.1)
    nodes = WireLeases(1, burst_s=config.control_interval_s)
    sim = Simulator(Trace("live", [], source="test"), config, scheduler=nodes, cost_model=CostModel(*MODEL))
    sim.open_ended = sim.refuse_fallbacks = True
    listener = _Refusals()
    sim.listener = listener  # type: ignore[assignment]
    return sim, nodes, listener


@pytest.mark.parametrize("when", ["before-arrival", "while-waiting"])
def test_a_wire_fed_node_refuses_a_borrowed_request_whose_reservation_lapsed(when: str) -> None:
    """On a node whose leases come over the wire (``WireLeases``), a borrowed request whose reservation
    the node revoked (a smaller lease pushed) is refused with 503 before any token, so the router falls
    back: at its arrival, or while it waits for credit, at the next control interval. (The revoked
    reservation is closed already; giving it back must not fail.)"""
    sim, nodes, listener = _wire_fed_node()
    lease = LeaseBudgets(
        prefill_tokens=1_000, kv_tokens=10**6, transfer_tokens=0, decode_tokens=10**5, tasks=4
    )
    nodes.install_lease(0, lease, 1.0, 0.0)  # 1 000 tokens/s; the bucket starts empty
    sim.decode[0].bucket.set_lease(0.0, *nodes.lease_rate(0))
    demand = local_prefill_demand(5_000, 10)
    reservation = nodes.ledger.reserve(0, dataclasses.replace(demand, prefill_tokens=500), 0.0)
    assert reservation is not None
    rid = reservation.reservation_id
    smaller = dataclasses.replace(lease, tasks=0)  # holds nothing: the reservation is revoked
    if when == "before-arrival":
        assert nodes.install_lease(0, smaller, 1.0, 0.0) == [rid]
    sim.inject(Request(0, 0, 0, 0.0, 5_000, 10, -1, 0), decode_worker=0, reservation_id=rid)
    if when == "while-waiting":
        assert sim.reqs[0] in sim.decode[0].borrowed and not sim.reqs[0].started, "waits for credit"
        assert nodes.install_lease(0, smaller, 1.0, 0.0) == [rid]
        sim.step_until(0.25)
    assert listener.refused == [0] and sim.reqs[0].path == 2 and sim.reqs[0].generated == 0
    assert nodes.ledger.status(rid) == "revoked" and nodes.ledger.active_ids() == []


def test_a_live_borrowed_request_refused_as_it_enters_gets_its_503() -> None:
    """The emulated worker reserves, then submits; a lease pushed in between that revokes the
    reservation makes the simulator refuse the request inside ``submit_borrowed``: the refusal must
    still reach the request (503 before any token), not leave it waiting forever."""
    from serving.node_leases import WireLeases

    config = ClusterConfig(n_prefill=1, n_decode=1)
    cluster = LiveCluster(config, cost_model=CostModel(*MODEL), scheduler=WireLeases(1), time_scale=2.0)
    lease = LeaseBudgets(
        prefill_tokens=10_000, kv_tokens=10**6, transfer_tokens=0, decode_tokens=10**5, tasks=4
    )

    async def body() -> tuple[int, str] | None:
        cluster.install_lease(0, lease, 5.0)
        reservation = cluster.reserve_borrowed(0, 1_000, 10)
        assert reservation is not None
        cluster.install_lease(0, dataclasses.replace(lease, tasks=0), 5.0)  # revokes it
        live = cluster.submit_borrowed(np.arange(1_000), 10, decode_worker=0, reservation_id=reservation)
        await asyncio.wait_for(live.changed(), timeout=5.0)
        assert live.generated == 0 and cluster.in_flight() == 0
        return live.error

    error = asyncio.run(_run_live(cluster, body()))  # type: ignore[misc]
    assert error is not None and error[0] == 503


def test_a_revoking_lease_pushed_to_an_emulated_worker_refuses_its_queued_borrowed_work_at_once() -> None:
    """A zero lease pushed while a borrowed request waits on the node for credit: the emulated worker
    refuses it (503 before any token, so the router falls back) as it installs the lease, as the
    plugin aborts such requests in ``set_lease``; not at the emulated cluster's next control interval,
    which runs on its own grid up to an interval after the router's (the simulator falls revoked work
    back at the interval that revokes it)."""
    from serving.node_leases import WireLeases

    config = ClusterConfig(n_prefill=1, n_decode=1, control_interval_s=0.5)
    cluster = LiveCluster(config, cost_model=CostModel(*MODEL), scheduler=WireLeases(1), time_scale=2.0)
    lease = LeaseBudgets(prefill_tokens=200, kv_tokens=10**6, transfer_tokens=0, decode_tokens=10**5, tasks=4)

    async def body() -> tuple[int, str] | None:
        cluster.install_lease(0, lease, 5.0)  # 40 tokens/s: a 2 000-token prompt waits for credit
        demand = dataclasses.replace(local_prefill_demand(2_000, 10), prefill_tokens=100)
        reservation = cluster.reserve_borrowed(0, 2_000, 10)
        assert reservation is None, "the lease cannot hold the whole prompt"
        held = cluster.sim.scheduler.ledger.reserve(0, demand, cluster.sim.now_s)  # type: ignore[union-attr]
        assert held is not None
        live = cluster.submit_borrowed(
            np.arange(2_000), 10, decode_worker=0, reservation_id=held.reservation_id
        )
        await asyncio.sleep(0.05)
        req = cluster.sim.reqs[live.rid]
        assert req in cluster.sim.decode[0].borrowed and live.error is None, "it waits for credit"
        assert cluster.install_lease(0, LeaseBudgets.zero(), 5.0) == [held.reservation_id]
        return live.error  # read with no await since the install: the cluster has not run on

    error = asyncio.run(_run_live(cluster, body()))  # type: ignore[misc]
    assert error is not None and error[0] == 503, "refused as the lease was installed"
    assert cluster.in_flight() == 0


def test_an_emulated_workers_recent_step_times_are_over_the_iterations_of_the_trailing_interval() -> None:
    """``LiveCluster.node_state`` averages the iterations that ended in the control interval ending
    now, whatever the phase of the cluster's own ticks (``StepWindow``: the plugin's trailing
    window), and reads zero once none did."""
    config = ClusterConfig(n_prefill=1, n_decode=1, control_interval_s=0.5)
    cluster = LiveCluster(config, cost_model=CostModel(*MODEL))  # never started: the test sets its clock
    sim, w = cluster.sim, cluster.sim.decode[0]
    assert w.step_log is not None
    w.step_log.add(0.9, 300_000_000, 10_000_000)  # a long mixed iteration ending at 0.9 s
    for k in range(10):
        w.step_log.add(1.0 + 0.02 * k, 20_000_000, 20_000_000)
    sim.now_s = 1.2
    state = cluster.node_state(0)
    assert state.recent_step_time_s == pytest.approx((0.3 + 10 * 0.02) / 11)
    assert state.recent_decode_only_step_time_s == pytest.approx((0.01 + 10 * 0.02) / 11)
    sim.now_s = 1.45  # 0.9 s is past the trailing interval now
    assert cluster.node_state(0).recent_step_time_s == pytest.approx(0.02)
    sim.now_s = 2.0
    assert cluster.node_state(0).recent_step_time_s == 0.0


def test_the_step_window_matches_a_simulator_tick_on_the_iterations_it_counted() -> None:
    """The trailing window an emulated worker reports is fed by the simulator's own accounting: read
    at each control tick, just before its counters restart, it holds exactly the iterations that
    tick's counters did (mixed iterations with borrowed prefill among them), with the same sums."""
    config = ClusterConfig(n_prefill=1, n_decode=1, control_interval_s=0.5)
    requests = [Request(i, i, 0, 0.02 * i, 6_000 + 97 * i, 40, -1, 0) for i in range(80)]
    cm = CostModel(*MODEL)
    scheduler = build_scheduler("heuristic", config, cm)
    sim = Simulator(Trace("t", requests, source="test"), config, scheduler=scheduler, cost_model=cm)
    w = sim.decode[0]
    window = w.step_log = StepWindow(config.control_interval_s)
    seen: list[int] = []
    on_tick = sim._on_tick

    def checked_tick() -> None:
        sim._sync(w)
        if w.step_count and sim.last_tick_s == pytest.approx(sim.now_s - config.control_interval_s):
            recent, decode_only = window.read(sim.now_s)
            assert window.count == w.step_count and window.step_ns == w.step_time_ns
            assert window.decode_only_ns == w.decode_only_ns
            assert recent == w.step_time_ns * 1e-9 / w.step_count
            assert decode_only == w.decode_only_ns * 1e-9 / w.step_count
            seen.append(w.step_count)
        on_tick()

    sim._on_tick = checked_tick  # type: ignore[method-assign]
    sim.run()
    assert len(seen) >= 4
    assert w.mixed_decode_tokens_total > 0, "borrowed prefill mixed into decode iterations"

def test_a_wire_fed_node_aborts_started_borrowed_work_whose_lease_ran_out() -> None:
    """As the plugin does (``_abort_stalled_chunk``): a borrowed prompt that started on a lease which
    then expired with no new one cannot be paid for; at the next control interval it is refused (503
    before any token, so the router falls back) and its KV goes back to the node, instead of waiting
    for credit forever."""
    sim, nodes, listener = _wire_fed_node()
    lease = LeaseBudgets(
        prefill_tokens=2_000, kv_tokens=10**6, transfer_tokens=0, decode_tokens=10**5, tasks=4
    )
    nodes.install_lease(0, lease, 0.5, 0.0)  # 4 000 tokens/s for 0.5 s: far from the 20 000 needed
    sim.decode[0].bucket.set_lease(0.0, *nodes.lease_rate(0))
    reservation = nodes.ledger.reserve(0, local_prefill_demand(20_000, 10), 0.0)
    assert reservation is None, "the lease cannot hold the whole prompt"
    demand = dataclasses.replace(local_prefill_demand(20_000, 10), prefill_tokens=1_000)
    reservation = nodes.ledger.reserve(0, demand, 0.0)
    assert reservation is not None
    sim.inject(
        Request(0, 0, 0, 0.0, 20_000, 10, -1, 0), decode_worker=0, reservation_id=reservation.reservation_id
    )
    sim.step_until(0.45)
    req = sim.reqs[0]
    assert req.started and 0 < req.done < req.input and sim.decode[0].kv_used > 0, "it started"
    sim.step_until(1.0)
    assert listener.refused == [0] and req.generated == 0 and req.path == 2
    assert sim.decode[0].kv_used == 0 and sim.decode[0].n_active == 0 and not sim.decode[0].borrowed
    assert nodes.ledger.active_ids() == []

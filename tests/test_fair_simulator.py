"""The simulator treats static PD as SGLang and its gateway would, and leases bind: one test per rule.

Each test fails without its rule: decode routing that herds, prefill that ignores decode
pre-allocation, KV transfer after the whole prefill or on private links, a decode prefix cache that
changes nothing, requests served past the context window, borrowed prefill above the lease, and a
scheduler that estimates with other numbers than the simulator runs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.cluster_config import ClusterConfig
from envs.cost_model import CostModel
from envs.estimator import ClusterEstimator
from envs.request import Request, Trace
from envs.simulator import Simulator, simulate
from policies.ledger import LeaseLedger
from policies.node_policies import HeuristicPolicy, StaticPolicy
from policies.scheduler import ClusterScheduler
from policies.slo import DEFAULT_CONTROL_INTERVAL_S
from tests.fakes import ConstantPredictor, LinearCostModel, open_trace, session_trace


def _cfg(**kw: object) -> ClusterConfig:
    base: dict[str, object] = {"n_prefill": 1, "n_decode": 1, "page_tokens": 16, "prefill_chunk_tokens": 4096}
    base.update(kw)
    return ClusterConfig(**base)  # type: ignore[arg-type]


def test_static_decode_load_is_balanced_on_agent_sessions() -> None:
    """smg's cache-aware decode selection over in-flight counts spreads agent sessions (the old rule,
    counting only requests already at decode, put 86 % of decode tokens on node 0)."""
    from train.experiment import Point, run_point

    res = run_point(Point(trace="agent", max_requests=60))
    for role in ("prefill", "decode"):
        busy = res.nodes[res.nodes["role"] == role]["busy_fraction"].to_numpy()
        assert busy.min() > 0
        assert busy.max() / busy.mean() <= 1.5, (role, busy)


def test_prefill_waits_until_decode_preallocated_its_kv() -> None:
    """B cannot pre-allocate on D while A holds the KV, so P leaves B unscheduled until A finishes."""
    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, kv_capacity_tokens=3000)
    trace = open_trace([(0.0, 2000, 50), (0.0, 2000, 5)])
    sim = Simulator(trace, _cfg(num_reserved_decode_tokens=0, kv_transfer_latency_s=0.0), cost_model=cm)  # type: ignore[arg-type]
    res = sim.run()
    a, b = res.requests.iloc[0], res.requests.iloc[1]
    prefill_s = 0.01 + 2000 * 1e-5
    assert a["first_token_s"] == pytest.approx(prefill_s)
    assert b["first_token_s"] == pytest.approx(a["finish_s"] + prefill_s)  # P was held, not early
    assert res.metrics.retractions == 0


def test_kv_transfer_is_chunked_and_overlaps_the_prefill() -> None:
    """Each chunk's KV leaves as soon as it is computed: a 10,000-token prompt in chunks of 4096, 4096
    and 1808 tokens (compute 0.01 s + 1e-5 s/token, transfer 1e-5 s/token). Chunk 2 is computed at
    0.10192 s; its transfer and then the short last chunk's keep the link busy to 0.16096 s."""
    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, kv_transfer_bytes_per_token=1000)
    cfg = _cfg(kv_transfer_bandwidth_bytes_per_s=1e8, kv_transfer_latency_s=0.002)
    res = simulate(open_trace([(0.0, 10_000, 1)]), cfg, cost_model=cm)  # type: ignore[arg-type]
    chunk2_done_s = 2 * (0.01 + 4096 * 1e-5)
    landed_s = chunk2_done_s + 4096 * 1e-5 + 1808 * 1e-5 + 0.002
    assert res.requests.iloc[0]["first_token_s"] == pytest.approx(landed_s)
    whole_after_prefill_s = 3 * 0.01 + 10_000 * 1e-5 + 10_000 * 1e-5 + 0.002
    assert landed_s < whole_after_prefill_s - 0.06  # 0.069 s of transfer hidden under compute


def test_concurrent_transfers_share_the_decode_workers_link() -> None:
    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, kv_transfer_bytes_per_token=1000)
    cfg = _cfg(n_prefill=2, kv_transfer_bandwidth_bytes_per_s=1e8, kv_transfer_latency_s=0.0)
    res = simulate(open_trace([(0.0, 4000, 1), (0.0, 4000, 1)]), cfg, cost_model=cm)  # type: ignore[arg-type]
    assert sorted(res.requests["prefill_worker"]) == [0, 1]  # one per prefill worker, done together
    first = sorted(res.requests["first_token_s"])
    prefill_s, transfer_s = 0.01 + 4000 * 1e-5, 4000 * 1000 / 1e8
    assert first == pytest.approx([prefill_s + transfer_s, prefill_s + 2 * transfer_s])


def _two_turns() -> Trace:
    return Trace(
        "turns",
        [
            Request(0, 0, 0, 0.0, 4096, 1),
            Request(1, 0, 1, 10.0, 8192, 1, parent_id=0, shared_prefix_tokens=4096),
        ],
    )


def test_decode_prefix_cache_is_off_by_default_and_when_on_only_the_suffix_travels() -> None:
    assert ClusterConfig().decode_prefix_cache is False
    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, kv_transfer_bytes_per_token=1000)
    cfg = _cfg(kv_transfer_bandwidth_bytes_per_s=1e8, kv_transfer_latency_s=0.0)
    off = simulate(_two_turns(), cfg, cost_model=cm).requests.iloc[1]  # type: ignore[arg-type]
    on = simulate(_two_turns(), cfg.with_(decode_prefix_cache=True), cost_model=cm).requests.iloc[1]  # type: ignore[arg-type]
    assert off["cached_tokens"] == on["cached_tokens"] == 4096  # P computes the suffix either way
    ttft_off, ttft_on = off["first_token_s"] - 10.0, on["first_token_s"] - 10.0
    assert ttft_off == pytest.approx(0.01 + 4096 * 1e-5 + 8192 * 1e-5)  # the whole KV travels
    assert ttft_off - ttft_on == pytest.approx(4096 * 1000 / 1e8)  # D already had the prefix


def _long_session() -> Trace:
    return Trace(
        "long",
        [
            Request(0, 0, 0, 0.0, 3000, 10),
            Request(1, 0, 1, 5.0, 5000, 100, parent_id=0, shared_prefix_tokens=3000),
            Request(2, 0, 2, 10.0, 3500, 10, parent_id=1, shared_prefix_tokens=3000),
            Request(3, 1, 0, 15.0, 1000, 10),
        ],
    )


def test_requests_beyond_the_context_window_are_compacted_and_lose_their_cached_prefix() -> None:
    cfg = _cfg(max_context_tokens=4000)
    sim = Simulator(_long_session(), cfg, cost_model=LinearCostModel())  # type: ignore[arg-type]
    res = sim.run()
    m = res.metrics
    assert m.n_compacted == 1 and m.n_rejected == 0 and m.n_finished == 4
    rows = res.requests.set_index("request_id")
    assert rows.loc[1, "input_tokens"] + rows.loc[1, "output_tokens"] == 4000  # cut to the window
    assert rows.loc[1, "cached_tokens"] == 0  # the cut prompt shares nothing with turn 0
    assert rows.loc[2, "cached_tokens"] == 0  # nor does the turn that extended the uncut one
    assert m.max_input_tokens_served == 3900 <= cfg.context_window_tokens
    assert sim.trace.requests[2].parent_id == -1


def test_context_policy_reject_refuses_with_a_reason_outside_the_slo_denominator() -> None:
    cfg = _cfg(max_context_tokens=4000, context_policy="reject")
    res = simulate(_long_session(), cfg, cost_model=LinearCostModel())  # type: ignore[arg-type]
    m = res.metrics
    assert m.n_rejected == m.n_rejected_context == 1 and m.n_compacted == 0 and m.n_finished == 3
    err = res.requests.set_index("request_id").loc[1, "error"]
    assert "exceed the model's context window (4000 tokens)" in err
    assert m.slo_attainment == m.n_slo_met / 3
    assert m.max_input_tokens_served == 3500
    with pytest.raises(ValueError, match="context_policy"):
        ClusterConfig(context_policy="truncate")  # type: ignore[arg-type]


def test_catalog_models_know_their_context_window() -> None:
    assert ClusterConfig(model="gpt-oss-120b").context_window_tokens == 131_072
    assert ClusterConfig(model="glm-5", tp=8).context_window_tokens == 202_752


def _lending_sim(seed: int, predictor_tokens_per_s: float, ttl_s: float, zero_node: bool) -> Simulator:
    trace = session_trace(n_sessions=10, turns=4, first_input=6000, grow=3000, output=120, think_s=0.3)
    cfg = ClusterConfig(n_prefill=1, n_decode=3, page_tokens=256)
    cm = CostModel(cfg.gpu, cfg.model, cfg.tp)
    heuristic = HeuristicPolicy(ConstantPredictor(predictor_tokens_per_s), ttl_s=ttl_s, max_tasks=3)
    policy = {0: StaticPolicy(ttl_s=ttl_s), 1: heuristic, 2: heuristic} if zero_node else heuristic
    scheduler = ClusterScheduler(
        policy, LeaseLedger(), ClusterEstimator(cfg, cm), control_interval_s=0.5, congestion_wait_s=0.05
    )
    return Simulator(trace, cfg, scheduler=scheduler, cost_model=cm, session_rate_per_s=4.0, seed=seed)


def _assert_spent_within_granted(sim: Simulator) -> None:
    for w, granted in zip(sim.decode, sim.granted_prefill_tokens(), strict=True):
        assert w.borrowed_tokens_total <= granted + 1e-6, (w.idx, w.borrowed_tokens_total, granted)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([300.0, 3_000.0, 30_000.0]),
    ttl_s=st.sampled_from([0.5, 2.0, 8.0]),
    zero_node=st.booleans(),
)
def test_borrowed_tokens_never_exceed_what_the_leases_granted(
    seed: int, rate: float, ttl_s: float, zero_node: bool
) -> None:
    """At every control interval and at the end, on every node: executed <= granted (ledger's record)."""
    sim = _lending_sim(seed, rate, ttl_s, zero_node)
    t = 0.0
    while sim.step_until(t):
        _assert_spent_within_granted(sim)
        t += 0.25
    _assert_spent_within_granted(sim)
    res = sim.result()
    assert 0.0 <= res.metrics.lease_utilisation <= 1.0
    assert res.metrics.n_finished == len(sim.reqs)
    if zero_node:  # a node whose policy never lends gets no lease and runs no borrowed work
        assert sim.decode[0].borrowed_tokens_total == 0 and sim.granted_prefill_tokens()[0] == 0.0


def test_lending_happens_and_is_bounded_in_the_property_setup() -> None:
    """The property test is not vacuous: the same setup borrows, within its grant."""
    sim = _lending_sim(seed=1, predictor_tokens_per_s=30_000.0, ttl_s=2.0, zero_node=False)
    res = sim.run()
    assert res.metrics.borrowed_prefill_tokens > 0 and res.metrics.borrowed_share > 0
    assert 0 < res.metrics.lease_utilisation <= 1.0


def test_scheduler_estimates_with_the_clusters_own_numbers() -> None:
    from policies.path import PathQuery, normal_path_estimate_s
    from train.experiment import Point, build_scheduler

    point = Point(policy="heuristic")
    cfg = point.cluster()
    assert cfg.control_interval_s == DEFAULT_CONTROL_INTERVAL_S
    cm = CostModel(cfg.gpu, cfg.model, cfg.tp)
    query = PathQuery(1, 0, 20_000, 100, 20_000, 0.0, 0)

    def normal_s(config: ClusterConfig) -> float:
        scheduler = build_scheduler("heuristic", config, cm, predictor=ConstantPredictor(1000.0))
        assert scheduler.control_interval_s == config.control_interval_s
        assert scheduler.policy_for(0).itl_target_s == config.slo_tpot_s
        return float(normal_path_estimate_s(scheduler.cost, query))

    slow_link = cfg.with_(kv_transfer_bandwidth_bytes_per_s=1e9, kv_transfer_latency_s=0.05)
    expected = cm.prefill_time_s(20_000, 0, cfg.prefill_chunk_tokens) + cm.kv_transfer_time_s(
        20_000, bandwidth_bytes_per_s=1e9, latency_s=0.05
    )
    assert normal_s(slow_link) == pytest.approx(expected)
    assert normal_s(slow_link) > normal_s(cfg)
    small_chunks = cfg.with_(prefill_chunk_tokens=1024)
    assert normal_s(small_chunks) > normal_s(cfg)  # more iterations, each with its fixed cost
    assert math.isfinite(normal_s(cfg.with_(slo_tpot_s=0.03, control_interval_s=0.25)))


def test_decode_jumps_while_borrowed_work_waits_for_credit_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose borrowed work waits only for token-bucket credit decodes in jumps up to the first
    iteration start with enough credit; the run is identical to one of single iterations."""
    from envs.simulator import Simulator
    from train.experiment import Point, prepare_trace, run_point

    calls = []
    original = Simulator._credit_iterations

    def counted(self: Simulator, w: Any, ends: Any) -> int:
        j = original(self, w, ends)
        calls.append(j)
        return j

    monkeypatch.setattr(Simulator, "_credit_iterations", counted)
    point = Point(policy="heuristic", trace="mooncake", max_requests=300, load=1.5)
    trace = prepare_trace(point)
    jumped = run_point(point, trace=trace)
    assert calls and max(calls) > 1  # credit-waiting jumps happened, some of several iterations
    single_point = Point(
        policy="heuristic",
        trace="mooncake",
        max_requests=300,
        load=1.5,
        cluster_overrides=(("max_decode_jump_iters", 1),),
    )
    single = run_point(single_point, trace=trace)
    assert jumped.metrics.borrowed_prefill_tokens > 0
    for col in ("first_token_s", "finish_s", "decode_worker", "path", "retractions"):
        np.testing.assert_array_equal(jumped.requests[col], single.requests[col])
    assert jumped.metrics == single.metrics


@pytest.mark.parametrize("race", [False, True])
def test_a_same_instant_burst_herds_only_with_the_gateway_race(race: bool) -> None:
    """Ten distinct requests at one instant over 2P: alternated by the in-flight counts, or (smg's
    race, ``router_same_instant_race``) all on one prefill worker; a later request sees them all."""
    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, kv_capacity_tokens=300000)
    trace = open_trace([(0.0, 2000, 5)] * 10 + [(0.001, 2000, 5)])
    cfg = _cfg(n_prefill=2, n_decode=2, router_same_instant_race=race)
    req = Simulator(trace, cfg, cost_model=cm).run().requests  # type: ignore[arg-type]
    burst = req[req["arrival_s"] == 0.0]["prefill_worker"].value_counts().sort_index().tolist()
    assert burst == ([10] if race else [5, 5])
    late = req[req["arrival_s"] > 0.0]["prefill_worker"].item()
    assert late == (1 if race else 0)


def test_the_router_kv_load_reads_as_a_mapping() -> None:
    """``RouterKvLoad.get`` (its own, for speed) answers as ``Mapping.get`` would: a node's count, and
    the default for a node that does not exist."""
    from envs.sim_state import RouterKvLoad

    cm = LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, kv_capacity_tokens=20_000)
    trace = open_trace([(0.0, 2000, 50), (0.0, 3000, 40), (0.001, 1500, 30)])
    sim = Simulator(trace, _cfg(n_decode=2, kv_transfer_latency_s=0.0), cost_model=cm)  # type: ignore[arg-type]
    sim.step_until(0.002)
    load = RouterKvLoad(sim.decode, sim._sync)
    first = load.get(1)  # read through get before the mapping has seen the node
    assert first == load[1] and load.get(0) == load[0]
    assert dict(load) == {0: load[0], 1: load[1]} and sum(dict(load).values()) > 0
    assert load.get(2) is None and load.get(2, -7) == -7 and load.get(-1, "none") == "none"


@pytest.mark.slow
def test_started_borrowed_work_does_not_hold_a_pressed_node_forever() -> None:
    """A GLM-5 point of ``compare --full`` that never finished: a borrowed 145k-token prompt, 3,908
    tokens short, held its KV on a decode node whose next admission (202k tokens) could not fit beside
    it; the queued admission kept the node under decode pressure, so its lease stayed at zero and the
    prompt waited for credit until the time cap, with 442 requests unfinished. Now the started prompt
    falls back once its lease has expired, as the node plugin aborts it."""
    from interference_model.artifact import DATA_DIR, artifact_slug
    from train.compare import _cap_for, _predictor, trace_for
    from train.experiment import Point, build_simulator

    point = Point(
        policy="heuristic", trace="agent", model="glm-5", tp=8, shape="4P2D", load=1.020101353893286,
        max_requests=20, seed=3, split="heldout", open_loop_arrivals="poisson",
    )  # fmt: skip
    trace = trace_for(point)
    artifact = str(DATA_DIR / artifact_slug(point.gpu, point.model, point.resolved_tp))
    sim = build_simulator(
        point, trace=trace, predictor=_predictor(point, artifact, None), max_time_s=_cap_for(point, trace)
    )
    res = sim.run()
    assert res.metrics.n_finished == res.metrics.n_requests == 1295
    assert sim.counters.fallbacks >= 1 and sim.now_s < 30_000  # the cap is at 105,238 s

"""A capacity probe may stop as soon as it is sure to fail: the SLO-share bound never under-reads the
final share, a checked run that never stops is the plain run, and a search gives the same answer."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import train.compare as compare
from envs.metrics import SloShareBound
from train.compare import CapacityJob, capacity_job
from train.experiment import Point, build_simulator, prepare_trace, run_point
from train.saturation import IDLE_LOAD, capacity_search, served_slo_share

POINTS = {
    # a lending policy past static saturation (many misses), static below and past it, closed loop
    "heuristic-overload": Point(policy="heuristic", trace="mooncake", max_requests=300, load=2.5),
    "static-light": Point(trace="mooncake", max_requests=300, load=0.5),
    "static-overload": Point(trace="mooncake", max_requests=300, load=3.0),
    "static-agent": Point(trace="agent", max_requests=40, session_rate_per_s=0.05),
}


@pytest.mark.parametrize("name", sorted(POINTS))
def test_a_checked_run_that_never_stops_is_the_plain_run_and_its_bound_never_under_reads(name: str) -> None:
    point = POINTS[name]
    trace = prepare_trace(point)
    plain = run_point(point, trace=trace)
    sim = build_simulator(point, trace=trace)
    bound, seen = SloShareBound(sim), []

    def never(t: float) -> bool:
        seen.append((t, bound(t)))
        return False

    checked = sim.run_checked(never, 2.0)
    assert checked is not None
    assert checked.metrics.to_dict() == plain.metrics.to_dict()
    pd.testing.assert_frame_equal(checked.requests, plain.requests)
    final = served_slo_share(plain.metrics.to_dict())
    assert len(seen) > 5
    assert all(b >= final for _, b in seen)  # an upper bound at every check ...
    assert [t for t, _ in seen] == sorted(t for t, _ in seen)
    values = [b for _, b in seen]
    assert values == sorted(values, reverse=True)  # ... that only tightens
    if final < 0.9:  # and it is informative: a failing run is seen to fail before it ends
        assert min(values) < 0.9


def test_the_bound_counts_waiting_shed_and_slow_requests_as_misses_and_rejections_out() -> None:
    point = Point(trace="mooncake", max_requests=60, load=4.0)
    sim = build_simulator(point, trace=prepare_trace(point))
    bound = SloShareBound(sim)
    assert bound(0.0) == 1.0  # nothing has happened yet
    ttft, tpot = sim.config.slo_ttft_s, sim.config.slo_tpot_s
    r = sim.reqs
    r[0].arrival_s = 0.0  # still waiting past the TTFT target at t = ttft + 1
    r[1].arrival_s, r[1].first_token_s = 0.0, ttft + 0.5  # first token too late
    r[2].arrival_s, r[2].first_token_s = 0.0, 0.1  # in time, still decoding
    r[3].arrival_s, r[3].first_token_s = 0.0, 0.1
    r[3].finish_s = 0.1 + (r[3].output - 1) * tpot * 2 + (0 if r[3].output > 1 else 1)  # too slow
    r[4].error = "shed: cluster past capacity"  # admission control: a miss
    r[5].error = "input + output exceed the model's context window"  # a rejection: out of the denominator
    r[6].arrival_s = 0.0  # waiting, within the target at t = ttft - 1
    n = len(r)
    early = bound(ttft - 1.0)
    misses_early = 2 + (1 if r[3].output > 1 else 0)  # r1 and r4, and r3 if it decodes
    assert early == pytest.approx((n - 1 - misses_early) / (n - 1))
    later = bound(ttft + 1.0)  # r0 and r6 have now waited past the target
    assert later == pytest.approx((n - 1 - misses_early - 2) / (n - 1))


def test_capacity_search_with_an_early_stopping_probe_gives_the_same_answer() -> None:
    def share(load: float) -> float:
        return 1.0 - load / 13.0  # 90 % at 1.3

    def share_below(load: float, threshold: float) -> tuple[float, bool]:
        s = share(load)
        return (min(s, threshold - 0.05), True) if s < threshold else (s, False)

    plain = capacity_search(share, relative_fallback=False, start_load=1.0, step=1.25)
    early = capacity_search(
        share, relative_fallback=False, start_load=1.0, step=1.25, share_below=share_below
    )
    for key in ("load", "fail_load", "bracketed", "threshold", "usable"):
        assert early[key] == plain[key]
    assert [x for x, _ in early["probes"]] == [x for x, _ in plain["probes"]]
    assert early["stopped_early"] == [x for x, s in plain["probes"] if s < 0.9] and early["stopped_early"]
    assert plain["stopped_early"] == []


def test_the_relative_fallback_probes_exactly_before_it_knows_its_threshold() -> None:
    asked: list[tuple[float, float | None]] = []

    def plateau(load: float) -> float:  # 80 % even when idle: the rule becomes 72 %
        asked.append((load, None))
        return 0.8 if load <= 0.25 else 0.5

    def share_below(load: float, threshold: float) -> tuple[float, bool]:
        asked.append((load, threshold))
        s = plateau(load)
        asked.pop()
        return (0.0, True) if s < threshold else (s, False)

    found = capacity_search(plateau, share_below=share_below)
    assert asked[:2] == [(1.0, None), (IDLE_LOAD, None)]  # exact: the idle share sets the rule
    assert found["idle_share"] == pytest.approx(0.8) and found["threshold"] == pytest.approx(0.72)
    assert all(t == pytest.approx(0.72) for _, t in asked[2:])
    assert 1.0 not in found["stopped_early"]  # the exact start probe is reused, not stopped


@pytest.mark.parametrize(
    ("policy", "start", "step"), [("static", 1.0, 2.0), ("heuristic", 1.0, 1.25)], ids=["static", "heuristic"]
)
def test_a_capacity_job_finds_the_same_capacity_with_early_stops(
    policy: str, start: float, step: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    point = Point(policy=policy, trace="mooncake", max_requests=200)
    artifact = compare.resolve_artifact(compare.GridSpec(), point.model) if policy != "static" else None
    job = CapacityJob(point, 0.9, False, start, step, artifact)
    early = capacity_job(job)
    original = compare.capacity_search

    def without_stops(*args: object, share_below: object = None, **kwargs: object) -> dict[str, object]:
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compare, "capacity_search", without_stops)
    plain = capacity_job(job)
    assert early["error"] is None and plain["error"] is None
    for key in ("load", "fail_load", "bracketed", "threshold", "itl_p99_s"):
        assert early[key] == plain[key]
    assert [x for x, _ in early["probes"]] == [x for x, _ in plain["probes"]]
    shares = dict(plain["probes"])
    assert early["stopped_early"], "no probe stopped early: the test no longer exercises the stop"
    for load, share in early["probes"]:
        if load in early["stopped_early"]:
            assert shares[load] <= share < 0.9  # an upper bound, under the threshold
        else:
            assert share == shares[load]
    assert not math.isnan(early["itl_p99_s"])  # the capacity is a probe that ran to the end

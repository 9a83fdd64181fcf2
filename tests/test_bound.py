"""The fluid upper bound: per-token infima of the cost model, by hand, and no policy above it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from envs.cost_model import CostModel
from envs.request import Request, Trace
from train import bound
from train.compare import GridSpec, run_compare
from train.experiment import Point, prepare_trace, run_point

COST_MODELS = [
    ("H200", "gpt-oss-120b", 1, 1, 1),
    ("H200", "glm-5", 8, 1, 1),
    ("H200", "glm-5", 8, 8, 8),  # expert parallel + DP attention: another MoE kernel in mixed batches
    ("H100", "llama-3.1-70b", 4, 1, 1),
]


@pytest.mark.parametrize(("gpu", "model", "tp", "ep", "dp"), COST_MODELS)
def test_every_iteration_costs_at_least_its_tokens_coefficients(
    gpu: str, model: str, tp: int, ep: int, dp: int
) -> None:
    cm = CostModel(gpu, model, tp, ep=ep, dp_attention=dp)
    co = bound.work_coefficients(cm)
    assert min(co.to_dict().values()) > 0
    rng = np.random.default_rng(0)
    for _ in range(400):
        chunks = [
            (int(rng.integers(1, 9000)), int(rng.integers(0, 100_000)))
            for _ in range(int(rng.integers(0, 3)))
        ]
        batch = int(rng.integers(0, 300)) if chunks and rng.random() < 0.5 else int(rng.integers(1, 300))
        ctx = batch * int(rng.integers(0, 120_000))
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in chunks)
        lower = (
            sum(n for n, _ in chunks) * co.prefill_token_s
            + pairs * co.prefill_pair_s
            + batch * co.decode_token_s
            + ctx * co.decode_context_token_s
        )
        assert cm.iteration_time_s(chunks, batch, ctx) >= lower * (1 - 1e-12), (chunks, batch, ctx)


def test_request_work_by_hand() -> None:
    co = bound.WorkCoefficients(
        prefill_token_s=1.0, prefill_pair_s=0.01, decode_token_s=2.0, decode_context_token_s=0.1
    )
    reqs = [
        Request(0, -1, 0, 0.0, 10, 3),
        Request(1, -1, 0, 0.0, 10, 1, parent_id=0, shared_prefix_tokens=10),  # all cached: one token left
    ]
    prefill, decode = bound.request_work(Trace("t", reqs), co)
    # request 0: u=10, c=0: 10 + 55 * 0.01; decode 2 steps at contexts 10 and 11
    assert prefill[0] == pytest.approx(10 + 0.55)
    assert decode[0] == pytest.approx(2 * 2.0 + 0.1 * 21)
    # request 1: u=1 after c=9 cached: 1 + (9 + 1) * 0.01; one output token: no decode step
    assert (prefill[1], decode[1]) == pytest.approx((1.1, 0.0))


def _frame(rows: list[tuple[int, float, float, float, int, int]]) -> pd.DataFrame:
    cols = ["request_id", "arrival_s", "first_token_s", "finish_s", "input_tokens", "output_tokens"]
    return pd.DataFrame(rows, columns=cols)


def test_window_attribution_by_hand() -> None:
    df = _frame(
        [
            (0, 0.0, 1.0, 2.0, 100, 11),  # before the window
            (1, 5.0, 12.0, 32.0, 200, 11),  # first token in, decode half in [12, 22]
            (2, 9.0, 15.0, math.nan, 300, 5),  # never finished: prefill only
        ]
    )
    prefill, decode = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0])
    got = bound.window_served(df, (10.0, 22.0), prefill, decode)
    assert got["window_s"] == 12.0
    assert got["input_tokens_per_s"] == pytest.approx((200 + 300) / 12)
    assert got["output_tokens_per_s"] == pytest.approx((1 + 1 + 10 * 0.5) / 12)
    assert got["work_per_s"] == pytest.approx((2.0 + 3.0 + 20.0 * 0.5) / 12)
    # in service across the edges: 1 and 2 arrived before a; 1 decodes across b
    assert got["edge_work_s"] == pytest.approx(2.0 + 3.0 + 20.0)


def test_throughput_bound_and_earliest_arrivals_by_hand() -> None:
    reqs = [
        Request(0, 0, 0, 0.0, 10, 2),
        Request(1, 0, 1, 0.0, 10, 2, depends_on=0, think_time_s=4.0),
        Request(2, 0, 2, 0.0, 10, 2, depends_on=1, think_time_s=6.0),
    ]
    closed = Trace("c", reqs, closed_loop=True)
    df = _frame([(0, 3.0, 4.0, 5.0, 10, 2), (1, 9.0, 9.5, 10.0, 10, 2)])  # request 2 never released
    assert list(bound.earliest_arrivals(df, closed)) == [3.0, 7.0, 13.0]
    work = np.array([1.0, 2.0, 4.0])
    got = bound.throughput_bound(2, (2.0, 12.0), np.array([3.0, 7.0, 13.0]), work)
    assert got["work_per_s"] == pytest.approx(3.0 / 10.0) and got["binding"] == "offered"
    got = bound.throughput_bound(2, (2.0, 2.5), np.array([0.0, 0.0, 0.0]), work)
    assert got["work_per_s"] == pytest.approx(2.0) and got["binding"] == "capacity"


def _burst(n: int, prefill_s: float, spacing_s: float) -> tuple[Trace, np.ndarray, np.ndarray]:
    trace = Trace("b", [Request(i, -1, 0, i * spacing_s, 100, 1) for i in range(n)])
    return trace, np.full(n, prefill_s), np.zeros(n)


def test_capacity_bound_by_hand() -> None:
    # 20 requests at once, 1 s of prefill each, TTFT 5 s, 2 may miss: 18 s of work needs 4 workers in 5 s
    trace, prefill, decode = _burst(20, 1.0, 0.0)
    kw = {"threshold": 0.9, "slo_ttft_s": 5.0, "slo_tpot_s": 0.05}
    assert bound.fewest_workers_bound(trace, prefill, decode, **kw) == 4
    # one request alone needs 6 s of prefill: it misses at any load and uses one of the two misses
    prefill[0] = 6.0
    assert bound.fewest_workers_bound(trace, prefill, decode, **kw) == 4  # 19 - 1 = 18 s left
    prefill[1] = 6.0
    assert bound.fewest_workers_bound(trace, prefill, decode, **kw) == 4  # 18 s, no miss left
    prefill[2] = 6.0
    assert bound.fewest_workers_bound(trace, prefill, decode, **kw) is None  # 3 hopeless > 2 misses
    # arrivals 1 s apart, 1 worker: at load L request k is due at k / L + 5 with k + 1 - 2 s of work
    # done by then, so L <= k / (k - 6) for every k <= 19: the bound is 19 / 13
    trace, prefill, decode = _burst(20, 1.0, 1.0)
    cap = bound.capacity_bound(trace, prefill, decode, 1, **kw)
    assert cap == pytest.approx(19 / 13, rel=2e-3) and cap <= 19 / 13
    closed = Trace("c", trace.requests, closed_loop=True)
    assert bound.capacity_bound(closed, prefill, decode, 1, **kw) is None


class ConstantPredictor:
    """Safe prefill throughput that ignores the node state (picklable: defined at module level)."""

    def safe_prefill_tokens_per_s(self, **_: Any) -> float:
        return 20_000.0


@pytest.mark.parametrize(("trace", "n"), [("mooncake", 300), ("agent", 2)])
def test_best_case_work_never_exceeds_the_workers_busy_time(trace: str, n: int) -> None:
    for policy in ("static", "utilisation", "heuristic"):
        pt = Point(policy=policy, trace=trace, max_requests=n, load=2.0, open_loop_arrivals="poisson")
        tr = prepare_trace(pt)
        kwargs = {"predictor": ConstantPredictor()} if policy == "heuristic" else {}
        result = run_point(pt, trace=tr, **kwargs)
        cfg, m = pt.cluster(), result.metrics
        busy_s = m.duration_s * (m.prefill_utilisation * cfg.n_prefill + m.decode_utilisation * cfg.n_decode)
        served = bound.served_trace(tr, cfg)
        prefill, decode = bound.request_work(served, bound.work_coefficients(pt.cost_model()))
        done = result.requests.loc[result.requests["finish_s"].notna(), "request_id"].to_numpy()
        assert len(done) == m.n_finished > 0
        assert float(np.sum(prefill[done] + decode[done])) <= busy_s, policy


@pytest.mark.slow
def test_no_policy_exceeds_the_bound_on_a_small_grid(tmp_path: Path) -> None:
    spec = GridSpec(
        policies=("static", "utilisation", "heuristic", "hindsight-split"),
        traces=("mooncake",),
        max_requests=80,
        seeds=2,
        latency_loads=(1.0,),
        throughput_loads=(2.0, 6.0),
        gpus_needed=False,
    )
    results = run_compare(spec, tmp_path, jobs=2, predictor=ConstantPredictor())
    assert not results["failed"]
    rows = [r for r in results["points"] if r["regime"] == "throughput"]
    assert {r["policy"] for r in rows} == set(spec.policies) and len(rows) == 4 * 2 * 2
    for r in rows:
        window_s = r["steady"]["window_s"]
        served_s = r["steady"]["work_per_s"] * window_s
        assert served_s <= r["bound"]["work_per_s"] * window_s + r["steady"]["edge_work_s"] + 1e-9, r["label"]
        assert served_s <= r["bound"]["arrived_work_per_s"] * window_s + 1e-9, r["label"]
    limits = {(b["shape"], b["seed"]): b["load"] for b in results["capacity_bound"]}
    assert limits and all(v is not None for v in limits.values())
    for c in results["capacity"]:
        grid_limit = limits[("2P4D", c["point"]["seed"])]  # same GPUs: the bound holds for every split
        assert c["load"] <= grid_limit, c["name"]
    summary = results["summary"]
    for policy in spec.policies:
        assert summary[policy]["heldout"]["headline"]["capacity_bound_share"]["mean"] <= 1.0

"""Per-request records and run metrics of a simulation (what an SGLang operator looks at)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from envs.cluster_config import ClusterConfig
from envs.itl import ItlHistogram

if TYPE_CHECKING:
    from envs.simulator import Simulator


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs: Sequence[float]) -> list[float]:
    """Quantiles ``qs`` in [0, 1] of ``values`` where value i occurs ``weights[i]`` times (inverted CDF)."""
    if len(values) == 0 or weights.sum() <= 0:
        return [math.nan for _ in qs]
    order = np.argsort(values, kind="stable")
    v, cw = values[order], np.cumsum(weights[order])
    idx = np.searchsorted(cw, np.asarray(qs) * cw[-1], side="left")
    return [float(v[min(int(i), len(v) - 1)]) for i in idx]


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Quantile ``q`` in [0, 1] of ``values`` where value i occurs ``weights[i]`` times (inverted CDF)."""
    return weighted_quantiles(values, weights, [q])[0]


@dataclass(frozen=True)
class RunMetrics:
    """Run-level figures. Times in seconds, throughputs in tokens per second of simulated time."""

    n_requests: int
    n_finished: int
    n_rejected: int
    """Refused at arrival (beyond the context window with ``context_policy="reject"``, or larger than a
    worker's KV cache); they leave the SLO denominator and are reported here instead. Requests shed by
    a path policy's admission control are not counted here: they stay in the denominator as misses
    (``requests["error"]`` starts with ``envs.sim_state.SHED_ERROR_PREFIX``; ``Counters.shed``)."""
    n_rejected_context: int
    """Of ``n_rejected``: beyond the model's context window."""
    n_compacted: int
    """Requests beyond the context window that were served cut to it (``context_policy="compact"``)."""
    max_input_tokens_served: int
    """Largest prompt (after compaction) of a finished request."""
    n_dropped_empty: int
    """Requests of the trace file with zero input or zero output tokens, dropped when it was loaded
    (not in ``n_requests``)."""
    duration_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_mean_s: float
    itl_p50_s: float
    itl_p99_s: float
    """ITL quantiles (token-weighted) within ``envs.itl.QUANTILE_RELATIVE_ERROR`` (0.05 %) of exact;
    the mean is exact to the nanosecond."""
    e2e_mean_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    n_slo_met: int
    """Finished requests with TTFT <= ``slo_ttft_s`` and mean inter-token time <= ``slo_tpot_s``."""
    slo_attainment: float
    """``n_slo_met / (n_requests - n_rejected)``: unfinished requests count as misses."""
    prefix_hit_share: float
    borrowed_share: float
    fallback_share: float
    borrowed_prefill_tokens: int
    lease_granted_prefill_tokens: float
    """Prefill tokens the decode nodes' leases granted (the ledger's record, not the spender's)."""
    lease_utilisation: float
    """``borrowed_prefill_tokens / lease_granted_prefill_tokens`` (0 without grants); at most 1 because
    borrowed prefill is paid from a token bucket the same leases feed."""
    retractions: int
    prefill_utilisation: float
    decode_utilisation: float
    local_share: float = 0.0
    """Share of requests prefilled on a decode node without a lease (a path policy's ``local``)."""
    local_prefill_tokens: int = 0
    """Prompt tokens those requests computed there."""

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass
class SimResult:
    """Everything one simulation produced."""

    config: ClusterConfig
    trace_name: str
    seed: int
    metrics: RunMetrics
    requests: pd.DataFrame
    """One row per request: ids, tokens, times, path, workers, cached tokens, retractions."""
    timeline: pd.DataFrame
    """One row per minute of arrivals: offered uncached input and output tokens and their ratio,
    borrowed prefill tokens, mean lease rate."""
    nodes: pd.DataFrame
    """One row per worker: role, index, busy fraction."""
    itl_values_s: np.ndarray = field(repr=False)
    """The ITL distribution as histogram bucket midpoints (``envs.itl``: each within
    ``QUANTILE_RELATIVE_ERROR`` of every value it stands for), ascending ..."""
    itl_weights: np.ndarray = field(repr=False)
    """... and the tokens in each."""
    decisions: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """The scheduler's records, newest last: path decisions, lease transitions and task arrivals,
    each a dict whose ``kind`` says which and whose ``reason`` says why."""

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace_name,
            "seed": self.seed,
            "config": self.config.to_dict(),
            "metrics": self.metrics.to_dict(),
            "timeline": self.timeline.to_dict(orient="list"),
            "nodes": self.nodes.to_dict(orient="records"),
        }


def _offered_timeline(sim: Simulator, df: pd.DataFrame) -> pd.DataFrame:
    """Per-minute offered traffic: uncached input (with an unbounded cache) and output tokens."""
    if df.empty:
        return pd.DataFrame(
            columns=["minute", "uncached_input_tokens", "output_tokens", "uncached_to_output"]
        )
    shared = np.array([r.shared_prefix_tokens for r in sim.trace.requests], dtype=np.int64)
    uncached = np.maximum(df["input_tokens"].to_numpy() - shared[df["request_id"].to_numpy()], 0)
    minute = np.floor(df["arrival_s"].to_numpy() / 60.0).astype(np.int64)
    g = pd.DataFrame(
        {"minute": minute, "uncached_input_tokens": uncached, "output_tokens": df["output_tokens"]}
    )
    out = g.groupby("minute", as_index=False).sum()
    out["uncached_to_output"] = out["uncached_input_tokens"] / out["output_tokens"].clip(lower=1)
    if sim.node_timeline:
        nt = pd.DataFrame(
            sim.node_timeline, columns=["time_s", "node", "lease_rate", "borrowed_total", "batch"]
        ).sort_values(["node", "time_s"])
        nt["borrowed"] = nt.groupby("node")["borrowed_total"].diff().fillna(nt["borrowed_total"])
        nt["minute"] = np.floor(nt["time_s"] / 60.0).astype(np.int64)
        per_min = nt.groupby("minute").agg(
            borrowed_prefill_tokens=("borrowed", "sum"), lease_rate_tokens_per_s=("lease_rate", "mean")
        )
        # lease rate summed over nodes: mean per node per tick x nodes
        per_min["lease_rate_tokens_per_s"] *= sim.config.n_decode
        out = out.merge(per_min.reset_index(), on="minute", how="left").fillna(0.0)
    return out


def build_result(sim: Simulator) -> SimResult:
    """Collect a finished (or stopped) simulation into records and metrics."""
    from envs.sim_state import BORROWED, FALLBACK, LOCAL, PATH_NAMES, SHED_ERROR_PREFIX

    cfg = sim.config
    reqs = [r for r in sim.reqs if not math.isnan(r.arrival_s)]
    df = pd.DataFrame(
        {
            "request_id": [r.rid for r in reqs],
            "session_id": [sim.trace.requests[r.rid].session_id for r in reqs],
            "input_tokens": [r.input for r in reqs],
            "output_tokens": [r.output for r in reqs],
            "cached_tokens": [r.cached for r in reqs],
            "arrival_s": [r.arrival_s for r in reqs],
            "first_token_s": [r.first_token_s for r in reqs],
            "finish_s": [r.finish_s for r in reqs],
            "path": [PATH_NAMES[r.path] for r in reqs],
            "prefill_worker": [r.prefill_worker for r in reqs],
            "decode_worker": [r.decode_worker for r in reqs],
            "retractions": [r.retractions for r in reqs],
            "error": [r.error for r in reqs],
        }
    )
    done = df[df["finish_s"].notna()]
    ttft = (done["first_token_s"] - done["arrival_s"]).to_numpy()
    e2e = (done["finish_s"] - done["arrival_s"]).to_numpy()
    start = float(df["arrival_s"].min()) if len(df) else 0.0
    end = float(done["finish_s"].max()) if len(done) else sim.now_s
    duration = max(end - start, 1e-9)
    itl = ItlHistogram()
    for w in sim.decode:
        itl.merge(w.itl)
    itl_v, itl_w = itl.values_and_weights()
    per_req_itl = np.where(
        done["output_tokens"] > 1,
        (done["finish_s"] - done["first_token_s"]) / (done["output_tokens"] - 1).clip(lower=1),
        0.0,
    )
    slo_ok = (ttft <= cfg.slo_ttft_s) & (per_req_itl <= cfg.slo_tpot_s)
    # shed by admission control (``SHED_ERROR_PREFIX``): SLO misses, so they stay in the denominator
    shed = df["error"].str.startswith(SHED_ERROR_PREFIX)
    n_rejected = int((df["error"] != "").sum()) - int(shed.sum())
    n_eligible = len(sim.reqs) - n_rejected
    paths = np.array([r.path for r in reqs])
    borrowed_tokens = sum(w.borrowed_tokens_total for w in sim.decode)
    granted = float(sum(sim.granted_prefill_tokens()))
    compacted = sim.context_fit.n_over_window if sim.context_fit.policy == "compact" else 0
    busy_p = [w.busy_s / duration for w in sim.prefill]
    busy_d = [w.busy_ns * 1e-9 / duration for w in sim.decode]
    q = np.quantile
    itl_p50, itl_p99 = itl.quantiles_s([0.5, 0.99])
    metrics = RunMetrics(
        n_requests=len(sim.reqs),
        n_finished=len(done),
        n_rejected=n_rejected,
        n_rejected_context=sim.rejected_context,
        n_compacted=compacted,
        max_input_tokens_served=int(done["input_tokens"].max()) if len(done) else 0,
        n_dropped_empty=int(sim.trace.meta.get("dropped_empty_requests", 0)),  # type: ignore[call-overload]
        duration_s=duration,
        input_tokens_per_s=float(done["input_tokens"].sum()) / duration,
        output_tokens_per_s=float(done["output_tokens"].sum()) / duration,
        ttft_mean_s=float(ttft.mean()) if len(ttft) else math.nan,
        ttft_p50_s=float(q(ttft, 0.5)) if len(ttft) else math.nan,
        ttft_p99_s=float(q(ttft, 0.99)) if len(ttft) else math.nan,
        itl_mean_s=itl.mean_s,
        itl_p50_s=itl_p50,
        itl_p99_s=itl_p99,
        e2e_mean_s=float(e2e.mean()) if len(e2e) else math.nan,
        e2e_p50_s=float(q(e2e, 0.5)) if len(e2e) else math.nan,
        e2e_p99_s=float(q(e2e, 0.99)) if len(e2e) else math.nan,
        n_slo_met=int(slo_ok.sum()),
        slo_attainment=float(slo_ok.sum() / n_eligible) if n_eligible > 0 else math.nan,
        prefix_hit_share=float(df["cached_tokens"].sum() / max(1, df["input_tokens"].sum())),
        borrowed_share=float((paths == BORROWED).mean()) if len(paths) else 0.0,
        fallback_share=float((paths == FALLBACK).mean()) if len(paths) else 0.0,
        borrowed_prefill_tokens=int(borrowed_tokens),
        lease_granted_prefill_tokens=granted,
        lease_utilisation=float(borrowed_tokens / granted) if granted > 0 else 0.0,
        retractions=int(df["retractions"].sum()),
        prefill_utilisation=float(np.mean(busy_p)),
        decode_utilisation=float(np.mean(busy_d)),
        local_share=float((paths == LOCAL).mean()) if len(paths) else 0.0,
        local_prefill_tokens=int(sim.counters.local_prefill_tokens),
    )
    nodes = pd.DataFrame(
        [{"role": "prefill", "index": i, "busy_fraction": b} for i, b in enumerate(busy_p)]
        + [{"role": "decode", "index": i, "busy_fraction": b} for i, b in enumerate(busy_d)]
    )
    decisions = list(getattr(sim.scheduler, "records", None) or [])
    return SimResult(
        config=cfg,
        trace_name=sim.trace.name,
        seed=sim.seed,
        metrics=metrics,
        requests=df,
        timeline=_offered_timeline(sim, df),
        nodes=nodes,
        itl_values_s=itl_v,
        itl_weights=itl_w,
        decisions=decisions,
    )


class SloShareBound:
    """An upper bound on the served SLO share a running simulation will end with, from what has
    happened by time ``now_s``: ``n_slo_met / (n_requests - n_rejected)`` of ``build_result``'s
    metrics, exactly that rule. Call it with every event up to ``now_s`` processed and none after it
    (``Simulator.run_checked``).

    A request is a certain miss once it was shed, once its first token came later than the TTFT target
    or it is still waiting past that target (its first token can only come later), or once it finished
    over the TPOT target. Rejections (outside the denominator) happen at arrival in a trace replay, so
    the eligible count can only fall from ``n - rejected so far``: ``(eligible - misses) / eligible``
    with today's figures is never below the final share (the same ``int / int`` division, monotone
    when correctly rounded). A capacity search needs only whether a probe passes, so it can stop a probe
    as soon as this bound falls under the threshold (``train.compare``). Each call visits only the
    requests still undecided.
    """

    def __init__(self, sim: Simulator) -> None:
        from envs.sim_state import SHED_ERROR_PREFIX

        self._sim = sim
        self._shed_prefix = SHED_ERROR_PREFIX
        self._open = list(range(len(sim.reqs)))
        self.misses = 0
        self.rejected = 0
        self.last = 1.0
        """The bound the last call returned."""

    def __call__(self, now_s: float) -> float:
        sim, reqs, now = self._sim, self._sim.reqs, now_s
        ttft_slo, tpot_slo = sim.config.slo_ttft_s, sim.config.slo_tpot_s
        still: list[int] = []
        for rid in self._open:
            r = reqs[rid]
            if r.error:
                if r.error.startswith(self._shed_prefix):
                    self.misses += 1
                else:
                    self.rejected += 1
                continue
            a = r.arrival_s
            if a != a:  # not arrived yet
                still.append(rid)
                continue
            ft = r.first_token_s
            if ft != ft:
                if not now - a <= ttft_slo:
                    self.misses += 1
                else:
                    still.append(rid)
                continue
            if not ft - a <= ttft_slo:
                self.misses += 1
                continue
            fin = r.finish_s
            if fin != fin:
                still.append(rid)
                continue
            itl = (fin - ft) / max(r.output - 1, 1) if r.output > 1 else 0.0
            if not itl <= tpot_slo:
                self.misses += 1
            # else: met, decided
        self._open = still
        eligible = len(reqs) - self.rejected
        self.last = (eligible - self.misses) / eligible if eligible > 0 else 0.0
        return self.last

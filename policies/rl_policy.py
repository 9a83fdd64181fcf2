"""The learned (``rl``) policy: per-request path choice and lease sizing, steered by a small MLP.

Design. A path policy decides, for every arriving request, between the normal path, a lease on a
decode node (``borrow``) and refusing it (``shed``, an SLO miss); its node policies size the leases.
Here one object does both (:class:`LearnedPath`, a ``LeasePath``): every control interval (0.5 s)
its MLP reads the cluster (the traffic mix, the prefill pool's load, the decode nodes) and sets four
**knobs**; every request is then decided at arrival by the lease rule of ``policies.lease_path`` under
those knobs, with the per-request estimates it already makes (normal-path queue wait + prefill +
transfer against each lease's rate, which the interference model sets):

* ``lease_share``: share of the interference model's safe prefill headroom each lease publishes
  (``PathPolicy.plan``; never above the prediction): the lease sizing;
* ``wait_share``: the capacity test's per-request wait limit as a share of the TTFT SLO (a request
  waiting longer on the normal path may borrow);
* ``borrow_margin``: how much faster a lease must be than the normal path;
* ``shed_factor``: shed a congested request whose fastest path is estimated past this many TTFT SLOs.

Why not a network call per request: the router decides at arrival rate on its hot path, and per
request the right choice depends on what the cluster will do over the next seconds, which only the
interval-level state shows; a per-request action would also make the environment step at request
arrivals, whose count per interval varies, so steps could not be batched. The factorisation keeps
every decision per request (and its estimates exact for that request) while the learned part
chooses, per interval, how those estimates are traded off. The tuned ``heuristic`` is one fixed
point of this space (``lease_share`` 1, ``wait_share`` 0.4, margin 0.1, no shedding) and
``heuristic-shed`` another (shedding at 2); ``greedy-model`` (the ablation) is the point with no
learning at all: take whichever path the estimates say is fastest (wait share 0, margin 0, full
leases, no shedding). So what ``rl`` gains over ``greedy-model`` is what learning the trade-off gains;
what ``greedy-model`` gains over the normal path alone is what the model's estimates give.

Leases are sized by the heuristic node policy with the tuned heuristic's values
(``PolicySpec.tuned_from``), times ``lease_share``; decode always wins (the heuristic's decode
pressure rules and ITL budget stay in force whatever the knobs say, and so does the path rule's
budget on the share of mixed iterations, ``policies.lease_path`` rule 3b).

Observation (:data:`FEATURES`, each in [0, 1] before the learned normalisation): the **traffic mix**
(log of uncached input tokens : expected output tokens arriving, over the last 1 and 5 minutes),
uncached prefill work arriving against what the prefill pool computes (10 s and 60 s), the request
rate, the normal path's queue wait over the TTFT SLO (the latest request's, and the largest since
the last decision), KV occupancy (mean and largest), batch share, recent step over the TPOT SLO,
borrowed tasks and borrowed prefill queued on the decode nodes (in seconds of their leases' rate,
over the SLO), the interference model's predicted safe prefill rate, the share of nodes under decode
pressure, and the policy's own shares of borrowed and shed requests over the last 10 s. The traffic
mix and the pool's load are measured by the path policy itself from the requests it is asked about
(``PathQuery``), so neither ``NodeState`` nor the router had to carry anything new.

Artifact: ``<stem>.npz`` (layers ``w0, b0, ...``, ``obs_mean``, ``obs_var``) and ``<stem>.json``
(feature and action names, knob ranges, normalisation constants, provenance: command, seed, steps).
Evaluated with numpy only: no torch at serving time.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from policies.catalog import CROSSFLOW_SOURCE, PolicySpec, register_policy
from policies.context import ClusterView, CostEstimator, PolicyContext
from policies.lease_path import (
    DEFAULT_BORROW_MARGIN,
    DEFAULT_MIXED_SHARE_BUDGET,
    DEFAULT_MIXED_SHARE_RESCUE,
    DEFAULT_PREFIX_REUSE_SHARE,
    DEFAULT_SHED_TTFT_FACTOR,
    DEFAULT_TTFT_SHARE,
    DecayedSum,
    LeasePath,
    prefill_pool_tokens_per_s,
)
from policies.ledger import LeaseLedger
from policies.node_policies import HeuristicPolicy, SafePrefillPredictor, decode_pressure_reason, predict_safe
from policies.node_state import NodeState
from policies.path import PathDecision, PathQuery, register_path_policy

ARTIFACT_FORMAT = "crossflow-rl-policy/2"
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "data" / "rl_policy.npz"
"""The shipped trained policy (metadata next to it as ``rl_policy.json``)."""
ARTIFACT_PARAM = "path.artifact"
"""The dotted policy parameter that names the weights a policy runs (``crossflow simulate --rl-policy``)."""

FEATURES: tuple[str, ...] = (
    "log_mix_60s",
    "log_mix_300s",
    "arrival_over_pool_10s",
    "arrival_over_pool_60s",
    "log_request_rate_60s",
    "queue_wait_over_slo",
    "queue_wait_max_over_slo",
    "kv_occupancy_mean",
    "kv_occupancy_max",
    "batch_share_mean",
    "step_over_tpot_mean",
    "borrowed_tasks_mean",
    "borrowed_queue_over_slo",
    "log_safe_prefill_mean",
    "decode_pressure_share",
    "borrow_share_10s",
    "shed_share_10s",
)
"""Observation features (see the module docstring and :meth:`LearnedPath.features`)."""

ACTIONS: tuple[str, ...] = ("lease_share", "wait_share", "borrow_margin", "shed_factor")


@dataclass(frozen=True, slots=True)
class KnobRanges:
    """What each action in [-1, 1] maps to (linearly): ``lo + (hi - lo) x (a + 1) / 2``."""

    lease_share: tuple[float, float] = (0.25, 1.0)
    wait_share: tuple[float, float] = (0.0, 1.0)
    borrow_margin: tuple[float, float] = (0.0, 0.5)
    shed_factor: tuple[float, float] = (1.0, 5.0)

    def to_dict(self) -> dict[str, list[float]]:
        return {name: list(getattr(self, name)) for name in ACTIONS}


KNOB_RANGES = KnobRanges()


@dataclass(frozen=True, slots=True)
class Knobs:
    """One interval's setting of the per-request rule (module docstring); ``shed_factor`` None: no
    shedding."""

    lease_share: float
    wait_share: float
    borrow_margin: float
    shed_factor: float | None

    def __post_init__(self) -> None:
        if not 0.0 <= self.lease_share <= 1.0 or self.wait_share < 0 or not 0 <= self.borrow_margin < 1:
            raise ValueError(f"Knobs out of range: {self}")
        if self.shed_factor is not None and self.shed_factor < 1.0:
            raise ValueError(f"Knobs.shed_factor must be >= 1 or None, got {self.shed_factor!r}")

    def to_action(self) -> np.ndarray:
        """The action in [-1, 1]^4 that maps to these knobs (no shedding maps to the top of its range)."""
        values = (
            self.lease_share,
            self.wait_share,
            self.borrow_margin,
            KNOB_RANGES.shed_factor[1] if self.shed_factor is None else self.shed_factor,
        )
        out = []
        for name, v in zip(ACTIONS, values, strict=True):
            lo, hi = getattr(KNOB_RANGES, name)
            out.append(float(np.clip(2.0 * (v - lo) / (hi - lo) - 1.0, -1.0, 1.0)))
        return np.array(out, dtype=np.float32)


HEURISTIC_KNOBS = Knobs(
    lease_share=1.0, wait_share=DEFAULT_TTFT_SHARE, borrow_margin=DEFAULT_BORROW_MARGIN, shed_factor=None
)
"""The ``heuristic``'s rule (``policies.lease_path`` defaults); the knobs of the environment's warm-up."""
SHED_KNOBS = Knobs(
    lease_share=1.0,
    wait_share=DEFAULT_TTFT_SHARE,
    borrow_margin=DEFAULT_BORROW_MARGIN,
    shed_factor=DEFAULT_SHED_TTFT_FACTOR,
)
"""``heuristic-shed``'s rule: the heuristic's, shedding past twice the TTFT SLO."""
GREEDY_KNOBS = Knobs(lease_share=1.0, wait_share=0.0, borrow_margin=0.0, shed_factor=None)
"""``greedy-model``: whichever path the estimates say is fastest, leases at the full prediction."""


def action_to_knobs(action: np.ndarray) -> Knobs:
    """Map an action in ``[-1, 1]^4`` (clipped) to :class:`Knobs`."""
    a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
    if a.shape != (len(ACTIONS),) or not np.isfinite(a).all():
        raise ValueError(f"action must be {len(ACTIONS)} finite numbers, got {action!r}")
    v = {}
    for i, name in enumerate(ACTIONS):
        lo, hi = getattr(KNOB_RANGES, name)
        v[name] = float(lo + (hi - lo) * (a[i] + 1.0) / 2.0)
    return Knobs(v["lease_share"], v["wait_share"], min(v["borrow_margin"], 0.99), v["shed_factor"])


def _unit(x: float) -> float:
    return 0.0 if not x > 0.0 else (1.0 if x > 1.0 else x)


_LOG_MIX_LO, _LOG_MIX_SPAN = -3.0, 10.0
"""log(uncached input : output) is mapped from [-3, 7] to [0, 1] (Mooncake is about 3, chat about 0)."""
_LOG_RATE = math.log1p(256.0)
_PRESSURE: dict[str, float] = {
    f.name: float(f.default)  # type: ignore[arg-type]
    for f in fields(HeuristicPolicy)
    if f.name in ("kv_high_watermark", "batch_high_fraction")
}
"""The heuristic's decode-pressure thresholds (its defaults), for the ``decode_pressure_share`` feature."""
_LOG_SAFE = math.log1p(131_072.0)


@dataclass(frozen=True)
class MlpWeights:
    """A tanh MLP plus the observation normalisation it was trained with (the deterministic actor)."""

    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    """``(W, b)`` per layer, ``W`` shaped ``(out, in)`` like ``torch.nn.Linear``; tanh between layers."""
    obs_mean: np.ndarray
    obs_var: np.ndarray
    clip_obs: float = 10.0
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        n_in = len(self.obs_mean)
        for i, (w, b) in enumerate(self.layers):
            if w.ndim != 2 or b.shape != (w.shape[0],) or w.shape[1] != n_in:
                raise ValueError(
                    f"layer {i}: weight {w.shape} / bias {b.shape} do not chain from {n_in} inputs"
                )
            n_in = w.shape[0]
        if (
            n_in != len(ACTIONS)
            or self.obs_var.shape != self.obs_mean.shape
            or len(self.obs_mean) != len(FEATURES)
        ):
            raise ValueError(
                f"MLP must map {len(FEATURES)} features to {len(ACTIONS)} actions; it maps "
                f"{len(self.obs_mean)} to {n_in}"
            )

    def normalise(self, obs: np.ndarray) -> np.ndarray:
        z = (obs - self.obs_mean) / np.sqrt(self.obs_var + self.epsilon)
        return np.clip(z, -self.clip_obs, self.clip_obs)

    def forward(self, obs: np.ndarray) -> np.ndarray:
        """Deterministic action (the Gaussian mean) for raw observations, ``(n, features)`` or one row."""
        h = self.normalise(np.asarray(obs, dtype=np.float64))
        last = len(self.layers) - 1
        for i, (w, b) in enumerate(self.layers):
            h = h @ w.T + b
            if i < last:
                h = np.tanh(h)
        return h


def save_artifact(path: str | Path, weights: MlpWeights, metadata: dict[str, Any]) -> Path:
    """Write ``<stem>.npz`` and ``<stem>.json`` atomically (temp files, then rename); returns the .npz."""
    npz = Path(path).with_suffix(".npz")
    npz.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"obs_mean": weights.obs_mean, "obs_var": weights.obs_var}
    for i, (w, b) in enumerate(weights.layers):
        arrays[f"w{i}"], arrays[f"b{i}"] = w, b
    meta = {
        **metadata,
        "format": ARTIFACT_FORMAT,
        "features": list(FEATURES),
        "actions": list(ACTIONS),
        "knob_ranges": KNOB_RANGES.to_dict(),
        "n_layers": len(weights.layers),
        "clip_obs": weights.clip_obs,
        "epsilon": weights.epsilon,
    }
    tmp_npz = npz.with_name(f".{npz.name}.tmp.npz")
    with open(tmp_npz, "wb") as fh:
        np.savez(fh, **{k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()})  # type: ignore[arg-type]
    meta_path = npz.with_suffix(".json")
    tmp_meta = meta_path.with_name(f".{meta_path.name}.tmp")
    tmp_meta.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    tmp_npz.replace(npz)
    tmp_meta.replace(meta_path)
    return npz


def load_artifact(path: str | Path) -> tuple[MlpWeights, dict[str, Any]]:
    """Read an artifact written by :func:`save_artifact`; errors name the file and the field."""
    npz = Path(path).with_suffix(".npz")
    meta_path = npz.with_suffix(".json")
    if not npz.is_file() or not meta_path.is_file():
        raise FileNotFoundError(f"RL policy artifact needs {npz} and {meta_path}")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{meta_path}: line {exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(meta, dict) or meta.get("format") != ARTIFACT_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{meta_path}: field 'format' is {found!r}, expected {ARTIFACT_FORMAT!r}")
    for key, expected in (
        ("features", list(FEATURES)),
        ("actions", list(ACTIONS)),
        ("knob_ranges", KNOB_RANGES.to_dict()),
    ):
        if meta.get(key) != expected:
            raise ValueError(
                f"{meta_path}: field {key!r} {meta.get(key)} differs from this code's {expected}"
            )
    try:
        data = np.load(npz, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{npz}: not a readable .npz weights file ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{npz}: not a .npz archive of arrays (a single array was found)")
    with data:
        try:
            layers = tuple((data[f"w{i}"], data[f"b{i}"]) for i in range(int(meta["n_layers"])))
            weights = MlpWeights(
                layers, data["obs_mean"], data["obs_var"], float(meta["clip_obs"]), float(meta["epsilon"])
            )
        except KeyError as exc:
            raise ValueError(f"{npz} / {meta_path}: missing field {exc}") from None
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{npz}: {type(exc).__name__}: {exc}") from None
    return weights, meta


class LearnedPath(LeasePath):
    """Path policy ``rl`` (and, with fixed knobs, ``greedy-model``): see the module docstring.

    Args:
        cost, cluster: timing and the SLOs (``ctx.cost``, ``ctx.cluster``).
        predictor: the interference model (for the ``log_safe_prefill_mean`` feature).
        pool_tokens_per_s: the prefill pool's rate (``prefill_pool_tokens_per_s``).
        weights: the trained actor; ``None``: the knobs stay as set (``knobs``, or ``set_action`` from
            the training environment).
        knobs: the knobs before the first interval, and for good when ``weights`` is ``None``.
        decision_intervals: the actor runs every this many control intervals (what it was trained
            with, ``decision_intervals`` in the artifact's metadata); the knobs hold in between.
        prefix_reuse_share: decode-side prefix reuse (``LeasePath``).
        mixed_share_budget, mixed_share_rescue: the mixed-iteration share budget and its rescue
            (``LeasePath``, rule 3b), on by default as in the heuristic: no knob setting lets a node's
            share of decode tokens from mixed iterations run past it.

    Every call is deterministic in its inputs and the requests seen so far.
    """

    def __init__(
        self,
        cost: CostEstimator,
        cluster: ClusterView,
        *,
        pool_tokens_per_s: float,
        predictor: SafePrefillPredictor | None = None,
        weights: MlpWeights | None = None,
        knobs: Knobs = HEURISTIC_KNOBS,
        decision_intervals: int = 1,
        prefix_reuse_share: float | None = DEFAULT_PREFIX_REUSE_SHARE,
        mixed_share_budget: float | None = DEFAULT_MIXED_SHARE_BUDGET,
        mixed_share_rescue: float | None = DEFAULT_MIXED_SHARE_RESCUE,
    ) -> None:
        super().__init__(
            cost,
            congestion="capacity",
            slo_ttft_s=cluster.slo_ttft_s,
            pool_tokens_per_s=pool_tokens_per_s,
            prefix_reuse_share=prefix_reuse_share,
            mixed_share_budget=mixed_share_budget,
            mixed_share_rescue=mixed_share_rescue,
        )
        if weights is not None and predictor is None:
            raise ValueError("LearnedPath: a trained policy needs the interference-model predictor")
        if decision_intervals < 1:
            raise ValueError(f"LearnedPath.decision_intervals must be >= 1, got {decision_intervals!r}")
        self.decision_intervals = decision_intervals
        self._intervals = 0
        self.slo_ttft_s = cluster.slo_ttft_s
        self.slo_tpot_s = cluster.slo_tpot_s
        self.predictor = predictor
        self.weights = weights
        self._mix = {tau: (DecayedSum(tau), DecayedSum(tau)) for tau in (60.0, 300.0)}
        self._work = {tau: DecayedSum(tau) for tau in (10.0, 60.0)}
        self._arrivals = DecayedSum(60.0)
        self._decided = DecayedSum(10.0)
        self._borrowed = DecayedSum(10.0)
        self._shed = DecayedSum(10.0)
        self._last_wait_s = 0.0
        self._max_wait_s = 0.0
        self.knobs = knobs
        self.set_knobs(knobs)

    # ---- knobs ------------------------------------------------------------------------------------
    def set_knobs(self, knobs: Knobs) -> None:
        """Apply ``knobs`` to the per-request rule from now on (and reset the interval's largest wait)."""
        self.knobs = knobs
        self._max_wait_s = self._last_wait_s
        self.wait_limit_s = knobs.wait_share * self.slo_ttft_s
        self.borrow_margin = knobs.borrow_margin
        self.shed_limit_s = math.inf if knobs.shed_factor is None else knobs.shed_factor * self.slo_ttft_s

    def set_action(self, action: np.ndarray) -> None:
        """Apply an action in ``[-1, 1]^4`` (:func:`action_to_knobs`)."""
        self.set_knobs(action_to_knobs(action))

    # ---- the interval --------------------------------------------------------------------------------
    def features(self, now_s: float, states: Sequence[NodeState]) -> np.ndarray:
        """The :data:`FEATURES` vector now (float32, each in [0, 1])."""
        mix = []
        for inp, out in self._mix.values():
            i, o = inp.value(now_s), out.value(now_s)
            ratio = math.log((i + 1.0) / (o + 1.0)) if i + o > 0 else 0.0
            mix.append(_unit((ratio - _LOG_MIX_LO) / _LOG_MIX_SPAN))
        pool = self.pool_tokens_per_s
        n = max(len(states), 1)
        kv = [s.kv_occupancy for s in states] or [0.0]
        batch = [
            s.decode_batch_size / s.max_running_requests if s.max_running_requests else 1.0 for s in states
        ]
        safe = [predict_safe(self.predictor, s) for s in states] if self.predictor is not None else [0.0]
        queued_s = sum(s.borrowed_prefill_tokens_queued for s in states) / max(sum(safe), 1.0)
        pressure = sum(
            decode_pressure_reason(
                s,
                itl_target_s=self.slo_tpot_s,
                kv_high_watermark=_PRESSURE["kv_high_watermark"],
                batch_high_fraction=_PRESSURE["batch_high_fraction"],
            )
            is not None
            for s in states
        )
        decided = max(self._decided.value(now_s), 1e-9)
        feats = (
            *mix,
            _unit(self._work[10.0].rate(now_s) / pool / 4.0),
            _unit(self._work[60.0].rate(now_s) / pool / 4.0),
            _unit(math.log1p(self._arrivals.rate(now_s)) / _LOG_RATE),
            _unit(self._last_wait_s / self.slo_ttft_s / 4.0),
            _unit(self._max_wait_s / self.slo_ttft_s / 4.0),
            _unit(sum(kv) / len(kv)),
            _unit(max(kv)),
            _unit(sum(batch) / n),
            _unit(sum(s.recent_step_time_s for s in states) / n / self.slo_tpot_s / 2.0),
            _unit(sum(s.borrowed_tasks for s in states) / n / 8.0),
            _unit(queued_s / self.slo_ttft_s / 4.0),
            _unit(math.log1p(sum(safe) / len(safe)) / _LOG_SAFE),
            pressure / n,
            _unit(self._borrowed.value(now_s) / decided) if self._decided.value(now_s) > 0 else 0.0,
            _unit(self._shed.value(now_s) / decided) if self._decided.value(now_s) > 0 else 0.0,
        )
        return np.array(feats, dtype=np.float32)

    def plan(self, now_s: float, states: Sequence[NodeState]) -> Mapping[int, float] | None:
        """Run the actor on this interval's features (when trained) and size the leases."""
        if self.weights is not None and self._intervals % self.decision_intervals == 0:
            self.set_action(self.weights.forward(self.features(now_s, states)))
        self._intervals += 1
        share = self.knobs.lease_share
        return None if share >= 1.0 else {s.node_id: share for s in states}

    # ---- per request ---------------------------------------------------------------------------------
    def choose(self, q: PathQuery, now_s: float, ledger: LeaseLedger) -> PathDecision:
        for inp, out in self._mix.values():
            inp.add(now_s, q.normal_uncached_tokens)
            out.add(now_s, q.expected_output_tokens)
        for work in self._work.values():
            work.add(now_s, q.normal_uncached_tokens)
        self._arrivals.add(now_s, 1.0)
        self._last_wait_s = q.normal_queue_wait_s
        self._max_wait_s = max(self._max_wait_s, q.normal_queue_wait_s)
        decision = super().choose(q, now_s, ledger)
        self._decided.add(now_s, 1.0)
        if decision.path == "borrow":
            self._borrowed.add(now_s, 1.0)
        elif decision.path == "shed":
            self._shed.add(now_s, 1.0)
        return decision


def _make_learned(
    ctx: PolicyContext,
    artifact: str | Path | None = None,
    learner: bool = False,
    prefix_reuse_share: float | None = DEFAULT_PREFIX_REUSE_SHARE,
) -> LearnedPath:
    """Registry factory of path policy ``rl``: the weights at ``artifact`` (default: the shipped ones);
    ``learner=True``: no weights, the knobs are set from outside each interval (the training env)."""
    weights, meta = (None, {}) if learner else load_artifact(artifact or DEFAULT_ARTIFACT)
    return LearnedPath(
        ctx.cost,
        ctx.cluster,
        pool_tokens_per_s=prefill_pool_tokens_per_s(ctx),
        predictor=ctx.require_predictor("path policy 'rl'"),
        weights=weights,
        decision_intervals=int(meta.get("decision_intervals", 1)),
        prefix_reuse_share=prefix_reuse_share,
    )


def _make_greedy(
    ctx: PolicyContext, prefix_reuse_share: float | None = DEFAULT_PREFIX_REUSE_SHARE
) -> LearnedPath:
    return LearnedPath(
        ctx.cost,
        ctx.cluster,
        pool_tokens_per_s=prefill_pool_tokens_per_s(ctx),
        knobs=GREEDY_KNOBS,
        prefix_reuse_share=prefix_reuse_share,
    )


def runs_rl_weights(spec: PolicySpec) -> bool:
    """Whether catalog policy ``spec`` runs RL weights (so ``ARTIFACT_PARAM`` names them)."""
    return spec.path == "rl"


register_path_policy(
    "rl",
    _make_learned,
    needs_predictor=True,
    summary="the PPO-trained per-interval knobs of the lease rule (shipped artifact)",
)
register_path_policy(
    "greedy-model",
    _make_greedy,
    summary="the fastest path by the estimates (lease rates from the interference model), no learning",
)
_RL_SOURCE = CROSSFLOW_SOURCE + "; policies/rl_policy.py, docs/rl.md"
register_policy(
    PolicySpec(
        "rl",
        "Crossflow, learned: PPO sets the lease rule's wait limit, margin, shedding and lease size per "
        "interval from the traffic mix and the cluster",
        node="heuristic",
        path="rl",
        source=_RL_SOURCE,
        tuned_from="heuristic",
    )
)
register_policy(
    PolicySpec(
        "greedy-model",
        "ablation of rl: each request on the path the estimates say is fastest (interference-model leases), "
        "no learning, no shedding",
        node="heuristic",
        path="greedy-model",
        source=_RL_SOURCE,
        tuned_from="heuristic",
    )
)

__all__ = [
    "ACTIONS",
    "ARTIFACT_PARAM",
    "DEFAULT_ARTIFACT",
    "FEATURES",
    "GREEDY_KNOBS",
    "HEURISTIC_KNOBS",
    "KNOB_RANGES",
    "SHED_KNOBS",
    "DecayedSum",
    "Knobs",
    "LearnedPath",
    "MlpWeights",
    "action_to_knobs",
    "load_artifact",
    "runs_rl_weights",
    "save_artifact",
]

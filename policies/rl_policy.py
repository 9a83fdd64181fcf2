"""The learned (``rl``) node policy: a small MLP exported from PPO, evaluated with numpy only.

The policy acts per decode node from the same ``NodeState`` every other node policy sees, plus the
interference model's safe-prefill-throughput prediction at that state. Its two actions, each in
``[-1, 1]`` (PPO's Gaussian head works best on a symmetric box), map to:

* ``compute_scale``: share of the predicted safe prefill throughput to lend, in ``[0, max_scale]``
  (``max_scale`` is 1 with the shield on: never lend above the interference model's prediction);
* ``task_share``: how many borrowed tasks the lease admits, ``round(task_share x max_tasks)``. Every
  borrowed request keeps decoding on the lending node afterwards, so this is the knob on future
  decode work and KV that the prediction alone does not cover.

Budgets are then built by :func:`lease_budgets` with the heuristic's KV and task arithmetic, and the
shield forces a zero lease under decode pressure (decode always wins). The environment
(``envs.rl_env``) calls the same :func:`observe` and :func:`lease_budgets`, so the trained policy and
the deployed one take identical decisions for identical states.

Artifact: ``<stem>.npz`` (layer weights ``w0, b0, w1, b1, ...``, observation ``obs_mean``,
``obs_var``) and ``<stem>.json`` (metadata: feature names, action semantics, ``ttl_s``,
``max_tasks``, ``shield``, ``itl_target_s``, normalisation constants, and provenance: the command,
seed and steps that produced it). No torch needed to load or run it.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.catalog import CROSSFLOW_SOURCE, PolicySpec, register_policy
from policies.context import PolicyContext
from policies.lease import LeaseBudgets
from policies.node_policies import (
    SafePrefillPredictor,
    decode_pressure_reason,
    headroom_budgets,
    node_policy_names,
    predict_safe,
    register_node_policy,
)
from policies.node_state import NodeState
from policies.slo import DEFAULT_TPOT_SLO_S

ARTIFACT_FORMAT = "crossflow-rl-policy/1"
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "data" / "rl_policy.npz"
"""The shipped trained policy (metadata next to it as ``rl_policy.json``)."""

FEATURES: tuple[str, ...] = (
    "batch_share",
    "log_context_mean",
    "log_context_std",
    "log_remaining_output",
    "kv_occupancy",
    "kv_reserved_share",
    "kv_free_share",
    "queued_decode",
    "borrowed_tasks",
    "log_borrowed_prefill_queued",
    "recent_step_over_itl",
    "decode_only_step_over_itl",
    "log_safe_prefill",
    "decode_pressure",
)
"""Observation features, each in [0, 1] before the learned normalisation (see :func:`observe`)."""

N_ACTIONS = 2

_LOG_CONTEXT = math.log1p(262_144.0)
_LOG_OUTPUT = math.log1p(16_384.0)
_LOG_QUEUED = math.log1p(1_048_576.0)
_LOG_SAFE = math.log1p(131_072.0)


@dataclass(frozen=True, slots=True)
class LeaseShape:
    """The fixed (not learned) parameters that turn actions into budgets; stored in the artifact."""

    itl_target_s: float = DEFAULT_TPOT_SLO_S
    """Per-token latency target; decode pressure when the recent step exceeds it."""
    ttl_s: float = 8.0
    """Lease TTL. The scheduler reads ``policy.ttl_s`` as a constant and republishes every control
    interval, so the TTL is a policy parameter, not an action (a per-proposal TTL would need hidden
    state). A longer TTL makes the prefill budget (rate x TTL) large enough for long agent prompts."""
    max_tasks: int = 8
    shield: bool = True
    """On: lend at most the predicted safe throughput and force zero under decode pressure."""
    unshielded_max_scale: float = 2.0
    """Largest ``compute_scale`` when the shield is off."""
    kv_high_watermark: float = 0.9
    batch_high_fraction: float = 0.9
    decode_tokens_per_task: int = 8192
    transfer_tokens_per_s: float = 262_144.0

    def __post_init__(self) -> None:
        if not (self.itl_target_s > 0 and self.ttl_s > 0 and self.unshielded_max_scale > 0):
            raise ValueError("LeaseShape: itl_target_s, ttl_s and unshielded_max_scale must be > 0")
        if self.max_tasks < 1:
            raise ValueError(f"LeaseShape.max_tasks must be >= 1, got {self.max_tasks}")
        for name in ("kv_high_watermark", "batch_high_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"LeaseShape.{name} must be in [0, 1], got {getattr(self, name)!r}")

    @property
    def max_scale(self) -> float:
        return 1.0 if self.shield else self.unshielded_max_scale

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "lease shape") -> LeaseShape:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{source}: unknown lease_shape field(s) {sorted(unknown)}")
        return cls(**values)


def decode_pressure(state: NodeState, shape: LeaseShape) -> str | None:
    """Why decode needs the whole node now (the heuristic's rules), or ``None``."""
    return decode_pressure_reason(
        state,
        itl_target_s=shape.itl_target_s,
        kv_high_watermark=shape.kv_high_watermark,
        batch_high_fraction=shape.batch_high_fraction,
    )


def _unit(x: float) -> float:
    return 0.0 if x < 0.0 else (1.0 if x > 1.0 else x)


def observe(state: NodeState, safe_tokens_per_s: float, shape: LeaseShape) -> np.ndarray:
    """The ``FEATURES`` vector of one node (float32, each in [0, 1]); logs squash heavy tails."""
    cap = state.kv_capacity_tokens or 1
    itl = shape.itl_target_s
    return np.array(
        (
            _unit(
                state.decode_batch_size / state.max_running_requests if state.max_running_requests else 1.0
            ),
            _unit(math.log1p(max(state.context_tokens_mean, 0.0)) / _LOG_CONTEXT),
            _unit(math.log1p(max(state.context_tokens_std, 0.0)) / _LOG_CONTEXT),
            _unit(math.log1p(max(state.remaining_output_tokens_mean, 0.0)) / _LOG_OUTPUT),
            _unit(state.kv_occupancy),
            _unit(state.kv_reserved_tokens / cap),
            _unit(state.kv_free_tokens / cap),
            _unit(state.queued_decode_requests / 8.0),
            _unit(state.borrowed_tasks / 8.0),
            _unit(math.log1p(max(state.borrowed_prefill_tokens_queued, 0)) / _LOG_QUEUED),
            _unit(state.recent_step_time_s / itl / 2.0),
            _unit(state.decode_only_step_time_s / itl / 2.0),
            _unit(math.log1p(safe_tokens_per_s) / _LOG_SAFE),
            1.0 if decode_pressure(state, shape) is not None else 0.0,
        ),
        dtype=np.float32,
    )


def action_to_controls(action: np.ndarray, shape: LeaseShape) -> tuple[float, int]:
    """Map an action in ``[-1, 1]^2`` (clipped) to ``(compute_scale, tasks_cap)``."""
    a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
    if a.shape != (N_ACTIONS,) or not np.isfinite(a).all():
        raise ValueError(f"action must be {N_ACTIONS} finite numbers, got {action!r}")
    compute_scale = (a[0] + 1.0) / 2.0 * shape.max_scale
    tasks_cap = round((a[1] + 1.0) / 2.0 * shape.max_tasks)
    return float(compute_scale), int(tasks_cap)


def lease_budgets(
    state: NodeState, safe_tokens_per_s: float, compute_scale: float, tasks_cap: int, shape: LeaseShape
) -> LeaseBudgets:
    """New headroom for ``state`` (the ``NodePolicy.propose`` contract) from the two controls.

    Same arithmetic as ``HeuristicPolicy`` with ``margin = compute_scale`` and ``max_tasks = tasks_cap``;
    with the shield on, ``compute_scale`` is capped at 1 and any decode pressure gives zero.
    """
    if shape.shield:
        compute_scale = min(compute_scale, 1.0)
        if decode_pressure(state, shape) is not None:
            return LeaseBudgets.zero()
    return headroom_budgets(
        state,
        safe_tokens_per_s,
        share=compute_scale,
        max_tasks=tasks_cap,
        ttl_s=shape.ttl_s,
        kv_high_watermark=shape.kv_high_watermark,
        transfer_tokens_per_s=shape.transfer_tokens_per_s,
        decode_tokens_per_task=shape.decode_tokens_per_task,
    )


@dataclass(frozen=True)
class MlpWeights:
    """A tanh MLP (SB3's default PPO actor) plus the observation normalisation it was trained with."""

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
        if n_in != N_ACTIONS or self.obs_var.shape != self.obs_mean.shape:
            raise ValueError(
                f"MLP must map {len(self.obs_mean)} features to {N_ACTIONS} actions, ends at {n_in}"
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
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ValueError(
            f"{meta_path}: field 'format' is {meta.get('format')!r}, expected {ARTIFACT_FORMAT!r}"
        )
    if meta.get("features") != list(FEATURES):
        raise ValueError(
            f"{meta_path}: field 'features' {meta.get('features')} differs from this code's {FEATURES}"
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


@dataclass(frozen=True)
class RLPolicy:
    """Node policy ``rl``: ``propose(state)`` runs the exported MLP on ``observe(state)``.

    Pure function of the state (deterministic action, no hidden state), like every node policy.
    Build it with :meth:`load` (or ``make_node_policy("rl", ctx, artifact=path)``).
    """

    predictor: SafePrefillPredictor
    weights: MlpWeights
    shape: LeaseShape = field(default_factory=LeaseShape)
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        predictor: SafePrefillPredictor,
        artifact: str | Path | None = None,
        *,
        shield: bool | None = None,
        itl_target_s: float | None = None,
    ) -> RLPolicy:
        """The policy in ``artifact`` (default: the shipped one); ``shield``/``itl_target_s`` override it."""
        weights, meta = load_artifact(artifact or DEFAULT_ARTIFACT)
        shape_dict = dict(meta.get("lease_shape", {}))
        if shield is not None:
            shape_dict["shield"] = shield
        if itl_target_s is not None:
            shape_dict["itl_target_s"] = itl_target_s
        shape = LeaseShape.from_dict(
            shape_dict, source=str(Path(artifact or DEFAULT_ARTIFACT).with_suffix(".json"))
        )
        return cls(predictor, weights, shape, meta)

    @property
    def ttl_s(self) -> float:
        return self.shape.ttl_s

    def act(self, state: NodeState) -> tuple[np.ndarray, float]:
        """``(action, safe_tokens_per_s)`` for ``state`` (exposed for decision records and tests)."""
        safe = predict_safe(self.predictor, state)
        return self.weights.forward(observe(state, safe, self.shape)), safe

    def decode_pressure(self, state: NodeState) -> str | None:
        return decode_pressure(state, self.shape) if self.shape.shield else None

    def propose(self, state: NodeState) -> LeaseBudgets:
        if self.shape.shield and decode_pressure(state, self.shape) is not None:
            return LeaseBudgets.zero()  # skip the forward pass: the shield decides
        action, safe = self.act(state)
        compute_scale, tasks_cap = action_to_controls(action, self.shape)
        return lease_budgets(state, safe, compute_scale, tasks_cap, self.shape)


def make_rl_policy(
    ctx: PolicyContext,
    artifact: str | Path | None = None,
    shield: bool | None = None,
    itl_target_s: float | None = None,
) -> RLPolicy:
    """Registry factory: ``make_node_policy("rl", ctx, artifact=path)`` (``ctx`` carries the predictor;
    the ITL target is the artifact's unless given)."""
    return RLPolicy.load(ctx.require_predictor("rl"), artifact, shield=shield, itl_target_s=itl_target_s)


if "rl" not in node_policy_names():
    register_node_policy(
        "rl", make_rl_policy, needs_predictor=True, summary="the PPO-trained lease policy (shipped artifact)"
    )
    register_policy(
        PolicySpec(
            "rl",
            "Crossflow, learned: leases sized by the PPO policy, borrowed on congestion when faster",
            node="rl",
            path="lease",
            grid={
                "path.congestion_wait_s": (0.2, 1.0),
                "path.borrow_margin": (0.1, 0.3),
                "scheduler.itl_guard": (1.25, None),
            },
            source=CROSSFLOW_SOURCE + "; policies/rl_policy.py, docs/rl.md",
        )
    )

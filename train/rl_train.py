"""PPO training of the ``rl`` policy on ``envs.rl_env.PathLeaseEnv`` (``train.ppo``).

One entry point, :func:`train`, used by ``crossflow train-rl``. It builds ``n_envs`` environments
on the **development** side of the trace (``envs.splits``; held-out sessions or minutes are never
simulated here: ``crossflow compare --splits heldout`` reports on them), trains PPO with checkpoints,
scores the current policy every ``eval_every`` steps on fixed validation windows of the development
side against the baselines (``static``, ``heuristic``, ``heuristic-shed``, ``greedy-model`` and the
best tuned peer, ``dynamo-load``), exports the policy that validated best for the numpy-only
``policies.rl_policy.LearnedPath``, and logs the training curves, every evaluation and the exported
policy to W&B (offline unless the user set ``WANDB_MODE``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from envs.rl_env import EnvConfig, PathLeaseEnv, Window, draw_windows
from policies.catalog import tuned_params
from policies.node_policies import SafePrefillPredictor
from policies.rl_policy import (
    ACTIONS,
    ARTIFACT_PARAM,
    FEATURES,
    HEURISTIC_KNOBS,
    SHED_KNOBS,
    Knobs,
    MlpWeights,
    action_to_knobs,
    load_artifact,
    save_artifact,
)
from train.jsonio import write_json
from train.ppo_config import PPOConfig

BASELINES: tuple[str, ...] = ("static", "heuristic", "heuristic-shed", "greedy-model", "dynamo-load")
"""What the learned policy is scored against: no lending, Crossflow's rule (without and with
shedding), the ablation (the model's estimates, greedy, no learning), and the best tuned peer on
Mooncake among those that do not borrow leases (``policies/data/tuned_policies.json``)."""
STARTS: dict[str, Knobs] = {"heuristic": HEURISTIC_KNOBS, "heuristic-shed": SHED_KNOBS}
"""Where the untrained actor's mean starts (``TrainConfig.start``)."""
VALIDATION_SEED = 4321
"""Seed of the validation windows (development side; the training windows come from ``seed``)."""


@dataclass(frozen=True)
class ConstantPredictor:
    """A predictor that always answers ``tokens_per_s`` (smoke tests and debugging only)."""

    tokens_per_s: float

    def safe_prefill_tokens_per_s(
        self,
        decode_batch_size: float,
        context_tokens_mean: float,
        context_tokens_std: float,
        remaining_output_tokens_mean: float,
        kv_occupancy: float,
        remaining_output_tokens_max: float | None = None,
        remaining_output_tokens_context_weighted: float | None = None,
    ) -> float:
        return self.tokens_per_s


def load_predictor_spec(spec: str | None, gpu: str, model: str, tp: int) -> SafePrefillPredictor:
    """``None``: the shipped interference model; ``constant:N``: :class:`ConstantPredictor`;
    otherwise an interference-model artifact folder."""
    if spec is None:
        from interference_model.artifact import default_predictor

        return default_predictor(gpu, model, tp)
    if spec.startswith("constant:"):
        try:
            return ConstantPredictor(float(spec.split(":", 1)[1]))
        except ValueError:
            raise ValueError(f"--predictor {spec!r}: expected constant:<tokens per second>") from None
    from interference_model.artifact import load_predictor

    return load_predictor(spec, gpu=gpu, model=model, tp=tp)


@dataclass
class TrainConfig:
    """Arguments of ``crossflow train-rl`` (each becomes a flag; see ``train.rl_cli``)."""

    out: str = "runs/train-rl"
    """Run folder: checkpoints, candidate policies, the exported policy, eval.json, W&B files."""
    total_steps: int = 20_000
    """Agent steps (one per environment per decision) in total, including any resumed ones."""
    n_envs: int = 4
    processes: bool = True
    """Step the environments in subprocesses (one each) rather than in turn in this process."""
    seed: int = 0
    resume: str | None = None
    """Checkpoint (.pt) to continue from."""
    predictor: str | None = None
    """Interference model: artifact folder, ``constant:N``, or None for the shipped one."""
    export: str | None = None
    """Also copy the exported policy (.npz + .json) here."""
    eval_every: int = 5_000
    eval_windows: int = 3
    """Validation windows (development side, seed ``VALIDATION_SEED``; loads low, middle, high)."""
    baselines: tuple[str, ...] = BASELINES
    ppo: PPOConfig = field(
        default_factory=lambda: PPOConfig(
            n_steps=64,
            n_epochs=10,
            batch_size=64,
            learning_rate=3e-4,
            gamma=0.9,
            gae_lambda=0.9,
            log_std_init=-0.7,
        )
    )
    """PPO's hyperparameters (``init_action`` None: the knobs of ``start``)."""
    start: str = "heuristic-shed"
    """The rule the untrained actor's mean starts at (``STARTS``): PPO learns state-dependent
    departures from one of Crossflow's fixed rules rather than starting from the middle of the box."""
    wandb: bool = True
    progress: bool = True
    command: str = ""
    """The command line that started this run (recorded in the exported metadata)."""
    env: EnvConfig = field(default_factory=EnvConfig)


def _make_env(config: EnvConfig, predictor_spec: str | None) -> Any:
    def build() -> PathLeaseEnv:
        cluster = config.cluster()
        predictor = load_predictor_spec(predictor_spec, cluster.gpu, cluster.model, cluster.tp)
        return PathLeaseEnv(config, predictor=predictor, side="dev")

    return build


def _library_versions() -> dict[str, str]:
    import gymnasium
    import torch

    return {"torch": torch.__version__, "gymnasium": gymnasium.__version__}


def evaluate(
    env: PathLeaseEnv,
    windows: Sequence[Window],
    policies: dict[str, dict[str, Any] | None],
) -> list[dict[str, Any]]:
    """One row per (policy, window): :meth:`PathLeaseEnv.run_policy`'s figures plus the window.
    ``policies``: catalog name -> dotted parameters (None: its shipped tuned values)."""
    rows = []
    for name, params in policies.items():
        for i, window in enumerate(windows):
            rows.append(
                {"policy": name, "window": i, "load": window.load, **env.run_policy(window, name, params)}
            )
    return rows


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy: the mean of each figure over windows (NaN-aware)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["policy"], []).append(row)
    return {
        name: {k: float(np.nanmean([r[k] for r in items])) for k in items[0] if k not in ("policy", "window")}
        for name, items in by.items()
    }


def decision_statistics(env: PathLeaseEnv, windows: Sequence[Window], weights: MlpWeights) -> dict[str, Any]:
    """What the policy decides on ``windows`` (replayed through ``env``'s steps): each knob's mean,
    range and correlation with each observed feature."""
    obs_rows, knob_rows = [], []
    for window in windows:
        obs, _ = env.reset(options={"window": window})
        done = False
        while not done:
            action = weights.forward(obs)
            knobs = action_to_knobs(action)
            obs_rows.append(obs)
            knob_rows.append([getattr(knobs, k) for k in ACTIONS])
            obs, _, terminated, truncated, _ = env.step(action.astype(np.float32))
            done = terminated or truncated
    X, K = np.array(obs_rows), np.array(knob_rows)
    out: dict[str, Any] = {"decisions": len(K)}
    for j, name in enumerate(ACTIONS):
        col = K[:, j]
        corr = {}
        for i, feat in enumerate(FEATURES):
            if X[:, i].std() > 0 and col.std() > 0:
                corr[feat] = float(np.corrcoef(X[:, i], col)[0, 1])
        top = sorted(corr.items(), key=lambda kv: -abs(kv[1]))[:4]
        out[name] = {
            "mean": float(col.mean()),
            "min": float(col.min()),
            "max": float(col.max()),
            "top_correlations": dict(top),
        }
    return out


def evaluate_artifact(
    env_config: EnvConfig,
    artifact: str | Path | None,
    n_windows: int,
    predictor_spec: str | None = None,
    baselines: Sequence[str] = BASELINES,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``rl`` (the policy at ``artifact``, default the shipped one) against ``baselines`` on the
    validation windows of ``env_config``'s development side; the per-window rows and the summary
    (plus ``rl_decisions``: :func:`decision_statistics`)."""
    from policies.rl_policy import DEFAULT_ARTIFACT

    path = Path(artifact) if artifact is not None else DEFAULT_ARTIFACT
    weights, _ = load_artifact(path)
    cluster = env_config.cluster()
    predictor = load_predictor_spec(predictor_spec, cluster.gpu, cluster.model, cluster.tp)
    env = PathLeaseEnv(env_config, predictor=predictor, side="dev")
    windows = draw_windows(env_config, n_windows, VALIDATION_SEED)
    policies: dict[str, dict[str, Any] | None] = {b: None for b in baselines}
    policies["rl"] = {**tuned_params("rl"), ARTIFACT_PARAM: str(path)}
    rows = evaluate(env, windows, policies)
    return rows, summarise(rows) | {"rl_decisions": decision_statistics(env, windows, weights)}


if TYPE_CHECKING:
    from train.ppo import PPO


class _Trainer:
    """One training run: PPO, validation windows and baseline scores, history, the best policy."""

    def __init__(self, cfg: TrainConfig) -> None:
        if cfg.total_steps < 1 or cfg.n_envs < 1:
            raise ValueError("total_steps and n_envs must be >= 1")
        if cfg.start not in STARTS:
            raise ValueError(f"start must be one of {sorted(STARTS)}, got {cfg.start!r}")
        self.cfg = cfg
        self.out = Path(cfg.out)
        for sub in ("checkpoints", "candidates"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        cluster = cfg.env.cluster()
        self.predictor = load_predictor_spec(cfg.predictor, cluster.gpu, cluster.model, cluster.tp)
        from train.ppo import PPO, make_vector_env

        factories = [_make_env(cfg.env, cfg.predictor) for _ in range(cfg.n_envs)]
        self.venv = make_vector_env(factories, processes=cfg.processes)
        self.venv.reset(seed=cfg.seed)
        ppo_cfg = cfg.ppo
        if ppo_cfg.init_action is None:
            start = tuple(float(x) for x in STARTS[cfg.start].to_action())
            ppo_cfg = dataclasses.replace(ppo_cfg, init_action=start)
        self.ppo = PPO(self.venv, ppo_cfg)
        if cfg.resume:
            import torch

            if not Path(cfg.resume).is_file():
                raise FileNotFoundError(f"--resume: no checkpoint {cfg.resume}")
            self.ppo.load_state_dict(torch.load(cfg.resume, weights_only=False))
        self.val_env = PathLeaseEnv(cfg.env, predictor=self.predictor, side="dev")
        self.windows = draw_windows(cfg.env, cfg.eval_windows, VALIDATION_SEED)
        self.baseline_rows = evaluate(self.val_env, self.windows, {b: None for b in cfg.baselines})
        self.best: tuple[float, int, MlpWeights] | None = None
        """(validation reward, steps, weights) of the best policy so far."""
        self.history: list[dict[str, Any]] = []
        """Training curves: one row per PPO update (``steps``, losses, episode returns, timings)."""
        self.evals: list[dict[str, Any]] = []
        """One row per evaluation: steps, validation reward, the summary per policy."""
        self.next_eval = self.ppo.num_timesteps + cfg.eval_every
        self.eval_s = 0.0
        """Wall time spent in evaluations during training (left out of the training speed)."""
        self.bar: Any = None

    def weights(self) -> MlpWeights:
        return MlpWeights(
            self.ppo.actor_layers(),
            self.ppo.obs_rms.mean.copy(),
            self.ppo.obs_rms.var.copy(),
            self.cfg.ppo.clip_obs,
            1e-8,
        )

    def save_checkpoint(self, steps: int) -> Path:
        import torch

        final = self.out / "checkpoints" / f"ppo_{steps}.pt"
        tmp = final.with_name(f".{final.name}.tmp")
        torch.save(self.ppo.state_dict(), tmp)
        tmp.replace(final)
        return final

    def run_eval(self, steps: int) -> dict[str, dict[str, float]]:
        """Validate the current policy (saved as ``candidates/policy_<steps>``) on the windows."""
        t0 = time.perf_counter()
        weights = self.weights()
        candidate = save_artifact(
            self.out / "candidates" / f"policy_{steps}.npz", weights, self.metadata({}, 0.0, steps)
        )
        rows = evaluate(
            self.val_env, self.windows, {"rl": {**tuned_params("rl"), ARTIFACT_PARAM: str(candidate)}}
        )
        reward = float(np.mean([r["reward"] for r in rows]))
        if self.best is None or reward > self.best[0]:
            self.best = (reward, steps, weights)
        summary = summarise(self.baseline_rows + rows)
        self.evals.append({"steps": steps, "validation_reward": reward, "summary": summary, "rows": rows})
        if self.cfg.progress:
            line = ", ".join(f"{p} {s['reward']:.1f}" for p, s in summary.items())
            print(f"eval at {steps} steps: mean validation reward {line}", flush=True)
        self.eval_s += time.perf_counter() - t0
        return summary

    def on_update(self, ppo: PPO, stats: dict[str, float]) -> None:
        steps = ppo.num_timesteps
        self.history.append({"steps": steps, **stats})
        if self.bar is not None:
            self.bar.update(steps - self.bar.n)
            if "ep_return_mean" in stats:
                self.bar.set_postfix(ep_return=f"{stats['ep_return_mean']:.1f}")
        if steps >= self.next_eval:
            self.next_eval += self.cfg.eval_every
            self.save_checkpoint(steps)
            self.run_eval(steps)

    def metadata(self, summary: dict[str, Any], train_s: float, steps: int) -> dict[str, Any]:
        cfg = self.cfg
        keep = ("command", "data_sha256", "hardware", "model", "tp", "itl_target")
        return {
            "command": cfg.command,
            "seed": cfg.seed,
            "steps": steps,
            "train_seconds": round(train_s, 1),
            "n_envs": cfg.n_envs,
            "decision_intervals": cfg.env.decision_intervals,
            "env_config": cfg.env.to_dict(),
            "node_params": {k: v for k, v in tuned_params("rl").items() if not k.startswith("path.")},
            "predictor": cfg.predictor or "shipped default",
            "predictor_metadata": {
                k: v for k, v in getattr(self.predictor, "metadata", {}).items() if k in keep
            },
            "ppo": self.ppo.cfg.to_dict(),
            "start": cfg.start,
            "libraries": _library_versions(),
            "validation_summary": summary,
        }

    def export(self, weights: MlpWeights, metadata: dict[str, Any]) -> Path:
        artifact = save_artifact(self.out / "policy.npz", weights, metadata)
        if self.cfg.export:
            target = Path(self.cfg.export).with_suffix(".npz")
            target.parent.mkdir(parents=True, exist_ok=True)
            for src, dst in (
                (artifact, target),
                (artifact.with_suffix(".json"), target.with_suffix(".json")),
            ):
                tmp = dst.with_name(f".{dst.name}.tmp")
                shutil.copyfile(src, tmp)
                tmp.replace(dst)
        return artifact

    def log_wandb(self, artifact: Path, summary: dict[str, Any]) -> None:
        from train.wandb_log import RunLog, log_runs

        history = [
            {f"train/{k}": v for k, v in row.items() if k != "steps"} | {"steps": row["steps"]}
            for row in self.history
        ]
        for ev in self.evals:
            flat = {
                f"eval/{p}/{k}": v for p, s in ev["summary"].items() for k, v in s.items() if math.isfinite(v)
            }
            history.append({"steps": ev["steps"], "eval/validation_reward": ev["validation_reward"], **flat})
        history.sort(key=lambda r: r["steps"])
        columns = [
            "steps",
            "policy",
            "window",
            "load",
            "reward",
            "goodput_per_s",
            "slo_share",
            "missed",
            "shed",
        ]
        table_rows = [[0, *(r[c] for c in columns[1:])] for r in self.baseline_rows] + [
            [ev["steps"], *(r[c] for c in columns[1:])] for ev in self.evals for r in ev["rows"]
        ]
        cfg = self.cfg
        log_runs(
            [
                RunLog(
                    name=f"train-rl-{self.out.name}-seed{cfg.seed}",
                    group="train-rl",
                    tags=["train-rl", cfg.env.trace, cfg.env.model, cfg.env.shape],
                    config={**asdict(cfg), "env": cfg.env.to_dict()},
                    summary={f"final/{p}/{k}": v for p, s in summary.items() for k, v in s.items()},
                    history=history,
                    job_type="train-rl",
                    tables={"eval/table": (columns, table_rows)},
                    output_artifact=(
                        "rl-policy",
                        "policy",
                        [str(artifact), str(artifact.with_suffix(".json"))],
                    ),
                )
            ],
            wandb_dir=self.out,
        )


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume ``cfg.resume``) to ``cfg.total_steps``, validate, export.

    The exported policy is the one with the best mean validation reward among the evaluations (the
    last one included). Returns ``{"artifact", "checkpoint", "summary", "steps", "selected_steps",
    "steps_per_s"}``: the exported policy (.npz; metadata in the .json next to it), the final
    checkpoint, the validation summary of the exported policy and the baselines, and env steps per
    second of wall time over training (updates included, evaluations not).
    """
    import torch

    torch.set_num_threads(1)
    trainer = _Trainer(cfg)
    ppo = trainer.ppo
    start_steps = ppo.num_timesteps
    if cfg.progress:
        from tqdm import tqdm

        trainer.bar = tqdm(total=cfg.total_steps, initial=start_steps, unit="step", desc="train-rl")
    if cfg.resume is None:
        trainer.run_eval(0)  # the untrained actor (the start rule) is a candidate too
    t0 = time.perf_counter()
    try:
        if ppo.num_timesteps < cfg.total_steps:
            ppo.learn(cfg.total_steps, on_update=trainer.on_update)
    finally:
        if trainer.bar is not None:
            trainer.bar.close()
        trainer.venv.close()
    train_s = time.perf_counter() - t0 - trainer.eval_s
    steps = ppo.num_timesteps
    checkpoint = trainer.save_checkpoint(steps)
    if not trainer.evals or trainer.evals[-1]["steps"] != steps:
        trainer.run_eval(steps)
    assert trainer.best is not None
    val_reward, selected, weights = trainer.best
    chosen = next(ev for ev in trainer.evals if ev["steps"] == selected)
    summary = chosen["summary"]
    metadata = trainer.metadata(summary, train_s, steps) | {
        "selected_steps": selected,
        "validation_reward": val_reward,
        "steps_per_s": (steps - start_steps) / max(train_s, 1e-9),
    }
    artifact = trainer.export(weights, metadata)
    write_json(
        trainer.out / "eval.json",
        {"windows": [asdict(w) for w in trainer.windows], "evals": trainer.evals, "history": trainer.history},
    )
    if cfg.wandb:
        trainer.log_wandb(artifact, summary)
    return {
        "artifact": str(artifact),
        "checkpoint": str(checkpoint),
        "summary": summary,
        "steps": steps,
        "selected_steps": selected,
        "steps_per_s": metadata["steps_per_s"],
    }


os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

__all__ = [
    "BASELINES",
    "ConstantPredictor",
    "TrainConfig",
    "decision_statistics",
    "evaluate",
    "evaluate_artifact",
    "load_predictor_spec",
    "summarise",
    "train",
]

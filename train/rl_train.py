"""PPO training of the ``rl`` lease policy on ``envs.rl_env.LeaseEnv`` (stable-baselines3).

One entry point, :func:`train`, used by ``crossflow train-rl``. It builds ``n_envs`` environments
(subprocesses when more than one), normalises observations and rewards (``VecNormalize``), trains
PPO with checkpoints (model + normalisation, so ``resume`` continues exactly), evaluates the current
policy against ``static`` and ``heuristic`` on fixed held-out windows, logs curves, tables and the
final policy to W&B (offline unless the user set ``WANDB_MODE``), and exports the policy for the
numpy-only :class:`policies.rl_policy.RLPolicy`.

Split: closed-loop traces split by session (``EnvConfig.eval_fraction`` of sessions, chosen by
``split_seed``, are never seen in training); open-loop traces by time (the last share of the span).
Evaluation windows are drawn from the held-out part with a fixed seed, at the low, middle and high
training loads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.rl_env import EnvConfig, LeaseEnv, Window, eval_windows
from policies.node_policies import HeuristicPolicy, NodePolicy, SafePrefillPredictor, StaticPolicy
from policies.rl_policy import LeaseShape, MlpWeights, RLPolicy, save_artifact
from train.jsonio import write_json

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


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
    """Run folder: checkpoints, the exported policy, eval results, W&B files."""
    total_steps: int = 200_000
    """Environment steps (one node decision each) in total, including any resumed ones."""
    n_envs: int = 2
    """Parallel environments (subprocesses when > 1)."""
    seed: int = 0
    resume: str | None = None
    """Checkpoint .zip to continue from (its VecNormalize .pkl must lie next to it)."""
    predictor: str | None = None
    """Interference model: artifact folder, ``constant:N``, or None for the shipped one."""
    export: str | None = None
    """Also copy the final policy (.npz + .json) here."""
    eval_every: int = 50_000
    eval_windows: int = 6
    checkpoint_every: int = 50_000
    n_steps: int = 512
    """Rollout length per environment between PPO updates."""
    batch_size: int = 256
    n_epochs: int = 5
    learning_rate: float = 3e-4
    gamma: float = 0.995
    gae_lambda: float = 0.95
    ent_coef: float = 0.0
    net_arch: tuple[int, ...] = (64, 64)
    log_std_init: float = -1.0
    """Initial log standard deviation of the Gaussian actions (SB3's 0 explores too wildly here: one
    node's action moves a cluster-wide reward only a little, so noise swamps the signal)."""
    init_controls: tuple[float, float] | None = (0.8, 1.0)
    """``(compute_scale, task_share)`` the untrained policy's mean action starts at: the heuristic's
    margin and all tasks, so PPO learns state-dependent departures from the heuristic's setting
    rather than starting from a random one. None: SB3's default (the middle of the box)."""
    wandb: bool = True
    progress: bool = True
    command: str = ""
    """The command line that started this run (recorded in the exported metadata)."""
    env: EnvConfig = field(default_factory=EnvConfig)


def _make_env(config: EnvConfig, predictor_spec: str | None, split: str = "train") -> Callable[[], Any]:
    def build() -> LeaseEnv:
        import torch

        torch.set_num_threads(1)  # each subprocess is one core's worth of simulation
        cluster = config.cluster()
        predictor = load_predictor_spec(predictor_spec, cluster.gpu, cluster.model, cluster.tp)
        return LeaseEnv(config, predictor=predictor, split=split)

    return build


def export_weights(model: Any, vecnorm: Any) -> MlpWeights:
    """The actor of an SB3 PPO ``MlpPolicy`` (tanh MLP + action head) and the observation statistics."""
    from torch import nn

    policy = model.policy
    linears = [m for m in policy.mlp_extractor.policy_net if isinstance(m, nn.Linear)] + [policy.action_net]
    layers = tuple(
        (m.weight.detach().cpu().numpy().astype(np.float64), m.bias.detach().cpu().numpy().astype(np.float64))
        for m in linears
    )
    return MlpWeights(
        layers,
        np.asarray(vecnorm.obs_rms.mean, dtype=np.float64),
        np.asarray(vecnorm.obs_rms.var, dtype=np.float64),
        float(vecnorm.clip_obs),
        float(vecnorm.epsilon),
    )


def _library_versions() -> dict[str, str]:
    import gymnasium
    import stable_baselines3
    import torch

    return {
        "stable_baselines3": stable_baselines3.__version__,
        "torch": torch.__version__,
        "gymnasium": gymnasium.__version__,
    }


def baseline_policies(predictor: SafePrefillPredictor, env: LeaseEnv) -> dict[str, NodePolicy]:
    """``static``, ``heuristic`` (its defaults) and ``heuristic_same_ttl`` (the heuristic given the RL
    policy's TTL and task cap, to separate what was learned from what the lease shape gives)."""
    itl = env.cluster.slo_tpot_s
    shape = env.config.lease_shape
    return {
        "static": StaticPolicy(),
        "heuristic": HeuristicPolicy(predictor, itl_target_s=itl),
        "heuristic_same_ttl": HeuristicPolicy(
            predictor, itl_target_s=itl, ttl_s=shape.ttl_s, max_tasks=shape.max_tasks
        ),
    }


def evaluate(env: LeaseEnv, windows: list[Window], policies: dict[str, NodePolicy]) -> list[dict[str, Any]]:
    """One row per (policy, window): :meth:`LeaseEnv.run_policy`'s figures plus the window."""
    rows = []
    for name, policy in policies.items():
        for i, window in enumerate(windows):
            rows.append({"policy": name, "window": i, "load": window.load, **env.run_policy(window, policy)})
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy: mean of each figure over windows (NaN-aware) and geo-mean throughput gain over static."""
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["policy"], []).append(row)
    out: dict[str, dict[str, float]] = {}
    static = {r["window"]: r for r in by.get("static", [])}
    for name, items in by.items():
        keys = [k for k in items[0] if k not in ("policy", "window")]
        summary = {k: float(np.nanmean([r[k] for r in items])) for k in keys}
        for metric in ("input_tokens_per_s", "output_tokens_per_s"):
            pairs = [(r[metric], static[r["window"]][metric]) for r in items if r["window"] in static]
            ratios = [a / b for a, b in pairs if a > 0 and b > 0]
            if ratios:
                summary[f"{metric}_geomean_gain"] = float(np.exp(np.mean(np.log(ratios))) - 1.0)
        out[name] = summary
    return out


def decision_statistics(env: LeaseEnv, windows: list[Window], policy: RLPolicy) -> dict[str, Any]:
    """What ``policy`` decides on ``windows`` (through ``env``'s steps): its compute scale (mean, min,
    max), how often it admits each task count, and the correlation of the scale and the task count
    with each observed feature (states under decode pressure excluded: the shield decides there)."""
    from policies.rl_policy import FEATURES, action_to_controls

    obs_rows, scales, tasks = [], [], []
    for window in windows:
        obs, _ = env.reset(options={"window": window})
        done = False
        while not done:
            action = policy.weights.forward(obs)
            scale, n_tasks = action_to_controls(action, policy.shape)
            obs_rows.append(obs)
            scales.append(scale)
            tasks.append(n_tasks)
            obs, _, terminated, truncated, _ = env.step(action.astype(np.float32))
            done = terminated or truncated
    X, sc, tk = np.array(obs_rows), np.array(scales), np.array(tasks)
    free = X[:, FEATURES.index("decode_pressure")] == 0
    corr: dict[str, dict[str, float]] = {}
    for i, name in enumerate(FEATURES):
        x = X[free, i]
        if x.std() > 0 and sc[free].std() > 0 and tk[free].std() > 0:
            corr[name] = {
                "scale": float(np.corrcoef(x, sc[free])[0, 1]),
                "tasks": float(np.corrcoef(x, tk[free])[0, 1]),
            }
    return {
        "decisions": len(sc),
        "decode_pressure_share": float(1.0 - free.mean()),
        "scale_mean": float(sc.mean()),
        "scale_min": float(sc.min()),
        "scale_max": float(sc.max()),
        "tasks_histogram": np.bincount(tk, minlength=policy.shape.max_tasks + 1).tolist(),
        "correlations": corr,
    }


def evaluate_artifact(
    env_config: EnvConfig, artifact: str | Path | None, n_windows: int, predictor_spec: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``rl`` (the exported policy at ``artifact``, default the shipped one) against the baselines on
    ``n_windows`` held-out windows of ``env_config``; returns the per-window rows and the summary
    (per policy, plus ``rl_decisions``: :func:`decision_statistics`)."""
    cluster = env_config.cluster()
    predictor = load_predictor_spec(predictor_spec, cluster.gpu, cluster.model, cluster.tp)
    env = LeaseEnv(env_config, predictor=predictor, split="eval")
    rl = RLPolicy.load(predictor, artifact)
    windows = eval_windows(env_config, n_windows)
    rows = evaluate(env, windows, baseline_policies(predictor, env) | {"rl": rl})
    return rows, summarise(rows) | {"rl_decisions": decision_statistics(env, windows, rl)}


def _build_model(cfg: TrainConfig) -> tuple[Any, Any]:
    """A new PPO model on fresh vector envs, or the checkpoint ``cfg.resume`` with its normalisation."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecMonitor, VecNormalize

    factories = [_make_env(cfg.env, cfg.predictor) for _ in range(cfg.n_envs)]
    raw = VecMonitor(SubprocVecEnv(factories) if cfg.n_envs > 1 else DummyVecEnv(factories))
    if cfg.resume:
        resume = Path(cfg.resume)
        stats = resume.with_name(resume.stem + "_vecnormalize.pkl")
        if not resume.is_file() or not stats.is_file():
            raise FileNotFoundError(f"--resume needs {resume} and {stats}")
        venv = VecNormalize.load(str(stats), raw)
        venv.training = True
        return PPO.load(str(resume), env=venv, device="cpu"), venv
    venv = VecNormalize(raw, norm_obs=True, norm_reward=True, clip_obs=10.0, gamma=cfg.gamma)
    model = PPO(
        "MlpPolicy",
        venv,
        n_steps=cfg.n_steps,
        batch_size=cfg.batch_size,
        n_epochs=cfg.n_epochs,
        learning_rate=cfg.learning_rate,
        gamma=cfg.gamma,
        gae_lambda=cfg.gae_lambda,
        ent_coef=cfg.ent_coef,
        policy_kwargs={
            "net_arch": {"pi": list(cfg.net_arch), "vf": list(cfg.net_arch)},
            "log_std_init": cfg.log_std_init,
        },
        seed=cfg.seed,
        device="cpu",
        verbose=0,
    )
    if cfg.init_controls is not None:
        import torch

        scale, task_share = cfg.init_controls
        shape = cfg.env.lease_shape
        # SB3 initialises the action head with gain 0.01, so its output starts at about its bias.
        bias = [2.0 * min(scale / shape.max_scale, 1.0) - 1.0, 2.0 * task_share - 1.0]
        action_net: Any = model.policy.action_net
        with torch.no_grad():
            action_net.bias.copy_(torch.tensor(bias))
    return model, venv


class _Trainer:
    """One training run's state: model, evaluation windows and baselines, W&B run, history."""

    def __init__(self, cfg: TrainConfig) -> None:
        if cfg.total_steps < 1 or cfg.n_envs < 1:
            raise ValueError("total_steps and n_envs must be >= 1")
        self.cfg = cfg
        self.out = Path(cfg.out)
        (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        cluster = cfg.env.cluster()
        self.predictor = load_predictor_spec(cfg.predictor, cluster.gpu, cluster.model, cluster.tp)
        self.model, self.venv = _build_model(cfg)
        self.eval_env = LeaseEnv(cfg.env, predictor=self.predictor, split="eval")
        self.windows = eval_windows(cfg.env, cfg.eval_windows)
        self.baseline_rows = evaluate(
            self.eval_env, self.windows, baseline_policies(self.predictor, self.eval_env)
        )
        # Checkpoint selection uses windows of the *training* sessions (other seeds), never the held-out ones.
        self.val_env = LeaseEnv(cfg.env, predictor=self.predictor, split="train")
        self.val_windows = eval_windows(cfg.env, cfg.eval_windows, seed=4321)
        self.best: tuple[float, int, MlpWeights] | None = None
        self.last_eval: tuple[int, dict[str, dict[str, float]]] | None = None
        """(steps, held-out summary) of the latest evaluation (the final one is not run twice)."""
        """(validation reward, steps, weights) of the best policy so far."""
        self.history: list[dict[str, Any]] = []
        self.run: Any = None
        if cfg.wandb:
            import wandb

            self.run = wandb.init(
                project="crossflow",
                job_type="train-rl",
                group="train-rl",
                name=f"train-rl-{self.out.name}-seed{cfg.seed}",
                tags=["train-rl", cfg.env.trace, cfg.env.model, cfg.env.shape],
                dir=str(self.out),
                config={**dataclasses.asdict(cfg), "env": cfg.env.to_dict()},
                mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            )

    def current_policy(self) -> RLPolicy:
        return RLPolicy(self.predictor, export_weights(self.model, self.venv), self.cfg.env.lease_shape)

    def save_checkpoint(self, steps: int) -> Path:
        """``checkpoints/ppo_<steps>.zip`` and its ``_vecnormalize.pkl``, each written then renamed."""
        folder = self.out / "checkpoints"
        tmp_model, tmp_stats = folder / f".ppo_{steps}-partial.zip", folder / f".ppo_{steps}-partial.pkl"
        self.model.save(str(tmp_model))
        self.venv.save(str(tmp_stats))
        final = folder / f"ppo_{steps}.zip"
        tmp_model.replace(final)
        tmp_stats.replace(folder / f"ppo_{steps}_vecnormalize.pkl")
        return final

    def log(self, values: dict[str, Any], steps: int) -> None:
        if self.run is not None and values:
            self.run.log(values, step=steps)

    def run_eval(self, steps: int, weights: MlpWeights | None = None) -> dict[str, dict[str, float]]:
        """Validate the current policy (or ``weights``) for checkpoint selection, and compare it with
        the baselines on the held-out windows."""
        weights = weights or export_weights(self.model, self.venv)
        policy = RLPolicy(self.predictor, weights, self.cfg.env.lease_shape)
        val_rows = evaluate(self.val_env, self.val_windows, {"rl": policy})
        val_reward = float(np.mean([r["reward"] for r in val_rows]))
        if self.best is None or val_reward > self.best[0]:
            self.best = (val_reward, steps, weights)
        rows = self.baseline_rows + evaluate(self.eval_env, self.windows, {"rl": policy})
        summary = summarise(rows)
        self.history.append({"steps": steps, "validation_reward": val_reward, "summary": summary})
        flat: dict[str, Any] = {"eval/rl_validation_reward": val_reward} | {
            f"eval/{p}/{k}": v for p, s in summary.items() for k, v in s.items() if math.isfinite(v)
        }
        if self.run is not None:
            import wandb

            names = list(rows[0])
            columns: list[str | int] = list(names)
            flat["eval/table"] = wandb.Table(columns=columns, data=[[r[c] for c in names] for r in rows])
        self.log(flat, steps)
        if self.cfg.progress:
            from tqdm import tqdm

            line = ", ".join(f"{p} {s['reward']:.2f}" for p, s in summary.items())
            tqdm.write(f"eval at {steps} steps: validation {val_reward:.2f}; mean held-out reward: {line}")
        self.last_eval = (steps, summary)
        return summary

    def metadata(self, summary: dict[str, Any], train_s: float) -> dict[str, Any]:
        cfg = self.cfg
        keep = ("command", "data_sha256", "hardware", "model", "tp", "itl_target")
        return {
            "command": cfg.command,
            "seed": cfg.seed,
            "steps": int(self.model.num_timesteps),
            "train_seconds": round(train_s, 1),
            "n_envs": cfg.n_envs,
            "lease_shape": cfg.env.lease_shape.to_dict(),
            "env_config": cfg.env.to_dict(),
            "predictor": cfg.predictor or "shipped default",
            "predictor_metadata": {
                k: v for k, v in getattr(self.predictor, "metadata", {}).items() if k in keep
            },
            "ppo": {
                k: getattr(cfg, k)
                for k in (
                    "n_steps",
                    "batch_size",
                    "n_epochs",
                    "learning_rate",
                    "gamma",
                    "gae_lambda",
                    "ent_coef",
                )
            }
            | {"net_arch": list(cfg.net_arch)},
            "libraries": _library_versions(),
            "eval_summary": summary,
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

    def finish(self, artifact: Path, steps: int) -> None:
        payload = {"windows": [dataclasses.asdict(w) for w in self.windows], "history": self.history}
        write_json(self.out / "eval.json", payload)
        if self.run is not None:
            import wandb

            art = wandb.Artifact(
                "rl-lease-policy", type="policy", metadata={"steps": steps, "seed": self.cfg.seed}
            )
            art.add_file(str(artifact))
            art.add_file(str(artifact.with_suffix(".json")))
            self.run.log_artifact(art)
            self.run.finish()
        self.venv.close()


def _callback(trainer: _Trainer) -> Any:
    """Progress bar, W&B training curves, periodic evaluation and checkpoints."""
    from stable_baselines3.common.callbacks import BaseCallback

    cfg, model = trainer.cfg, trainer.model

    class Hooks(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.bar: Any = None
            self.next_eval = model.num_timesteps + cfg.eval_every
            self.next_ckpt = model.num_timesteps + cfg.checkpoint_every

        def _on_training_start(self) -> None:
            if cfg.progress:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=cfg.total_steps, initial=model.num_timesteps, unit="step", desc="train-rl"
                )

        def _on_step(self) -> bool:
            if self.bar is not None:
                self.bar.update(self.training_env.num_envs)
            if model.num_timesteps >= self.next_ckpt:
                self.next_ckpt += cfg.checkpoint_every
                trainer.save_checkpoint(model.num_timesteps)
            if model.num_timesteps >= self.next_eval:
                self.next_eval += cfg.eval_every
                trainer.run_eval(model.num_timesteps)
            return True

        def _on_rollout_end(self) -> None:
            log = {f"train/{k.split('/')[-1]}": v for k, v in model.logger.name_to_value.items()}
            infos = list(model.ep_info_buffer)
            if infos:
                log["rollout/ep_rew_mean"] = float(np.mean([e["r"] for e in infos]))
                log["rollout/ep_len_mean"] = float(np.mean([e["l"] for e in infos]))
            trainer.log(log, model.num_timesteps)

        def _on_training_end(self) -> None:
            if self.bar is not None:
                self.bar.close()

    return Hooks()


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume ``cfg.resume``) to ``cfg.total_steps``, evaluate, export.

    The exported policy is the one with the best validation reward among the evaluations (validation
    windows come from the training sessions; the held-out ones only report). Returns ``{"artifact",
    "checkpoint", "summary", "steps", "selected_steps"}``: the exported policy (.npz; metadata in the
    .json next to it), the final checkpoint, and the exported policy's held-out evaluation.
    """
    import torch

    torch.set_num_threads(1)
    trainer = _Trainer(cfg)
    model = trainer.model
    t0 = time.perf_counter()
    remaining = max(0, cfg.total_steps - model.num_timesteps)
    if remaining:
        model.learn(remaining, callback=_callback(trainer), reset_num_timesteps=cfg.resume is None)
    train_s = time.perf_counter() - t0
    steps = int(model.num_timesteps)
    checkpoint = trainer.save_checkpoint(steps)
    # the last in-training evaluation may have been at this very step (total_steps a multiple of eval_every)
    last = trainer.last_eval
    summary = last[1] if last is not None and last[0] == steps else trainer.run_eval(steps)
    assert trainer.best is not None
    val_reward, selected_steps, weights = trainer.best
    if selected_steps != steps:  # an earlier policy validated better: report the held-out figures of that one
        summary = summarise(
            trainer.baseline_rows
            + evaluate(
                trainer.eval_env,
                trainer.windows,
                {"rl": RLPolicy(trainer.predictor, weights, cfg.env.lease_shape)},
            )
        )
    metadata = trainer.metadata(summary, train_s) | {
        "selected_steps": selected_steps,
        "validation_reward": val_reward,
    }
    artifact = trainer.export(weights, metadata)
    trainer.finish(artifact, steps)
    return {
        "artifact": str(artifact),
        "checkpoint": str(checkpoint),
        "summary": summary,
        "steps": steps,
        "selected_steps": selected_steps,
    }


__all__ = [
    "ConstantPredictor",
    "LeaseShape",
    "TrainConfig",
    "baseline_policies",
    "decision_statistics",
    "evaluate",
    "evaluate_artifact",
    "export_weights",
    "load_predictor_spec",
    "summarise",
    "train",
]

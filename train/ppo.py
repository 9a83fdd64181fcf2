"""A small, batched PPO (clipped surrogate, GAE, value bootstrap on truncation) in torch.

Why not stable-baselines3: for a policy of a few thousand parameters SB3's per-step machinery
(distribution objects, buffers that copy per step, callbacks per step) costs more than the network;
here one rollout step is one normalisation of the ``(n_envs, features)`` observation batch, one
forward pass of the actor-critic on it and one ``step`` of a gymnasium vector env, and one update
step is one forward/backward of a minibatch. ``benchmarks/bench_ppo.py`` measures both on CartPole.

Contract: :class:`PPO` trains on any gymnasium ``VectorEnv`` built with
``autoreset_mode=SAME_STEP`` (``make_vector_env``) whose single action space is a ``Box``
(Gaussian policy, actions clipped to the box for the env, log-probabilities of the unclipped sample)
or a ``Discrete`` (categorical). Observations are normalised by running statistics and rewards
scaled by the running standard deviation of the discounted return (as SB3's ``VecNormalize``); both
statistics are part of the state (``state_dict``), so a resumed run continues from the same policy,
optimiser and statistics (its environments start new episodes). Everything
random draws from ``seed`` (torch generator, env seeds): the same seed and env give the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from train.ppo_config import PPOConfig


class RunningMeanStd:
    """Running mean and variance of batches (Chan et al.'s parallel update)."""

    def __init__(self, shape: tuple[int, ...] = ()) -> None:
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = 1e-4

    def update(self, x: np.ndarray) -> None:
        batch_mean, batch_var, n = x.mean(axis=0), x.var(axis=0), x.shape[0]
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean = self.mean + delta * n / total
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.var = m2 / total
        self.count = total

    def state(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": self.count}

    def load(self, state: dict[str, Any]) -> None:
        self.mean, self.var, self.count = (
            np.array(state["mean"]),
            np.array(state["var"]),
            float(state["count"]),
        )


def _mlp(n_in: int, arch: Sequence[int]) -> tuple[nn.Sequential, int]:
    layers: list[nn.Module] = []
    for width in arch:
        lin = nn.Linear(n_in, width)
        nn.init.orthogonal_(lin.weight, gain=2**0.5)
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Tanh()]
        n_in = width
    return nn.Sequential(*layers), n_in


class ActorCritic(nn.Module):
    """Separate tanh MLPs for the actor and the critic (SB3's ``MlpPolicy`` layout)."""

    def __init__(self, n_obs: int, action_space: gym.Space[Any], cfg: PPOConfig) -> None:
        super().__init__()
        self.pi_body, width = _mlp(n_obs, cfg.net_arch)
        self.vf_body, vf_width = _mlp(n_obs, cfg.net_arch)
        self.value_head = nn.Linear(vf_width, 1)
        nn.init.orthogonal_(self.value_head.weight, gain=1.0)
        nn.init.zeros_(self.value_head.bias)
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            n_out = int(action_space.n)  # type: ignore[attr-defined]
        elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
            n_out = action_space.shape[0]
        else:
            raise TypeError(f"PPO supports Discrete and 1-d Box action spaces, not {action_space}")
        self.action_head = nn.Linear(width, n_out)
        nn.init.orthogonal_(self.action_head.weight, gain=0.01)
        nn.init.zeros_(self.action_head.bias)
        if cfg.init_action is not None:
            if self.discrete or len(cfg.init_action) != n_out:
                raise ValueError(f"init_action needs {n_out} values for a Box action space")
            with torch.no_grad():
                self.action_head.bias.copy_(torch.tensor(cfg.init_action, dtype=torch.float32))
        self.log_std = nn.Parameter(torch.full((n_out,), float(cfg.log_std_init)))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(action mean or logits, value)``."""
        return self.action_head(self.pi_body(obs)), self.value_head(self.vf_body(obs)).squeeze(-1)

    def log_prob_entropy(
        self, head: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.discrete:
            logp_all = torch.log_softmax(head, dim=-1)
            logp = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return logp, entropy
        log_std = self.log_std.expand_as(head)
        z = (actions - head) / log_std.exp()
        logp = (-0.5 * z**2 - log_std - 0.5 * np.log(2 * np.pi)).sum(-1)
        entropy = (log_std + 0.5 + 0.5 * np.log(2 * np.pi)).sum(-1)
        return logp, entropy


def make_vector_env(factories: Sequence[Callable[[], gym.Env[Any, Any]]], processes: bool = False) -> Any:
    """A gymnasium vector env of ``factories`` with same-step autoreset (what :class:`PPO` expects);
    ``processes``: one subprocess per env (``AsyncVectorEnv``) instead of stepping them in turn."""
    mode = gym.vector.AutoresetMode.SAME_STEP
    if processes and len(factories) > 1:
        return gym.vector.AsyncVectorEnv(list(factories), autoreset_mode=mode, context="spawn")
    return gym.vector.SyncVectorEnv(list(factories), autoreset_mode=mode)


class PPO:
    """PPO on a vector env (module docstring). ``learn`` may be called repeatedly; ``num_timesteps``
    counts env steps (one per env per rollout step)."""

    def __init__(self, venv: Any, cfg: PPOConfig) -> None:
        self.venv, self.cfg = venv, cfg
        self.n_envs = int(venv.num_envs)
        obs_space, self.action_space = venv.single_observation_space, venv.single_action_space
        self.n_obs = int(np.prod(obs_space.shape))
        torch.manual_seed(cfg.seed)
        self.model = ActorCritic(self.n_obs, self.action_space, cfg)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.learning_rate, eps=1e-5)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.obs_rms = RunningMeanStd((self.n_obs,))
        self.ret_rms = RunningMeanStd(())
        self._returns = np.zeros(self.n_envs)
        self.num_timesteps = 0
        self.episode_returns: list[float] = []
        self.episode_lengths: list[int] = []
        self._ep_ret = np.zeros(self.n_envs)
        self._ep_len = np.zeros(self.n_envs, np.int64)
        self._obs: np.ndarray | None = None
        if isinstance(self.action_space, gym.spaces.Box):
            self._low = self.action_space.low.astype(np.float32)
            self._high = self.action_space.high.astype(np.float32)

    # ---- normalisation ------------------------------------------------------------------------------
    def normalise(self, obs: np.ndarray) -> np.ndarray:
        if not self.cfg.norm_obs:
            return obs.astype(np.float32)
        z = (obs - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + 1e-8)
        return np.clip(z, -self.cfg.clip_obs, self.cfg.clip_obs).astype(np.float32)

    def _scale_rewards(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        if not self.cfg.norm_reward:
            return rewards
        self._returns = self._returns * self.cfg.gamma + rewards
        self.ret_rms.update(self._returns)
        self._returns[dones] = 0.0
        return rewards / np.sqrt(self.ret_rms.var + 1e-8)

    # ---- acting -------------------------------------------------------------------------------------
    def predict(self, obs: np.ndarray) -> np.ndarray:
        """Deterministic actions (the mean, or the most likely) for raw observations ``(n, features)``."""
        with torch.inference_mode():
            head, _ = self.model(torch.from_numpy(self.normalise(np.atleast_2d(obs))))
        if self.model.discrete:
            return head.argmax(-1).numpy()
        return np.clip(head.numpy(), self._low, self._high)

    def _sample(self, head: torch.Tensor) -> torch.Tensor:
        if self.model.discrete:
            return torch.multinomial(torch.softmax(head, -1), 1, generator=self.gen).squeeze(-1)
        noise = torch.randn(head.shape, generator=self.gen)
        return head + noise * self.model.log_std.exp()

    def _env_actions(self, actions: torch.Tensor) -> np.ndarray:
        a = actions.numpy()
        return a if self.model.discrete else np.clip(a, self._low, self._high)

    # ---- training -----------------------------------------------------------------------------------
    def learn(
        self, total_timesteps: int, on_update: Callable[[PPO, dict[str, float]], None] | None = None
    ) -> None:
        """Train until ``num_timesteps >= total_timesteps`` (whole rollouts); ``on_update(self, stats)``
        after every update."""
        cfg, n = self.cfg, self.n_envs
        if self._obs is None:
            obs, _ = self.venv.reset(seed=cfg.seed)
            self._obs = np.asarray(obs, np.float64)
        obs_buf = np.zeros((cfg.n_steps, n, self.n_obs), np.float32)
        act_shape = () if self.model.discrete else (self.action_space.shape[0],)
        act_buf = np.zeros((cfg.n_steps, n, *act_shape), np.float32)
        logp_buf = np.zeros((cfg.n_steps, n), np.float32)
        val_buf = np.zeros((cfg.n_steps + 1, n), np.float32)
        rew_buf = np.zeros((cfg.n_steps, n), np.float32)
        done_buf = np.zeros((cfg.n_steps, n), np.float32)
        while self.num_timesteps < total_timesteps:
            t0 = time.perf_counter()
            for t in range(cfg.n_steps):
                if cfg.norm_obs:
                    self.obs_rms.update(self._obs)
                x = torch.from_numpy(self.normalise(self._obs))
                with torch.inference_mode():
                    head, value = self.model(x)
                    actions = self._sample(head)
                    logp, _ = self.model.log_prob_entropy(head, actions)
                obs, rewards, terminated, truncated, infos = self.venv.step(self._env_actions(actions))
                rewards = np.asarray(rewards, np.float64)
                dones = np.logical_or(terminated, truncated)
                self._ep_ret += rewards
                self._ep_len += 1
                scaled = self._scale_rewards(rewards, dones)
                if truncated.any():  # bootstrap a cut-off episode from the value of its last state
                    idx = np.flatnonzero(np.logical_and(truncated, ~np.asarray(terminated)))
                    if len(idx):
                        final = np.stack([np.asarray(infos["final_obs"][i], np.float64) for i in idx])
                        with torch.inference_mode():
                            _, v_final = self.model(torch.from_numpy(self.normalise(final)))
                        scaled[idx] += cfg.gamma * v_final.numpy()
                for i in np.flatnonzero(dones):
                    self.episode_returns.append(float(self._ep_ret[i]))
                    self.episode_lengths.append(int(self._ep_len[i]))
                    self._ep_ret[i], self._ep_len[i] = 0.0, 0
                obs_buf[t], act_buf[t], logp_buf[t] = x.numpy(), actions.numpy(), logp.numpy()
                val_buf[t], rew_buf[t], done_buf[t] = value.numpy(), scaled, dones
                self._obs = np.asarray(obs, np.float64)
            with torch.inference_mode():
                _, last_value = self.model(torch.from_numpy(self.normalise(self._obs)))
            val_buf[-1] = last_value.numpy()
            self.num_timesteps += cfg.n_steps * n
            rollout_s = time.perf_counter() - t0
            stats = self._update(obs_buf, act_buf, logp_buf, val_buf, rew_buf, done_buf)
            stats |= {"rollout_s": rollout_s, "update_s": time.perf_counter() - t0 - rollout_s}
            if self.episode_returns:
                stats["ep_return_mean"] = float(np.mean(self.episode_returns[-20:]))
                stats["ep_length_mean"] = float(np.mean(self.episode_lengths[-20:]))
            if on_update is not None:
                on_update(self, stats)

    def _update(
        self,
        obs: np.ndarray,
        actions: np.ndarray,
        logp_old: np.ndarray,
        values: np.ndarray,
        rewards: np.ndarray,
        dones: np.ndarray,
    ) -> dict[str, float]:
        cfg = self.cfg
        adv = np.zeros_like(rewards)
        last = np.zeros(rewards.shape[1], np.float32)
        for t in reversed(range(cfg.n_steps)):
            nonterminal = 1.0 - dones[t]
            delta = rewards[t] + cfg.gamma * values[t + 1] * nonterminal - values[t]
            last = delta + cfg.gamma * cfg.gae_lambda * nonterminal * last
            adv[t] = last
        returns = adv + values[:-1]
        total = cfg.n_steps * self.n_envs
        o = torch.from_numpy(obs.reshape(total, -1))
        a = torch.from_numpy(actions.reshape(total, *actions.shape[2:]))
        lp = torch.from_numpy(logp_old.reshape(total))
        ad = torch.from_numpy(adv.reshape(total))
        ret = torch.from_numpy(returns.reshape(total))
        batch = min(cfg.batch_size, total)
        clip_fracs, pg_losses, v_losses, entropies = [], [], [], []
        for _ in range(cfg.n_epochs):
            perm = torch.randperm(total, generator=self.gen)
            for start in range(0, total - batch + 1, batch):
                idx = perm[start : start + batch]
                head, value = self.model(o[idx])
                logp, entropy = self.model.log_prob_entropy(head, a[idx])
                mb_adv = ad[idx]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                ratio = torch.exp(logp - lp[idx])
                pg_loss = -torch.min(
                    mb_adv * ratio, mb_adv * torch.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range)
                ).mean()
                v_loss = ((value - ret[idx]) ** 2).mean()
                ent = entropy.mean()
                loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * ent
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                with torch.no_grad():
                    clip_fracs.append(float(((ratio - 1).abs() > cfg.clip_range).float().mean()))
                pg_losses.append(pg_loss.item())
                v_losses.append(v_loss.item())
                entropies.append(ent.item())
        explained = 1.0 - float(np.var(returns - values[:-1]) / (np.var(returns) + 1e-8))
        return {
            "policy_loss": float(np.mean(pg_losses)),
            "value_loss": float(np.mean(v_losses)),
            "entropy": float(np.mean(entropies)),
            "clip_fraction": float(np.mean(clip_fracs)),
            "explained_variance": explained,
            "action_std_mean": self.model.log_std.detach().exp().mean().item(),
        }

    # ---- export and checkpoints ---------------------------------------------------------------------
    def actor_layers(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """The actor's ``(W, b)`` per linear layer (tanh between them), for a numpy-only policy."""
        linears = [m for m in self.model.pi_body if isinstance(m, nn.Linear)] + [self.model.action_head]
        return tuple(
            (m.weight.detach().numpy().astype(np.float64), m.bias.detach().numpy().astype(np.float64))
            for m in linears
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.gen.get_state(),
            "obs_rms": self.obs_rms.state(),
            "ret_rms": self.ret_rms.state(),
            "num_timesteps": self.num_timesteps,
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gen.set_state(state["generator"])
        self.obs_rms.load(state["obs_rms"])
        self.ret_rms.load(state["ret_rms"])
        self.num_timesteps = int(state["num_timesteps"])


__all__ = ["PPO", "ActorCritic", "PPOConfig", "RunningMeanStd", "make_vector_env"]

"""PPO's hyperparameters (``train.ppo``), importable without torch (the CLI reads its defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class PPOConfig:
    """PPO hyperparameters (the names SB3 uses, so the benchmark can give both the same ones)."""

    n_steps: int = 128
    """Rollout length per environment between updates."""
    n_epochs: int = 4
    batch_size: int = 256
    learning_rate: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    net_arch: tuple[int, ...] = (64, 64)
    log_std_init: float = 0.0
    """Initial log standard deviation of Gaussian actions."""
    init_action: tuple[float, ...] | None = None
    """Gaussian actions: the mean the untrained actor starts at (its output layer's bias; the
    layer's weights start small, gain 0.01); ``None``: zero."""
    norm_obs: bool = True
    norm_reward: bool = True
    clip_obs: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_steps < 1 or self.n_epochs < 1 or self.batch_size < 1 or not self.learning_rate > 0:
            raise ValueError("PPOConfig: n_steps, n_epochs, batch_size >= 1 and learning_rate > 0 required")
        if not (0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1 and self.clip_range > 0):
            raise ValueError("PPOConfig: need 0 < gamma <= 1, 0 <= gae_lambda <= 1 and clip_range > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["PPOConfig"]

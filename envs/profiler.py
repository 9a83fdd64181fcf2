"""The simulated profiler: interference profiles measured on the cost model instead of a GPU.

It sweeps realistic decode-node states x injected prefill chunks, times every iteration with
``envs.cost_model.CostModel`` and adds measurement noise shaped like a real GPU timer's, then writes
the one profile schema (``interference_model.schema``) the real profiler writes too.

States come in *groups* (``state_group``): one scenario (batch size, context-length distribution,
remaining-output distribution, pinned KV share) and ``states_per_group`` states drawn from it, which
differ only by the sampled per-request contexts. They are near-duplicates, which is why the
interference model's cross-validation folds by group.

Noise: each measurement is ``t * (1 + rel) + jitter`` with ``rel ~ N(0, relative_sigma)`` and
``jitter ~ |N(0, absolute_jitter_s)|`` (so short steps are relatively noisier: heteroscedastic), and
with probability ``straggler_prob`` it is multiplied by ``U(straggler_min, straggler_max)`` (a
straggler: a preempted stream, a page-table walk, a slow all-reduce). States and noise draw from
separate child seeds, so ``noise=None`` with the same seed yields the same states without noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import pandas as pd

from interference_model.baselines import IterationTimer as BaseIterationTimer
from interference_model.schema import PROFILE_COLUMNS, PROFILE_SCHEMA_VERSION, validate_profiles

DEFAULT_CHUNK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Swept prefill chunks. Small sizes matter: on MoE models a few prefill tokens already wake many
experts, so the step time jumps well before 256 tokens and interpolating from 0 would misjudge it."""


class IterationTimer(BaseIterationTimer, Protocol):
    """What the profiler needs from a cost model (``envs.cost_model.CostModel`` satisfies it)."""

    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class MeasurementNoise:
    """Timer noise of one iteration measurement (see the module docstring)."""

    relative_sigma: float = 0.02
    """Standard deviation of the multiplicative part."""
    absolute_jitter_s: float = 2.0e-4
    """Scale of the additive, always-positive jitter (launch / host-side delays)."""
    straggler_prob: float = 0.01
    straggler_min: float = 1.3
    straggler_max: float = 3.0

    def apply(self, times_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Noisy copies of ``times_s`` (same shape), always > 0."""
        rel = rng.normal(0.0, self.relative_sigma, times_s.shape)
        jitter = np.abs(rng.normal(0.0, self.absolute_jitter_s, times_s.shape))
        straggle = np.where(
            rng.random(times_s.shape) < self.straggler_prob,
            rng.uniform(self.straggler_min, self.straggler_max, times_s.shape),
            1.0,
        )
        return np.maximum(times_s * (1.0 + rel) + jitter, 1e-9) * straggle


@dataclass(frozen=True, slots=True)
class StateSampler:
    """Ranges of the sampled node states."""

    max_batch: int = 256
    """Largest decode batch (SGLang --max-running-requests)."""
    context_median_tokens: tuple[float, float] = (256.0, 65536.0)
    """Per-scenario median context, drawn log-uniformly in this range."""
    context_sigma: tuple[float, float] = (0.1, 1.2)
    """Per-scenario lognormal sigma of the contexts (their spread)."""
    remaining_median_tokens: tuple[float, float] = (16.0, 4096.0)
    pinned_kv_max_share: float = 0.3
    """Up to this share of capacity may be held by pinned, non-running KV (prefix cache, borrowed)."""
    max_kv_share: float = 0.95
    """Running contexts plus their remaining-output reservation never exceed this share of capacity."""


def _log_uniform(rng: np.random.Generator, bounds: tuple[float, float], size: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(bounds[0]), np.log(bounds[1]), size))


def sample_states(
    n_states: int,
    kv_capacity_tokens: int,
    rng: np.random.Generator,
    sampler: StateSampler,
    states_per_group: int,
) -> pd.DataFrame:
    """Node states (one row each) with ``decode_context_tokens`` (the sum) for the cost model."""
    n_groups = -(-n_states // states_per_group)
    batch_g = np.round(_log_uniform(rng, (1.0, float(sampler.max_batch)), n_groups)).astype(np.int64)
    ctx_median_g = _log_uniform(rng, sampler.context_median_tokens, n_groups)
    ctx_sigma_g = rng.uniform(*sampler.context_sigma, n_groups)
    rem_median_g = _log_uniform(rng, sampler.remaining_median_tokens, n_groups)
    pinned_g = np.where(
        rng.random(n_groups) < 0.5, rng.uniform(0, sampler.pinned_kv_max_share, n_groups), 0.0
    )
    rows = []
    for sid in range(n_states):
        g = sid // states_per_group
        ctx = np.clip(rng.lognormal(np.log(ctx_median_g[g]), ctx_sigma_g[g], batch_g[g]), 16, 131072)
        rem = np.clip(rng.lognormal(np.log(rem_median_g[g]), 0.5, batch_g[g]), 1, 32768)
        # Keep only as many requests as fit: running KV plus reservation within max_kv_share.
        fits = np.cumsum(ctx + rem) <= sampler.max_kv_share * kv_capacity_tokens
        n = max(1, int(fits.sum()))
        ctx, rem = np.round(ctx[:n]), np.round(rem[:n])
        used = ctx.sum()
        free_share = max(0.0, 1.0 - (used + rem.sum()) / kv_capacity_tokens)
        pinned = min(pinned_g[g], free_share) * kv_capacity_tokens
        rows.append(
            (
                sid,
                g,
                n,
                ctx.mean(),
                ctx.std(),
                rem.mean(),
                min(1.0, (used + pinned) / kv_capacity_tokens),
                used,
            )
        )
    return pd.DataFrame(
        rows,
        columns=[
            "state_id",
            "state_group",
            "decode_batch_size",
            "context_tokens_mean",
            "context_tokens_std",
            "remaining_output_tokens_mean",
            "kv_occupancy",
            "decode_context_tokens",
        ],
    )


def simulate_profiles(
    gpu: str,
    model: str,
    tp: int,
    n_states: int,
    seed: int,
    *,
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES,
    cached_prefix_tokens: tuple[int, ...] = (0,),
    repeats: int = 9,
    noise: MeasurementNoise | None = MeasurementNoise(),
    states_per_group: int = 4,
    sampler: StateSampler = StateSampler(),
    cost_model: IterationTimer | None = None,
) -> pd.DataFrame:
    """A validated profile table (``interference_model.schema``) of ``n_states`` simulated states.

    Rows: ``n_states x len(chunk_sizes) x len(cached_prefix_tokens) x repeats``. ``cost_model``
    defaults to ``CostModel(gpu, model, tp)``; pass any object with the same methods to test.
    Deterministic in ``seed``.
    """
    if n_states < 1 or repeats < 1 or states_per_group < 1 or not chunk_sizes:
        raise ValueError("n_states, repeats, states_per_group must be >= 1 and chunk_sizes non-empty")
    if cost_model is None:
        from envs.cost_model import CostModel  # lazy: tests inject a fake without the catalog

        cost_model = cast(IterationTimer, CostModel(gpu, model, tp=tp))
    state_seed, noise_seed = np.random.SeedSequence(seed).spawn(2)
    capacity = int(cost_model.kv_capacity_tokens)
    states = sample_states(n_states, capacity, np.random.default_rng(state_seed), sampler, states_per_group)

    n_c, n_p = len(chunk_sizes), len(cached_prefix_tokens)
    s_idx = np.repeat(np.arange(n_states), n_p * n_c * repeats)
    p_idx = np.tile(np.repeat(np.arange(n_p), n_c * repeats), n_states)
    c_idx = np.tile(np.repeat(np.arange(n_c), repeats), n_states * n_p)
    r_idx = np.tile(np.arange(repeats), n_states * n_p * n_c)
    chunk = np.asarray(chunk_sizes, dtype=float)[c_idx]
    prefix = np.asarray(cached_prefix_tokens, dtype=float)[p_idx]
    pair_table = np.array(
        [
            [cost_model.prefill_attention_pairs(int(c), int(p)) for c in chunk_sizes]
            for p in cached_prefix_tokens
        ]
    )
    pairs = pair_table[p_idx, c_idx]
    batch = states["decode_batch_size"].to_numpy()
    ctx_sum = states["decode_context_tokens"].to_numpy(dtype=float)
    t_mixed = cost_model.iteration_times_s(chunk, pairs, batch[s_idx], ctx_sum[s_idx])
    t_decode = cost_model.iteration_times_s(
        np.zeros(n_states * repeats),
        np.zeros(n_states * repeats),
        np.repeat(batch, repeats),
        np.repeat(ctx_sum, repeats),
    ).reshape(n_states, repeats)
    if noise is not None:
        rng = np.random.default_rng(noise_seed)
        t_mixed = noise.apply(np.asarray(t_mixed, dtype=float), rng)
        t_decode = noise.apply(t_decode, rng)

    out = states.iloc[s_idx].drop(columns="decode_context_tokens").reset_index(drop=True)
    out["schema_version"] = PROFILE_SCHEMA_VERSION
    out["source"], out["hardware"], out["model"], out["tp"] = "sim", gpu, model, tp
    out["repeat"] = r_idx
    out["kv_capacity_tokens"] = capacity
    out["chunk_tokens"] = chunk.astype(np.int64)
    out["cached_prefix_tokens"] = prefix.astype(np.int64)
    out["iteration_time_s"] = t_mixed
    out["decode_only_time_s"] = t_decode[s_idx, r_idx]
    return validate_profiles(out[list(PROFILE_COLUMNS)], source=f"simulate_profiles({gpu}, {model}, tp={tp})")

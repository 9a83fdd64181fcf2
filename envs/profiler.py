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
from interference_model.columns import drain_features
from interference_model.schema import (
    FEATURES,
    PROFILE_COLUMNS,
    PROFILE_SCHEMA_VERSION,
    STEP_COLUMNS,
    validate_profiles,
)

DEFAULT_CHUNK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
"""Swept prefill chunks. Small sizes matter: on MoE models a few prefill tokens already wake many
experts, so the step time jumps well before 256 tokens and interpolating from 0 would misjudge it.
The grid is densest where a 25-50 ms step budget crosses on H200 (a few hundred to 2,048 tokens:
gpt-oss-120b takes 75 ms with 2,048 prefill tokens); 4,096 shows when a faster GPU fits more
(``limited_by == "sweep"`` says the label is then a lower bound)."""

DEFAULT_CHECKPOINT_STEPS: tuple[int, ...] = (0, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320)
"""Decode steps at which each state is measured again. At the shipped label (steps of at most
``max(1.5 x decode step, 25 ms)`` over an 8 s lease) a horizon holds at most 320 iterations unless
nothing fits; past the last checkpoint the label holds the last one. Against a checkpoint at every
step these give labels within 0.6% (gpt-oss-120b) and 1.7% (GLM-5) MAPE, never above them (400
noise-free states, seed 1)."""


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


def checkpoint_table(
    state_id: int, contexts_tokens: np.ndarray, remaining_tokens: np.ndarray, steps: tuple[int, ...]
) -> list[tuple[int, int, int, float]]:
    """The evolved batch of one state at each checkpoint step (the profile's step columns).

    After ``k`` iterations the requests with remaining output > ``k`` still run, each with ``k`` more
    tokens of context. Checkpoints where no request is left are omitted.
    Rows: ``(state_id, decode_step, step_batch_size, step_context_tokens)``.
    """
    out = []
    for k in steps:
        alive = remaining_tokens > k
        if not alive.any():
            break
        out.append((state_id, int(k), int(alive.sum()), float((contexts_tokens[alive] + k).sum())))
    return out


STEP_TABLE_COLUMNS = ("state_id", *STEP_COLUMNS)


def sample_states(
    n_states: int,
    kv_capacity_tokens: int,
    rng: np.random.Generator,
    sampler: StateSampler,
    states_per_group: int,
    checkpoint_steps: tuple[int, ...] = (0,),
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Node states (one row each: ``state_id``, ``state_group`` and the features) and their
    checkpoints (one row per state and step, ``STEP_TABLE_COLUMNS``; see :func:`checkpoint_table`)."""
    n_groups = -(-n_states // states_per_group)
    batch_g = np.round(_log_uniform(rng, (1.0, float(sampler.max_batch)), n_groups)).astype(np.int64)
    ctx_median_g = _log_uniform(rng, sampler.context_median_tokens, n_groups)
    ctx_sigma_g = rng.uniform(*sampler.context_sigma, n_groups)
    rem_median_g = _log_uniform(rng, sampler.remaining_median_tokens, n_groups)
    pinned_g = np.where(
        rng.random(n_groups) < 0.5, rng.uniform(0, sampler.pinned_kv_max_share, n_groups), 0.0
    )
    rows, steps = [], []
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
        occupancy = min(1.0, (used + pinned) / kv_capacity_tokens)
        drain = drain_features(ctx.tolist(), rem.tolist())
        rows.append((sid, g, n, ctx.mean(), ctx.std(), rem.mean(), occupancy, *drain))
        steps.extend(checkpoint_table(sid, ctx, rem, checkpoint_steps))
    states = pd.DataFrame(rows, columns=["state_id", "state_group", *FEATURES])
    return states, pd.DataFrame(steps, columns=list(STEP_TABLE_COLUMNS))


def simulate_profiles(
    gpu: str,
    model: str,
    tp: int,
    n_states: int,
    seed: int,
    *,
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES,
    checkpoint_steps: tuple[int, ...] = DEFAULT_CHECKPOINT_STEPS,
    cached_prefix_tokens: tuple[int, ...] = (0,),
    repeats: int = 9,
    noise: MeasurementNoise | None = MeasurementNoise(),
    states_per_group: int = 4,
    sampler: StateSampler = StateSampler(),
    cost_model: IterationTimer | None = None,
) -> pd.DataFrame:
    """A validated profile table (``interference_model.schema``) of ``n_states`` simulated states.

    Rows: per state, per checkpoint in ``checkpoint_steps`` that still has a running request,
    ``len(chunk_sizes) x len(cached_prefix_tokens) x repeats``. ``cost_model`` defaults to
    ``CostModel(gpu, model, tp)``; pass any object with the same methods to test. Deterministic in
    ``seed``.
    """
    if n_states < 1 or repeats < 1 or states_per_group < 1 or not chunk_sizes:
        raise ValueError("n_states, repeats, states_per_group must be >= 1 and chunk_sizes non-empty")
    if (
        not checkpoint_steps
        or checkpoint_steps[0] != 0
        or list(checkpoint_steps) != sorted(set(checkpoint_steps))
    ):
        raise ValueError(f"checkpoint_steps must rise strictly from 0, got {checkpoint_steps}")
    if cost_model is None:
        from envs.cost_model import CostModel  # lazy: tests inject a fake without the catalog

        cost_model = cast(IterationTimer, CostModel(gpu, model, tp=tp))
    state_seed, noise_seed = np.random.SeedSequence(seed).spawn(2)
    capacity = int(cost_model.kv_capacity_tokens)
    states, steps = sample_states(
        n_states, capacity, np.random.default_rng(state_seed), sampler, states_per_group, checkpoint_steps
    )
    n_cp = len(steps)
    n_c, n_p = len(chunk_sizes), len(cached_prefix_tokens)
    per_cp = n_p * n_c * repeats
    cp_idx = np.repeat(np.arange(n_cp), per_cp)
    p_idx = np.tile(np.repeat(np.arange(n_p), n_c * repeats), n_cp)
    c_idx = np.tile(np.repeat(np.arange(n_c), repeats), n_cp * n_p)
    r_idx = np.tile(np.arange(repeats), n_cp * n_p * n_c)
    chunk = np.asarray(chunk_sizes, dtype=float)[c_idx]
    prefix = np.asarray(cached_prefix_tokens, dtype=float)[p_idx]
    pair_table = np.array(
        [
            [cost_model.prefill_attention_pairs(int(c), int(p)) for c in chunk_sizes]
            for p in cached_prefix_tokens
        ]
    )
    pairs = pair_table[p_idx, c_idx]
    batch = steps["step_batch_size"].to_numpy()
    ctx_sum = steps["step_context_tokens"].to_numpy(dtype=float)
    t_mixed = cost_model.iteration_times_s(chunk, pairs, batch[cp_idx], ctx_sum[cp_idx])
    t_decode = cost_model.iteration_times_s(
        np.zeros(n_cp * repeats),
        np.zeros(n_cp * repeats),
        np.repeat(batch, repeats),
        np.repeat(ctx_sum, repeats),
    ).reshape(n_cp, repeats)
    if noise is not None:
        rng = np.random.default_rng(noise_seed)
        t_mixed = noise.apply(np.asarray(t_mixed, dtype=float), rng)
        t_decode = noise.apply(t_decode, rng)

    out = steps.iloc[cp_idx].reset_index(drop=True)
    out = out.merge(states, on="state_id", how="left", sort=False, validate="many_to_one")
    out["schema_version"] = PROFILE_SCHEMA_VERSION
    out["source"], out["hardware"], out["model"], out["tp"] = "sim", gpu, model, tp
    out["repeat"] = r_idx
    out["kv_capacity_tokens"] = capacity
    out["chunk_tokens"] = chunk.astype(np.int64)
    out["cached_prefix_tokens"] = prefix.astype(np.int64)
    out["iteration_time_s"] = t_mixed
    out["decode_only_time_s"] = t_decode[cp_idx, r_idx]
    return validate_profiles(out[list(PROFILE_COLUMNS)], source=f"simulate_profiles({gpu}, {model}, tp={tp})")


IDEAL_KNOBS: dict[str, object] = {
    "memory_efficiency": 1.0,
    "kernel_launch_s": 0.0,
    "elementwise_memory_efficiency": 1.0,
    "elementwise_launch_s": 0.0,
    "attention_prefill_efficiency": 1.0,
    "attention_prefill_launch_s": 0.0,
    "attention_prefill_row_s": 0.0,
    "attention_decode_memory_efficiency": 1.0,
    "attention_decode_launch_s": 0.0,
    "attention_decode_per_request_s": 0.0,
    "allreduce_latency_s": 0.0,
    "allreduce_bus_efficiency": 1.0,
}
"""Every fitted efficiency of ``envs.hardware.GPUSpec`` at 1, every fixed per-kernel cost at 0."""


def datasheet_roofline(gpu: str, model: str, tp: int) -> IterationTimer:
    """The datasheet roofline estimate of iteration times, what a user has before profiling.

    Each operator of the cost model takes ``max(flops / peak, bytes / bandwidth)`` with the datasheet
    peak tensor throughput, HBM and NVLink bandwidth of ``gpu`` and nothing calibrated: every
    efficiency at 1, no launch costs, no per-iteration CPU overhead. The architecture accounting
    (which weights and how much KV each iteration touches, expected active experts) is the cost
    model's, so the only difference to it is the calibration. Times are therefore lower bounds of
    the cost model's, and the safe prefill inverted from them is optimistic.
    """
    from envs.cost_model import CostModel
    from envs.hardware import get_gpu, with_knobs

    spec = get_gpu(gpu)
    ideal = with_knobs(spec, gemm_efficiency=(1.0,) * len(spec.gemm_efficiency), **IDEAL_KNOBS)
    return cast(IterationTimer, CostModel(ideal, model, tp=tp, iteration_overhead_s=0.0))

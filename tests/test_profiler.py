"""The simulated profiler's checkpoints: the evolved batch by hand and on sampled states."""

from __future__ import annotations

import numpy as np
import pytest

from envs.profiler import checkpoint_table, simulate_profiles
from interference_model.columns import drain_features
from tests.test_interference_model import FakeCostModel


def test_checkpoint_table_by_hand() -> None:
    ctx = np.array([100.0, 200.0, 300.0])
    rem = np.array([5.0, 50.0, 500.0])
    rows = checkpoint_table(7, ctx, rem, (0, 10, 100, 600))
    # Step 10: the first request has left (5 tokens to go); step 100: only the third runs; 600: none.
    assert rows == [(7, 0, 3, 600.0), (7, 10, 2, 520.0), (7, 100, 1, 400.0)]


def test_sampled_checkpoints_evolve_physically() -> None:
    df = simulate_profiles(
        "FAKE",
        "m",
        1,
        80,
        seed=4,
        repeats=1,
        noise=None,
        cost_model=FakeCostModel(),
        chunk_sizes=(64,),
        checkpoint_steps=(0, 20, 200),
    )
    cp = df.drop_duplicates(["state_id", "decode_step"]).sort_values(["state_id", "decode_step"])
    first = cp[cp["decode_step"] == 0]
    np.testing.assert_array_equal(first["step_batch_size"], first["decode_batch_size"])
    np.testing.assert_allclose(
        first["step_context_tokens"], first["decode_batch_size"] * first["context_tokens_mean"]
    )
    kept = 0
    for _, state in cp.groupby("state_id"):
        batch = state["step_batch_size"].to_numpy()
        steps = state["decode_step"].to_numpy()
        ctx = state["step_context_tokens"].to_numpy()
        assert (np.diff(batch) <= 0).all() and (batch >= 1).all()
        # Every running request grows by one token per step; when none has left, the sum says so.
        same = batch == batch[0]
        np.testing.assert_allclose(ctx[same], ctx[0] + steps[same] * batch[0])
        kept += int(same[1:].sum())
        # Leaving requests take their context with them: never more than all of them grown.
        assert (ctx <= ctx[0] + steps * batch[0] + 1e-6).all()
    assert kept > 0 and set(cp["decode_step"]) == {0, 20, 200}


def test_bad_checkpoints_are_refused() -> None:
    for steps in ((10, 20), (0, 20, 20), (0, 30, 20), ()):
        with pytest.raises(ValueError, match="checkpoint_steps"):
            simulate_profiles("FAKE", "m", 1, 4, seed=0, cost_model=FakeCostModel(), checkpoint_steps=steps)


def test_drain_features_by_hand() -> None:
    # Two requests: contexts 1,000 and 3,000, remaining 10 and 50 tokens.
    # Longest 50; context-weighted (1000 * 10 + 3000 * 50) / 4000 = 40 (the plain mean is 30).
    assert drain_features([1000.0, 3000.0], [10.0, 50.0]) == (50.0, 40.0)
    assert drain_features([], []) == (0.0, 0.0)
    with pytest.raises(ValueError):
        drain_features([1.0, 2.0], [1.0])


def test_sampled_drain_features_agree_with_the_checkpoints() -> None:
    """The longest remaining output is when the batch is gone: some request still runs at every
    recorded checkpoint below it, and none at the first default checkpoint at or past it."""
    steps = (0, 16, 32, 64, 128, 256)
    df = simulate_profiles(
        "FAKE",
        "m",
        1,
        60,
        seed=3,
        repeats=1,
        noise=None,
        cost_model=FakeCostModel(),
        chunk_sizes=(64,),
        checkpoint_steps=steps,
    )
    cp = df.drop_duplicates(["state_id", "decode_step"])
    assert (df["remaining_output_tokens_max"] >= df["remaining_output_tokens_mean"]).all()
    assert (df["remaining_output_tokens_context_weighted"] <= df["remaining_output_tokens_max"]).all()
    for _, state in cp.groupby("state_id"):
        longest = float(state["remaining_output_tokens_max"].iloc[0])
        measured = set(state["decode_step"])
        assert measured == {k for k in steps if k < longest}

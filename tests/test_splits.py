"""The development / held-out split and the seeded open-loop re-timing."""

from __future__ import annotations

import numpy as np
import pytest

from envs.arrivals import poisson_retime
from envs.request import Request, Trace
from envs.splits import (
    HELDOUT_SHARE,
    SIDES,
    SPLIT_WINDOW_S,
    development_trace,
    heldout_trace,
    split_of,
    split_trace,
    split_units,
    trace_side,
)
from envs.traces import load_trace


def _open_loop(arrivals: list[float], parents: list[tuple[int, int]] | None = None) -> Trace:
    parents = parents or [(-1, 0)] * len(arrivals)
    reqs = [
        Request(i, -1, 0, t, 1000, 10, parent_id=p, shared_prefix_tokens=s)
        for i, (t, (p, s)) in enumerate(zip(arrivals, parents, strict=True))
    ]
    return Trace("toy", reqs, closed_loop=False)


# ---- split ------------------------------------------------------------------------------------------
def test_split_of_is_a_pure_function_of_trace_and_unit() -> None:
    sides = [split_of("agent", u) for u in range(2000)]
    assert set(sides) == set(SIDES)
    assert sides == [split_of("agent", u) for u in range(2000)]
    # the trace name is part of the hash: another trace gets an independent assignment
    assert sides != [split_of("mooncake", u) for u in range(2000)]
    share = sides.count("heldout") / len(sides)
    assert abs(share - HELDOUT_SHARE) < 0.05


@pytest.fixture(scope="module")
def agent() -> Trace:
    return load_trace("agent")


@pytest.mark.parametrize("name", ["agent", "mooncake"])
def test_bundled_sides_partition_the_trace(name: str, agent: Trace) -> None:
    full = agent if name == "agent" else load_trace(name)
    if name == "agent":  # loading the agent bundle costs ~1 s: split the loaded one
        dev, held = split_trace(full, "dev", name), split_trace(full, "heldout", name)
    else:
        dev, held = development_trace(name), heldout_trace(name)
    assert len(dev) + len(held) == len(full)
    assert dev.meta["split"] == "dev" and held.meta["split"] == "heldout"
    units = split_units(full)
    n_units = len(set(units))
    assert dev.meta["split_units"] + held.meta["split_units"] == n_units
    # every request of a side comes from a unit the hash puts on that side
    expected_held = sum(1 for u in units if split_of(name, u) == "heldout")
    assert len(held) == expected_held
    if name == "mooncake":
        assert trace_side(name, "all").requests == full.requests


def test_agent_sides_keep_whole_sessions_and_their_tokens(agent: Trace) -> None:
    full = agent
    held = split_trace(full, "heldout", "agent")
    by_session: dict[int, list[Request]] = {}
    for r in full.requests:
        by_session.setdefault(r.session_id, []).append(r)
    kept = [s for s in by_session if split_of("agent", s) == "heldout"]
    expected = [(r.input_tokens, r.output_tokens, r.think_time_s) for s in kept for r in by_session[s]]
    got = sorted((r.input_tokens, r.output_tokens, r.think_time_s) for r in held.requests)
    assert got == sorted(expected)
    assert len(set(held.session_ids)) == len(kept)


def test_open_loop_windows_are_concatenated_in_order() -> None:
    w = SPLIT_WINDOW_S
    trace = _open_loop([0.5, 10.0, w + 1.0, 2 * w + 3.0, 5 * w + 7.0, 5 * w + 8.0])
    for side in SIDES:
        part = split_trace(trace, side, "toy")
        kept_units = sorted({u for u in split_units(trace) if split_of("toy", u) == side})
        expected = [
            (kept_units.index(int(t // w)) * w + t % w)
            for t in (r.arrival_s for r in trace.requests)
            if int(t // w) in kept_units
        ]
        assert [r.arrival_s for r in part.requests] == pytest.approx(expected)
        assert all(np.diff([r.arrival_s for r in part.requests]) >= 0)


def test_cut_parents_move_to_the_nearest_kept_ancestor() -> None:
    # chain 0 <- 1 <- 2 in three windows; find window indices with the pattern heldout, dev, heldout
    w = SPLIT_WINDOW_S
    units = next(
        (a, b, c)
        for a in range(50)
        for b in range(a + 1, 60)
        for c in range(b + 1, 70)
        if (split_of("toy", a), split_of("toy", b), split_of("toy", c)) == ("heldout", "dev", "heldout")
    )
    trace = _open_loop([u * w for u in units], [(-1, 0), (0, 800), (1, 600)])
    held = split_trace(trace, "heldout", "toy")
    assert len(held) == 2
    # request 2 shared 600 tokens with 1 (dev), which shared 800 with 0: it shares min = 600 with 0
    assert (held.requests[1].parent_id, held.requests[1].shared_prefix_tokens) == (0, 600)
    dev = split_trace(trace, "dev", "toy")
    assert (dev.requests[0].parent_id, dev.requests[0].shared_prefix_tokens) == (-1, 0)


def test_bad_side_names_fail() -> None:
    with pytest.raises(ValueError, match="split side"):
        trace_side("mooncake", "test")


# ---- re-timing --------------------------------------------------------------------------------------
def test_poisson_retime_keeps_each_minute_and_the_order() -> None:
    trace = load_trace("mooncake")
    trace = Trace(trace.name, trace.requests[:3000], False, trace.source, trace.block_size_tokens)
    a = poisson_retime(trace, np.random.default_rng(1))
    b = poisson_retime(trace, np.random.default_rng(1))
    c = poisson_retime(trace, np.random.default_rng(2))
    old = np.array([r.arrival_s for r in trace.requests])
    new = np.array([r.arrival_s for r in a.requests])
    assert [r.arrival_s for r in b.requests] == list(new)  # same seed, same arrivals
    assert not np.allclose(new, [r.arrival_s for r in c.requests])  # another seed moves them
    assert np.array_equal(np.floor(old / 60.0), np.floor(new / 60.0))  # every request keeps its minute
    assert np.all(np.diff(new) >= 0)  # order kept: parents before children
    # the recording's 3 s grid (many requests per instant) becomes distinct times
    assert len(np.unique(old)) < len(old) / 5 and len(np.unique(new)) == len(new)
    assert [(r.input_tokens, r.parent_id) for r in a.requests] == [
        (r.input_tokens, r.parent_id) for r in trace.requests
    ]
    assert a.meta["retime_bin_s"] == 60.0


def test_poisson_retime_spacing_is_uniform_within_the_minute() -> None:
    # 20,000 requests recorded at the start of one minute: re-timed, they spread uniformly over it
    trace = _open_loop([120.0] * 20_000)
    offsets = np.array([r.arrival_s for r in poisson_retime(trace, np.random.default_rng(0)).requests]) - 120
    assert offsets.min() >= 0 and offsets.max() < 60
    counts, _ = np.histogram(offsets, bins=6, range=(0, 60))
    assert np.all(np.abs(counts - 20_000 / 6) < 5 * np.sqrt(20_000 / 6))


def test_poisson_retime_leaves_closed_loop_traces_alone() -> None:
    closed = Trace("c", [Request(0, 0, 0, 5.0, 10, 10)], closed_loop=True)
    assert poisson_retime(closed, np.random.default_rng(0)) is closed
    with pytest.raises(ValueError, match="bin_s"):
        poisson_retime(_open_loop([0.0]), np.random.default_rng(0), bin_s=0.0)


# ---- simulation points ------------------------------------------------------------------------------
def test_points_prepare_their_side_and_retime_by_seed() -> None:
    from train.experiment import Point, prepare_trace

    base = Point(trace="mooncake", max_requests=200)
    assert base.label() == "static|mooncake|gpt-oss-120b|2P4D|load=1|seed=0"  # defaults keep old labels
    held = Point(trace="mooncake", max_requests=200, split="heldout", open_loop_arrivals="poisson")
    assert held.label().endswith("|split=heldout|arrivals=poisson")
    a, b = prepare_trace(held), prepare_trace(Point(**{**held.to_dict(), "seed": 1}))
    side = heldout_trace("mooncake").requests[:200]
    assert [r.input_tokens for r in a.requests] == [r.input_tokens for r in side]
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in b.requests]
    assert [r.arrival_s for r in prepare_trace(base).requests] == [
        r.arrival_s for r in load_trace("mooncake").requests[:200]
    ]
    with pytest.raises(ValueError, match="split"):
        Point(split="test")
    with pytest.raises(ValueError, match="open_loop_arrivals"):
        Point(open_loop_arrivals="jitter")

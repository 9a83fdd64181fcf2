"""Session start processes, load scaling, and trace windows / session splits.

Open-loop traces (Mooncake, Azure) carry their own arrival times: scaling the load divides them by a
factor. Closed-loop traces (agent sessions) have no global arrival process: the simulator releases each
session's requests itself (think time after the previous one finished), so only the *session start*
process is chosen here: a homogeneous Poisson process or a non-homogeneous one following a rate curve
(e.g. ServeGen's 14-day production curves). Scaling a closed-loop load means scaling the session start
rate; :func:`scale_load` leaves a closed-loop trace unchanged and :func:`session_rate_for_load` gives
the rate to use.

Open-loop traces are one recording, so a seed has nothing to vary unless the arrivals are perturbed:
:func:`poisson_retime` re-draws the arrival times as a Poisson process at the trace's own per-minute
rate (every minute keeps its requests and their order; the spacing inside the minute is drawn),
which is what ``crossflow compare`` does with each seed.

Every random function takes a ``numpy.random.Generator`` (or a seed), never global state.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from importlib import resources

import numpy as np

from envs.request import Request, Trace
from envs.traces import SERVEGEN_CURVES_FILE


def poisson_session_starts(n_sessions: int, rate_per_s: float, rng: np.random.Generator) -> np.ndarray:
    """Start times (s, increasing, first one after 0) of ``n_sessions`` from a Poisson process."""
    if n_sessions < 0:
        raise ValueError(f"n_sessions must be >= 0, got {n_sessions}")
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError(f"rate_per_s must be positive and finite, got {rate_per_s}")
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=n_sessions))


def curve_session_starts(
    n_sessions: int,
    curve_times_s: Sequence[float] | np.ndarray,
    curve_rates_per_s: Sequence[float] | np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """Start times of ``n_sessions`` from a non-homogeneous Poisson process with a piecewise-constant rate.

    ``curve_rates_per_s[i]`` holds from ``curve_times_s[i]`` to ``curve_times_s[i+1]``; the last rate
    holds forever. Returned times (increasing) are seconds since ``curve_times_s[0]``. Sampled by
    inverting the integrated rate, so the draw uses exactly ``n_sessions`` exponentials. Raises
    ``ValueError`` if the curve ends with rate 0 before ``n_sessions`` starts could happen.
    """
    times = np.asarray(curve_times_s, dtype=np.float64)
    rates = np.asarray(curve_rates_per_s, dtype=np.float64)
    if times.ndim != 1 or times.shape != rates.shape or times.size == 0:
        raise ValueError("curve_times_s and curve_rates_per_s must be non-empty 1-D arrays of equal length")
    if np.any(np.diff(times) <= 0) or not np.all(np.isfinite(times)):
        raise ValueError("curve_times_s must be finite and strictly increasing")
    if np.any(rates < 0) or not np.all(np.isfinite(rates)):
        raise ValueError("curve_rates_per_s must be finite and non-negative")
    if n_sessions < 0:
        raise ValueError(f"n_sessions must be >= 0, got {n_sessions}")
    rel = times - times[0]
    # integrated rate at each knot: the expected number of starts before it
    knots = np.concatenate(([0.0], np.cumsum(rates[:-1] * np.diff(rel))))
    targets = np.cumsum(rng.exponential(1.0, size=n_sessions))
    if n_sessions and rates[-1] == 0 and targets[-1] >= knots[-1]:
        raise ValueError(
            f"the rate curve integrates to {knots[-1]:.3g} expected starts and ends at rate 0; "
            f"cannot place {n_sessions} sessions"
        )
    # side='right' skips zero-rate windows (equal knots), so the chosen window has a positive rate
    idx = np.searchsorted(knots, targets, side="right") - 1
    return rel[idx] + (targets - knots[idx]) / rates[idx]


RETIME_BIN_S = 60.0
"""Width of the bins whose request counts :func:`poisson_retime` keeps (one minute)."""


def poisson_retime(trace: Trace, rng: np.random.Generator, bin_s: float = RETIME_BIN_S) -> Trace:
    """A seeded realisation of an open-loop trace: Poisson arrivals at the trace's per-minute rate.

    Within every bin ``[k * bin_s, (k + 1) * bin_s)`` of the recording, the arrival times of the bin's
    ``n`` requests are re-drawn as ``n`` sorted uniform draws over the bin (a Poisson process
    conditioned on the bin's count) and handed out in request order. So every bin keeps exactly its
    requests (the offered load of each minute is unchanged), request order is kept (a prefix parent
    still arrives before its children), and the spacing inside a minute is random. Requests keep
    their ids; ``meta["retime_bin_s"]`` records the bin. Closed-loop traces are returned unchanged
    (their seed drives the session start process instead).
    """
    if not (bin_s > 0 and math.isfinite(bin_s)):
        raise ValueError(f"bin_s must be positive and finite, got {bin_s}")
    if trace.closed_loop or not trace.requests:
        return trace
    arrivals = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    if np.any(np.diff(arrivals) < 0):
        raise ValueError(f"trace {trace.name!r}: open-loop arrivals must be in request order to re-time")
    bins = np.floor(arrivals / bin_s).astype(np.int64)
    new_arrivals = np.empty_like(arrivals)
    start = 0
    for end in [*(np.flatnonzero(np.diff(bins)) + 1).tolist(), len(bins)]:
        draws = np.sort(rng.uniform(0.0, bin_s, size=end - start))
        new_arrivals[start:end] = bins[start] * bin_s + draws
        start = end
    requests = [replace(r, arrival_s=float(t)) for r, t in zip(trace.requests, new_arrivals, strict=True)]
    meta = {**trace.meta, "retime_bin_s": bin_s}
    return Trace(trace.name, requests, False, trace.source, trace.block_size_tokens, meta)


def load_servegen_curve(
    model: str, days: int | None = None, start_day: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The bundled ServeGen request-rate curve of ``model`` as ``(window_start_s, requests_per_s)``.

    Windows are 600 s; times are seconds since the start of ``start_day`` (0 = the data's first
    midnight). ``days`` limits the curve to that many days (None = to the end). Models: ``m-large``,
    ``m-mid``, ``m-small`` (14 days), ``deepseek-r1``, ``mm-image`` (1 day). The rates are Alibaba
    production totals (hundreds of requests/s); scale them to your cluster before sampling. Windows
    missing upstream (84 of m-mid's, 37 of m-small's) are filled by linear interpolation between the
    nearest known windows (the nearest one at either end).
    """
    if start_day < 0 or (days is not None and days <= 0):
        raise ValueError(f"need start_day >= 0 and days > 0, got start_day={start_day}, days={days}")
    day_s = 86400.0
    lo, hi = start_day * day_s, math.inf if days is None else (start_day + days) * day_s
    times: list[float] = []
    rates: list[float] = []
    known: set[str] = set()
    for row in _servegen_rows():
        known.add(row["model"])
        if row["model"] == model and lo <= float(row["window_start_s"]) < hi:
            times.append(float(row["window_start_s"]) - lo)
            rates.append(float(row["requests_per_s"]) if row["requests_per_s"] else math.nan)
    if model not in known:
        raise KeyError(f"unknown ServeGen model {model!r}; known: {', '.join(sorted(known))}")
    if not times:
        raise ValueError(f"ServeGen model {model!r} has no windows in days [{start_day}, {start_day}+{days})")
    times_s, rates_per_s = np.asarray(times), np.asarray(rates)
    known_rate = np.isfinite(rates_per_s)
    if not known_rate.any():
        raise ValueError(f"ServeGen model {model!r} has no known rate in the selected days")
    rates_per_s[~known_rate] = np.interp(times_s[~known_rate], times_s[known_rate], rates_per_s[known_rate])
    return times_s, rates_per_s


def _servegen_rows() -> Iterable[dict[str, str]]:
    path = resources.files("envs").joinpath("data", "traces", SERVEGEN_CURVES_FILE)
    yield from csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))


def scale_load(trace: Trace, factor: float) -> Trace:
    """Scale an open-loop trace's offered load by ``factor`` (2 = twice the request rate).

    Open-loop: arrival times are divided by ``factor``. Closed-loop: returned unchanged, because
    arrivals come from session starts and the cluster's own speed; scale the session start rate with
    :func:`session_rate_for_load` instead.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"load factor must be positive and finite, got {factor}")
    if trace.closed_loop:
        return trace
    requests = [replace(r, arrival_s=r.arrival_s / factor) for r in trace.requests]
    return Trace(trace.name, requests, False, trace.source, trace.block_size_tokens, dict(trace.meta))


def session_rate_for_load(base_rate_per_s: float, factor: float) -> float:
    """Session start rate that offers ``factor`` times the load of ``base_rate_per_s``.

    For closed-loop traces load scales with how many sessions run at once, which (for a fixed
    session mix) is proportional to the start rate.
    """
    if not (factor > 0 and math.isfinite(factor)) or not (base_rate_per_s > 0):
        raise ValueError(f"need positive base rate and factor, got {base_rate_per_s}, {factor}")
    return base_rate_per_s * factor


def subset(trace: Trace, request_ids: Iterable[int], name: str, arrival_offset_s: float = 0.0) -> Trace:
    """The requests ``request_ids`` of ``trace`` (kept in trace order), renumbered densely from 0.

    Session ids (those >= 0) are renumbered densely in first-appearance order; turns are recounted
    within each kept session. A ``parent_id`` outside the selection becomes -1 with 0 shared tokens; a
    ``depends_on`` outside it becomes -1 (released at session start). ``arrival_offset_s`` is
    subtracted from every arrival.
    """
    keep = sorted(set(request_ids))
    new_id = {old: new for new, old in enumerate(keep)}
    new_session: dict[int, int] = {}
    turns: dict[int, int] = {}
    requests: list[Request] = []
    for new, old in enumerate(keep):
        r = trace.requests[old]
        session = r.session_id if r.session_id < 0 else new_session.setdefault(r.session_id, len(new_session))
        turn = turns.get(session, 0) if session >= 0 else r.turn
        turns[session] = turn + 1
        parent = new_id.get(r.parent_id, -1)
        requests.append(
            replace(
                r,
                request_id=new,
                session_id=session,
                turn=turn,
                arrival_s=r.arrival_s - arrival_offset_s,
                parent_id=parent,
                shared_prefix_tokens=r.shared_prefix_tokens if parent >= 0 else 0,
                depends_on=new_id.get(r.depends_on, -1),
            )
        )
    return Trace(name, requests, trace.closed_loop, trace.source, trace.block_size_tokens, dict(trace.meta))


def window(trace: Trace, start_s: float, duration_s: float) -> Trace:
    """Open-loop requests arriving in ``[start_s, start_s + duration_s)``, arrivals re-based to 0."""
    if trace.closed_loop:
        raise ValueError(
            f"window() needs an open-loop trace; {trace.name!r} is closed-loop (sample sessions)"
        )
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    end_s = start_s + duration_s
    ids = [r.request_id for r in trace.requests if start_s <= r.arrival_s < end_s]
    return subset(trace, ids, f"{trace.name}[{start_s:g}s+{duration_s:g}s]", arrival_offset_s=start_s)


def _sessions(trace: Trace) -> dict[int, list[int]]:
    by_session: dict[int, list[int]] = {}
    for r in trace.requests:
        if r.session_id < 0:
            raise ValueError(
                f"trace {trace.name!r} has requests without a session id; cannot sample sessions"
            )
        by_session.setdefault(r.session_id, []).append(r.request_id)
    return by_session


def sample_sessions(trace: Trace, n: int, rng: np.random.Generator) -> Trace:
    """``n`` sessions drawn without replacement (kept in original order), ids renumbered densely."""
    by_session = _sessions(trace)
    if not 0 <= n <= len(by_session):
        raise ValueError(f"cannot sample {n} of {len(by_session)} sessions")
    sessions = list(by_session)
    chosen = sorted(rng.choice(len(sessions), size=n, replace=False).tolist())
    ids = [rid for i in chosen for rid in by_session[sessions[i]]]
    return subset(trace, ids, f"{trace.name}[{n} sessions]")


def split_sessions(trace: Trace, fraction: float, seed: int) -> tuple[Trace, Trace]:
    """Split sessions at random into ``(first, rest)`` with ``round(fraction * N)`` sessions in ``first``.

    Deterministic for a seed; each part keeps the original session order and is renumbered densely.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    by_session = _sessions(trace)
    sessions = list(by_session)
    order = np.random.default_rng(seed).permutation(len(sessions))
    n_first = round(fraction * len(sessions))
    first = set(order[:n_first].tolist())
    ids_first = [rid for i, s in enumerate(sessions) if i in first for rid in by_session[s]]
    ids_rest = [rid for i, s in enumerate(sessions) if i not in first for rid in by_session[s]]
    return (
        subset(trace, ids_first, f"{trace.name}[split {fraction:g} a seed={seed}]"),
        subset(trace, ids_rest, f"{trace.name}[split {fraction:g} b seed={seed}]"),
    )

"""The development / held-out split of the bundled traces: one fixed assignment everybody shares.

Tuning (a peer's thresholds, the heuristic's knobs, the interference model, RL training) uses the
**development** side; final tables are reported on the **held-out** side too, so a reader can see how
much of a gain survives on traffic nobody tuned on.

The unit of the split is what keeps a workload's structure intact:

* closed-loop traces (agent sessions): the **session** (its id in the bundled file), so a session's
  requests, think times and prefix chain stay together;
* open-loop traces (Mooncake, Azure): the **minute window** ``floor(arrival_s / SPLIT_WINDOW_S)`` of
  the recording; a side's windows are concatenated back to back (each keeps its own arrival offsets),
  so the per-minute rate is the recording's.

A request whose prefix parent fell on the other side is re-parented to its nearest ancestor on its own
side, sharing the shortest shared prefix along the way (exact for the bundles' chained prefix
identity: two prompts that each share ``s1`` and ``s2`` leading tokens with a third share
``min(s1, s2)`` with each other, or more on a tie). So a side keeps the prefix reuse that exists among
its own requests (Mooncake's prefix-hit share is 37 % whole, 35-36 % per side; dropping cut parents
instead would leave ~20 %).

A unit is held out iff the first 8 bytes of ``blake2b("crossflow-split/v1/<trace>/<unit>")`` read as a
fraction of 2**64 fall below ``HELDOUT_SHARE``. The assignment depends on nothing else (no seed, no
trace length), so it never changes unless the bundled file's session numbering or timeline does.

Call :func:`development_trace` / :func:`heldout_trace` (or :func:`trace_side` with a side name) to get
a side of a bundled trace; :func:`split_of` answers for one unit.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from typing import Literal

from envs.arrivals import subset
from envs.request import Trace
from envs.traces import load_trace

Side = Literal["dev", "heldout"]
SIDES: tuple[Side, ...] = ("dev", "heldout")
ALL = "all"
"""``trace_side`` name of the whole trace (no split)."""
HELDOUT_SHARE = 0.5
"""Expected share of units held out. Half, so either side can fill the ``--full`` comparison grid
(100 agent sessions, 4,000 open-loop requests) and both sides are reported with the same power."""
SPLIT_WINDOW_S = 60.0
"""Width of an open-loop trace's split unit (one minute of the recording)."""
_SALT = "crossflow-split/v1"


def split_of(trace_name: str, unit: int) -> Side:
    """``"dev"`` or ``"heldout"`` for one unit of ``trace_name`` (a session id of a closed-loop trace,
    a minute-window index of an open-loop one, both in the bundled file's numbering)."""
    digest = hashlib.blake2b(f"{_SALT}/{trace_name}/{int(unit)}".encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") / 2.0**64 < HELDOUT_SHARE else "dev"


def split_units(trace: Trace) -> list[int]:
    """The split unit of every request of ``trace``, in request order."""
    if trace.closed_loop:
        if any(r.session_id < 0 for r in trace.requests):
            raise ValueError(f"trace {trace.name!r}: closed-loop requests need session ids to be split")
        return [r.session_id for r in trace.requests]
    return [math.floor(r.arrival_s / SPLIT_WINDOW_S) for r in trace.requests]


def split_trace(trace: Trace, side: Side, trace_name: str | None = None) -> Trace:
    """The ``side`` of an already loaded trace (``trace_name``, default ``trace.name``, is what the
    hash sees: pass the bundled name when the trace was renamed)."""
    if side not in SIDES:
        raise ValueError(f"split side must be one of {SIDES}, got {side!r}")
    name = trace_name or trace.name
    units = split_units(trace)
    keep = {u for u in set(units) if split_of(name, u) == side}
    ids = [r.request_id for r, u in zip(trace.requests, units, strict=True) if u in keep]
    part = subset(_reparented(trace, set(ids)), ids, f"{name}[{side}]")
    part.meta = {**trace.meta, "split": side, "split_units": len(keep)}
    if trace.closed_loop:
        return part
    # Open loop: the kept windows back to back, each keeping its arrivals' offsets inside it.
    slot = {u: i for i, u in enumerate(sorted(keep))}
    kept_units = [u for u in units if u in keep]
    part.requests = [
        replace(r, arrival_s=r.arrival_s + (slot[u] - u) * SPLIT_WINDOW_S)
        for r, u in zip(part.requests, kept_units, strict=True)
    ]
    return part


def _reparented(trace: Trace, kept: set[int]) -> Trace:
    """``trace`` with every kept request's prefix parent moved to its nearest kept ancestor."""
    anchor: list[int] = []  # per request: itself if kept, else its nearest kept ancestor (-1: none)
    shared_to_anchor: list[int] = []  # leading tokens shared with that anchor
    requests = []
    for r in trace.requests:
        parent, shared = r.parent_id, r.shared_prefix_tokens
        if parent >= 0 and parent not in kept:
            parent, shared = anchor[parent], min(shared, shared_to_anchor[parent])
            if parent < 0 or shared <= 0:
                parent, shared = -1, 0
        requests.append(
            replace(r, parent_id=parent, shared_prefix_tokens=shared) if parent != r.parent_id else r
        )
        if r.request_id in kept:
            anchor.append(r.request_id)
            shared_to_anchor.append(r.input_tokens)
        else:
            anchor.append(parent)
            shared_to_anchor.append(shared)
    return replace(trace, requests=requests)


def trace_side(name: str, side: str = ALL) -> Trace:
    """A bundled trace (or trace file) by name: the whole of it (``"all"``) or one side of the split."""
    trace = load_trace(name)
    if side == ALL:
        return trace
    if side not in SIDES:
        raise ValueError(f"split side must be 'all', 'dev' or 'heldout', got {side!r}")
    return split_trace(trace, side, name)


def development_trace(name: str) -> Trace:
    """The development side of bundled trace ``name``: tune and train on this."""
    return trace_side(name, "dev")


def heldout_trace(name: str) -> Trace:
    """The held-out side of bundled trace ``name``: report on this; never tune on it."""
    return trace_side(name, "heldout")


__all__ = [
    "ALL",
    "HELDOUT_SHARE",
    "SIDES",
    "SPLIT_WINDOW_S",
    "Side",
    "development_trace",
    "heldout_trace",
    "split_of",
    "split_trace",
    "split_units",
    "trace_side",
]

"""Requests beyond a model's context window: compacted as an agent harness does, or rejected.

A served request's input plus output must fit the model's context window. Agent harnesses keep a
conversation inside it by compaction; the simulator models the simplest form: the input is cut to
``window - output`` tokens (output is capped at ``window - 1``), so the prompt that is served differs
from every earlier one and its cached prefix is lost (its prefix parent is dropped). A later request
whose parent was compacted shares nothing with it either (the tokens it extended were cut away).
With ``policy="reject"`` nothing is changed here and the simulator refuses those requests at arrival.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from envs.request import Request, Trace


@dataclass(frozen=True)
class ContextFit:
    """What fitting a trace to a context window did."""

    window_tokens: int
    policy: str
    over_window: frozenset[int]
    """Ids of the requests whose input plus output exceeded the window (compacted or to be rejected)."""
    tokens_cut: int
    """Input tokens removed by compaction (0 with ``reject``)."""

    @property
    def n_over_window(self) -> int:
        return len(self.over_window)


def fit_context_window(trace: Trace, window_tokens: int, policy: str) -> tuple[Trace, ContextFit]:
    """``trace`` with every request fitting ``window_tokens`` (``compact``), or unchanged (``reject``)."""
    if window_tokens < 2:
        raise ValueError(f"context window must be at least 2 tokens, got {window_tokens}")
    if policy not in ("compact", "reject"):
        raise ValueError(f"context policy must be 'compact' or 'reject', got {policy!r}")
    over = frozenset(r.request_id for r in trace.requests if r.input_tokens + r.output_tokens > window_tokens)
    if not over or policy == "reject":
        return trace, ContextFit(window_tokens, policy, over, 0)
    cut = 0
    requests: list[Request] = []
    for r in trace.requests:
        if r.request_id in over:
            output = min(r.output_tokens, window_tokens - 1)
            new_input = window_tokens - output
            cut += r.input_tokens - new_input
            requests.append(
                dataclasses.replace(
                    r, input_tokens=new_input, output_tokens=output, parent_id=-1, shared_prefix_tokens=0
                )
            )
        elif r.parent_id in over:
            requests.append(dataclasses.replace(r, parent_id=-1, shared_prefix_tokens=0))
        else:
            requests.append(r)
    fitted = dataclasses.replace(
        trace, requests=requests, meta={**trace.meta, "context_window_tokens": window_tokens}
    )
    return fitted, ContextFit(window_tokens, policy, over, cut)


__all__ = ["ContextFit", "fit_context_window"]

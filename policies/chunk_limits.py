"""A node policy's per-iteration cap on borrowed prefill, as a table a lease can carry.

A node policy with an ITL budget (``HeuristicPolicy.borrowed_chunk_tokens``) caps the borrowed chunk
each iteration of a lending node may take, from the node's running batch at that iteration. In the
simulator the scheduler asks the policy before every iteration; a node that holds no policy (an SGLang
worker running the Crossflow plugin, whose leases come from the router) cannot. ``ChunkLimits`` is the
policy's answer tabulated over the node's whole range, decode batch ``1..max_running_requests`` and
decode context ``0..kv_capacity_tokens``, built once per policy by the router's scheduler
(``ClusterScheduler.chunk_limits``) and pushed with the lease (``serving.sglang_plugin.wire``). The node
looks its running batch up before every borrowed iteration (``limit``).

The grid is exact for small batches and geometric beyond (``BATCH_EXACT`` then steps of
``BATCH_RATIO``; context in steps of ``CONTEXT_RATIO`` from ``CONTEXT_FIRST_TOKENS``); a lookup rounds
both up to the next grid point, and the policy's chunk shrinks as either grows, so the table never
allows more than the policy would at the node's exact batch. Past the table's range the answer is 0
(the caller still lets started work take its smallest chunk, ``capped_chunk_tokens``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BATCH_EXACT = 16
"""Every decode batch up to this size has its own row."""
BATCH_RATIO = 1.125
"""Beyond ``BATCH_EXACT``, each row's batch is at most this factor above the previous one."""
CONTEXT_FIRST_TOKENS = 2048
"""The first context column after 0 (total decode context, tokens)."""
CONTEXT_RATIO = 1.25
"""Each further context column is this factor above the previous one."""


def _batch_grid(max_batch: int) -> tuple[int, ...]:
    grid = list(range(1, min(BATCH_EXACT, max_batch) + 1))
    while grid[-1] < max_batch:
        grid.append(min(max_batch, max(grid[-1] + 1, math.floor(grid[-1] * BATCH_RATIO))))
    return tuple(grid)


def _context_grid(max_context_tokens: int) -> tuple[int, ...]:
    grid = [0]
    value = float(CONTEXT_FIRST_TOKENS)
    while grid[-1] < max_context_tokens:
        grid.append(min(max_context_tokens, max(grid[-1] + 1, int(value))))
        value *= CONTEXT_RATIO
    return tuple(grid)


@dataclass(frozen=True, slots=True)
class ChunkLimits:
    """Borrowed prefill tokens one iteration may take, by decode batch (rows) and decode context
    (columns): ``chunk_tokens[i][k]`` for a batch of ``batch_sizes[i]`` requests holding
    ``context_tokens[k]`` tokens of KV in all. Both axes strictly increasing; batch from 1, context
    from 0; entries non-negative integers."""

    batch_sizes: tuple[int, ...]
    context_tokens: tuple[int, ...]
    chunk_tokens: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        _check_axis("batch_sizes", self.batch_sizes, first_min=1)
        _check_axis("context_tokens", self.context_tokens, first_min=0)
        if len(self.chunk_tokens) != len(self.batch_sizes):
            raise ValueError(
                f"ChunkLimits.chunk_tokens: {len(self.chunk_tokens)} rows for "
                f"{len(self.batch_sizes)} batch sizes"
            )
        for i, row in enumerate(self.chunk_tokens):
            if len(row) != len(self.context_tokens):
                raise ValueError(
                    f"ChunkLimits.chunk_tokens[{i}]: {len(row)} entries for "
                    f"{len(self.context_tokens)} context columns"
                )
            for k, value in enumerate(row):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(
                        f"ChunkLimits.chunk_tokens[{i}][{k}] must be an integer >= 0, got {value!r}"
                    )

    @classmethod
    def build(
        cls, chunk_fn: Callable[[int, int], int | None], max_batch: int, max_context_tokens: int
    ) -> ChunkLimits | None:
        """Tabulate ``chunk_fn(decode_batch, decode_context_tokens)`` (a node policy's
        ``borrowed_chunk_tokens``) over batches ``1..max_batch`` and context ``0..max_context_tokens``;
        ``None`` when the policy sets no limit (``chunk_fn`` answers ``None``)."""
        if max_batch < 1 or max_context_tokens < 0:
            raise ValueError(
                f"ChunkLimits.build: max_batch must be >= 1 and max_context_tokens >= 0, got "
                f"{max_batch!r}, {max_context_tokens!r}"
            )
        batches = _batch_grid(max_batch)
        contexts = _context_grid(max_context_tokens)
        if chunk_fn(batches[0], contexts[0]) is None:
            return None
        rows = []
        for b in batches:
            row = []
            for ctx in contexts:
                value = chunk_fn(b, ctx)
                if value is None:
                    raise ValueError(f"ChunkLimits.build: chunk_fn({b}, {ctx}) is None but not everywhere")
                row.append(int(value))
            rows.append(tuple(row))
        return cls(batches, contexts, tuple(rows))

    def limit(self, decode_batch: int, decode_context_tokens: int) -> int | None:
        """The cap for a running batch of ``decode_batch`` requests holding ``decode_context_tokens``
        tokens: the entry at the next grid point up on both axes; ``None`` for an empty batch (no
        decode to protect); 0 past the table's range."""
        if decode_batch <= 0:
            return None
        i = bisect.bisect_left(self.batch_sizes, decode_batch)
        k = bisect.bisect_left(self.context_tokens, max(0, decode_context_tokens))
        if i == len(self.batch_sizes) or k == len(self.context_tokens):
            return 0
        return self.chunk_tokens[i][k]

    # ---- wire form ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, list[Any]]:
        return {
            "batch_sizes": list(self.batch_sizes),
            "context_tokens": list(self.context_tokens),
            "chunk_tokens": [list(row) for row in self.chunk_tokens],
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "chunk limits") -> ChunkLimits:
        """Read ``to_dict``'s form; ``ValueError`` naming ``source`` and the field that is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: must be an object with batch_sizes, context_tokens, chunk_tokens")
        keys = {"batch_sizes", "context_tokens", "chunk_tokens"}
        if set(data) != keys:
            raise ValueError(f"{source}: keys must be exactly {sorted(keys)}, got {sorted(map(str, data))}")

        def ints(name: str, value: Any) -> tuple[int, ...]:
            if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise ValueError(f"{source}: {name} must be a list of integers")
            return tuple(value)

        rows = data["chunk_tokens"]
        if not isinstance(rows, list):
            raise ValueError(f"{source}: chunk_tokens must be a list of rows")
        try:
            return cls(
                ints("batch_sizes", data["batch_sizes"]),
                ints("context_tokens", data["context_tokens"]),
                tuple(ints(f"chunk_tokens[{i}]", row) for i, row in enumerate(rows)),
            )
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def _check_axis(name: str, axis: Sequence[int], *, first_min: int) -> None:
    if not axis:
        raise ValueError(f"ChunkLimits.{name} must not be empty")
    if axis[0] < first_min or any(b <= a for a, b in itertools.pairwise(axis)):
        raise ValueError(f"ChunkLimits.{name} must be strictly increasing from >= {first_min}")


def capped_chunk_tokens(limit: int | None, max_chunk_tokens: int, min_chunk_tokens: int) -> int:
    """The largest chunk one borrowed iteration may take: the policy's ``limit`` (``None``: no limit)
    within ``max_chunk_tokens``, but never below ``min_chunk_tokens`` so that started work still
    progresses when the running batch has grown past what the policy would lend to."""
    if limit is None:
        return max_chunk_tokens
    return max(min_chunk_tokens, min(limit, max_chunk_tokens))


__all__ = ["ChunkLimits", "capped_chunk_tokens"]

"""The lease: a decode node's short-lived, revocable promise of capacity for borrowed prefill work.

The whole core model is four things: the node that lends, five budgets, an expiry, and an epoch.
Everything else (reservation, commit, revocation, fallback) falls out of comparing budgets and epochs.

* ``LeaseBudgets``: five non-negative integer budgets, closed under ``+`` and (checked) ``-``.
* ``Lease``: ``node_id``, ``epoch`` (monotone per node; a newer lease or a revocation bumps it, so a
  reservation made against an older epoch can never be spent), ``budgets``, ``issued_s``, ``ttl_s``,
  and ``expires_s = issued_s + ttl_s``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

BUDGET_FIELDS: tuple[str, ...] = ("prefill_tokens", "kv_tokens", "transfer_tokens", "decode_tokens", "tasks")
"""Names of the five budgets, in a fixed order (used for vectors, tables and error messages)."""


@dataclass(frozen=True, slots=True)
class LeaseBudgets:
    """Five non-negative integer budgets; also used for a request's demand and for held totals.

    Construction raises ``ValueError`` naming the field when a value is negative or not an integer
    (integral floats such as ``3.0`` and numpy integers are accepted and stored as ``int``).
    """

    prefill_tokens: int = 0
    """Uncached prompt tokens the node may prefill locally during the lease (safe tokens/s x TTL)."""
    kv_tokens: int = 0
    """KV-cache tokens borrowed requests may hold (their input plus expected output)."""
    transfer_tokens: int = 0
    """KV volume that may be pulled into the node (e.g. a cached prefix fetched from a prefill worker)."""
    decode_tokens: int = 0
    """Expected future decode work: sum of expected output tokens the borrowed requests bring."""
    tasks: int = 0
    """Number of temporary (borrowed prefill) tasks."""

    def __post_init__(self) -> None:
        # Fast path: plain non-negative ints (the scheduler's hot path builds many of these).
        p, k, t, d, n = (
            self.prefill_tokens,
            self.kv_tokens,
            self.transfer_tokens,
            self.decode_tokens,
            self.tasks,
        )
        if (
            type(p) is int
            and type(k) is int
            and type(t) is int
            and type(d) is int
            and type(n) is int
            and p >= 0
            and k >= 0
            and t >= 0
            and d >= 0
            and n >= 0
        ):
            return
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"LeaseBudgets.{f.name} must be an integer, got {value!r}")
            if isinstance(value, numbers.Integral):
                as_int: int | None = int(value)
            else:
                as_float = float(value)
                as_int = int(as_float) if math.isfinite(as_float) and as_float.is_integer() else None
            if as_int is None:
                raise ValueError(f"LeaseBudgets.{f.name} must be an integer, got {value!r}")
            if as_int < 0:
                raise ValueError(f"LeaseBudgets.{f.name} must be >= 0, got {value!r}")
            # Frozen: normalise numpy / float integers to plain int so equality and JSON are exact.
            object.__setattr__(self, f.name, as_int)

    @classmethod
    def zero(cls) -> LeaseBudgets:
        """All budgets zero: "no lease" (one shared instance: budgets are immutable)."""
        return _ZERO if cls is LeaseBudgets else cls()

    @classmethod
    def from_dict(cls, values: Mapping[str, int], *, source: str = "budgets") -> LeaseBudgets:
        """Build from a mapping with exactly the five field names; ``source`` names it in errors."""
        unknown = set(values) - set(BUDGET_FIELDS)
        if unknown:
            raise ValueError(f"{source}: unknown budget field(s) {sorted(unknown)}; expected {BUDGET_FIELDS}")
        missing = set(BUDGET_FIELDS) - set(values)
        if missing:
            raise ValueError(f"{source}: missing budget field(s) {sorted(missing)}")
        try:
            return cls(**{name: values[name] for name in BUDGET_FIELDS})
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @staticmethod
    def total(items: Iterable[LeaseBudgets]) -> LeaseBudgets:
        """Element-wise sum (zero for an empty iterable)."""
        p = k = t = d = n = 0
        count = 0
        for item in items:
            p += item.prefill_tokens
            k += item.kv_tokens
            t += item.transfer_tokens
            d += item.decode_tokens
            n += item.tasks
            count += 1
        return LeaseBudgets(p, k, t, d, n) if count else _ZERO

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in BUDGET_FIELDS}

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.prefill_tokens, self.kv_tokens, self.transfer_tokens, self.decode_tokens, self.tasks)

    def is_zero(self) -> bool:
        return not (
            self.prefill_tokens or self.kv_tokens or self.transfer_tokens or self.decode_tokens or self.tasks
        )

    def fits_within(self, limit: LeaseBudgets) -> bool:
        """True when every budget is ``<=`` the corresponding budget of ``limit``."""
        return (
            self.prefill_tokens <= limit.prefill_tokens
            and self.kv_tokens <= limit.kv_tokens
            and self.transfer_tokens <= limit.transfer_tokens
            and self.decode_tokens <= limit.decode_tokens
            and self.tasks <= limit.tasks
        )

    def __add__(self, other: LeaseBudgets) -> LeaseBudgets:
        if other is _ZERO:  # budgets are immutable: adding nothing is the operand itself
            return self
        if self is _ZERO:
            return other
        return LeaseBudgets(
            self.prefill_tokens + other.prefill_tokens,
            self.kv_tokens + other.kv_tokens,
            self.transfer_tokens + other.transfer_tokens,
            self.decode_tokens + other.decode_tokens,
            self.tasks + other.tasks,
        )

    def __sub__(self, other: LeaseBudgets) -> LeaseBudgets:
        """Checked subtraction: raises ``ValueError`` naming the field that would go negative."""
        for name, a, b in zip(BUDGET_FIELDS, self.as_tuple(), other.as_tuple(), strict=True):
            if b > a:
                raise ValueError(f"LeaseBudgets subtraction would make {name} negative ({a} - {b})")
        return LeaseBudgets(*(a - b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def saturating_sub(self, other: LeaseBudgets) -> LeaseBudgets:
        """Element-wise ``max(0, self - other)``: what is left, never negative."""
        return LeaseBudgets(*(max(0, a - b) for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def minimum(self, other: LeaseBudgets) -> LeaseBudgets:
        """Element-wise minimum."""
        return LeaseBudgets(*(min(a, b) for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))


_ZERO = LeaseBudgets()


@dataclass(frozen=True, slots=True)
class Lease:
    """One node's current capacity promise.

    Contract: a reservation is only spendable while its epoch equals the node's current lease epoch
    and ``now_s < expires_s``. Epochs only grow, so a superseded or revoked lease can never be spent.
    """

    node_id: int
    epoch: int
    """Monotone per node: every publish and every revocation issues a new epoch."""
    budgets: LeaseBudgets
    issued_s: float
    ttl_s: float

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"Lease.epoch must be >= 0, got {self.epoch}")
        if not self.ttl_s > 0:
            raise ValueError(f"Lease.ttl_s must be > 0, got {self.ttl_s}")

    @property
    def expires_s(self) -> float:
        return self.issued_s + self.ttl_s

    def is_live(self, now_s: float) -> bool:
        """True while the lease can still be reserved against or committed (``now_s < expires_s``)."""
        return now_s < self.expires_s

    def to_dict(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "epoch": self.epoch,
            "budgets": self.budgets.to_dict(),
            "issued_s": self.issued_s,
            "ttl_s": self.ttl_s,
            "expires_s": self.expires_s,
        }

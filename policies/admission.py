"""Node-side admission: how much borrowed prefill a decode node may run, and when KV fits.

The same code runs in the simulator, the emulated workers and the SGLang worker plugin, so a lease
binds identically everywhere.

* ``LeaseTokenBucket``: borrowed prefill tokens are spent from credit that the node's live lease
  earns at ``lease.budgets.prefill_tokens / lease.ttl_s`` tokens per second, only while the lease is
  live. Fractional credit carries over; there is no floor, so a zero lease means zero borrowed work,
  and the tokens spent up to any moment never exceed what the leases granted up to it (the ledger
  counts the grant independently: ``LeaseLedger.granted_prefill_tokens``). Saved credit is capped at
  ``burst_s`` seconds of the current rate so a node cannot hoard an idle minute's credit.
* ``borrowed_chunk_tokens``: the tokens of borrowed prefill one iteration may mix in.
* ``prealloc_fits``: SGLang's decode pre-allocation rule (``DecodePreallocQueue.
  _allocatable_token_budgets`` in 0.5.23's ``sglang/srt/disaggregation/decode.py``): a request may
  take KV only if what is left after ``num_reserved_decode_tokens`` for every active request and
  the KV that lease reservations still hold covers its own tokens plus its reservation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_CREDIT_TOLERANCE = 1e-6
"""Credit within this many tokens of a whole number counts as that number (float accrual error)."""


@dataclass(slots=True)
class LeaseTokenBucket:
    """Borrowed-prefill credit of one node (see the module docstring). Times in seconds."""

    burst_s: float = 0.5
    """Credit is capped at this many seconds of the current lease rate."""
    credit_tokens: float = 0.0
    rate_tokens_per_s: float = 0.0
    expires_s: float = 0.0
    """Credit accrues only before this time (the lease's expiry)."""
    updated_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.burst_s > 0:
            raise ValueError(f"LeaseTokenBucket.burst_s must be > 0, got {self.burst_s!r}")

    def advance(self, now_s: float) -> None:
        """Accrue credit up to ``now_s`` (never past the lease's expiry)."""
        if now_s <= self.updated_s:
            return
        live_s = min(now_s, self.expires_s) - self.updated_s
        if live_s > 0 and self.rate_tokens_per_s > 0:
            cap = self.rate_tokens_per_s * self.burst_s
            self.credit_tokens = min(cap, self.credit_tokens + self.rate_tokens_per_s * live_s)
        self.updated_s = now_s

    def set_lease(self, now_s: float, rate_tokens_per_s: float, expires_s: float) -> None:
        """The node's lease changed at ``now_s`` (a refresh, a revocation to zero, an expiry)."""
        if rate_tokens_per_s < 0 or not math.isfinite(rate_tokens_per_s):
            raise ValueError(f"lease rate must be finite and >= 0, got {rate_tokens_per_s!r}")
        self.advance(now_s)
        self.rate_tokens_per_s = rate_tokens_per_s
        self.expires_s = expires_s
        self.credit_tokens = min(self.credit_tokens, rate_tokens_per_s * self.burst_s)

    def available_tokens(self, now_s: float) -> int:
        """Whole tokens that may be spent now."""
        self.advance(now_s)
        return int(self.credit_tokens + _CREDIT_TOLERANCE)

    def spend(self, tokens: int, now_s: float) -> None:
        """Take ``tokens`` of credit; raises ``ValueError`` when that would overspend."""
        if tokens < 0:
            raise ValueError(f"cannot spend a negative number of tokens ({tokens})")
        if tokens > self.available_tokens(now_s):
            raise ValueError(f"spending {tokens} borrowed tokens with {self.credit_tokens:.3f} of credit")
        self.credit_tokens = max(0.0, self.credit_tokens - tokens)

    def seconds_until(self, tokens: int, now_s: float) -> float:
        """Time from ``now_s`` until ``tokens`` of credit are available (``inf`` if the lease cannot
        earn them before it expires, or they exceed the burst cap)."""
        self.advance(now_s)
        missing = tokens - self.credit_tokens
        if missing <= _CREDIT_TOLERANCE:
            return 0.0
        if self.rate_tokens_per_s <= 0 or tokens > self.rate_tokens_per_s * self.burst_s + _CREDIT_TOLERANCE:
            return math.inf
        wait_s = missing / self.rate_tokens_per_s
        return wait_s if now_s + wait_s <= self.expires_s else math.inf


def borrowed_chunk_tokens(available_tokens: int, remaining_tokens: int, min_chunk_tokens: int) -> int:
    """Borrowed prefill tokens one iteration takes: all the credit (up to the work left), but only once
    the credit covers ``min_chunk_tokens`` or the whole remainder — a node does not run iterations of a
    handful of tokens; it waits for credit instead. Never more than ``available_tokens``."""
    if available_tokens <= 0 or remaining_tokens <= 0:
        return 0
    if available_tokens < min(min_chunk_tokens, remaining_tokens):
        return 0
    return min(available_tokens, remaining_tokens)


def prealloc_fits(
    *,
    free_tokens: int,
    active_requests: int,
    need_tokens: int,
    reserved_decode_tokens: int,
    lease_reserved_kv_tokens: int = 0,
    retracted_tokens: int = 0,
) -> bool:
    """SGLang's decode pre-allocation check (see the module docstring).

    ``free_tokens``: KV not allocated (evictable prefix cache counts as free); ``active_requests``:
    requests already holding decode KV (transferring, waiting, running, borrowed and started);
    ``need_tokens``: KV the new request allocates now; ``lease_reserved_kv_tokens``: KV that lease
    reservations on the node hold for borrowed work that has not allocated yet (so PD admissions and
    borrowed prefill never over-commit the node); ``retracted_tokens``: KV that retracted requests
    need to resume (they go first, as in SGLang).
    """
    allocatable = (
        free_tokens - reserved_decode_tokens * active_requests - lease_reserved_kv_tokens - retracted_tokens
    )
    return allocatable >= need_tokens + reserved_decode_tokens


__all__ = ["LeaseTokenBucket", "borrowed_chunk_tokens", "prealloc_fits"]

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
* ``borrowed_demand``: what one borrowed request holds on its node's lease (the five budgets).
* ``borrowed_start_blocked``: decode first: why a borrowed prefill that has not started must wait.
* ``LocalPrefillAdmission``: a lending node's own view of its lease (a one-node ``LeaseLedger`` and
  the ``LeaseTokenBucket``), for a node that re-checks borrowed work itself (the SGLang worker
  plugin): ``try_admit(...) -> AdmitOutcome`` reserves a request's demand or says which budget fell
  short, and the request's life cycle (start, prefill done, finish, cancel) returns the budgets as the
  cluster scheduler does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from policies.chunk_limits import ChunkLimits, capped_chunk_tokens
from policies.lease import BUDGET_FIELDS, Lease, LeaseBudgets
from policies.ledger import LeaseLedger
from policies.node_policies import DecodePressureRule
from policies.node_state import NodeState
from policies.slo import DEFAULT_CONTROL_INTERVAL_S

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


def borrowed_demand(
    input_tokens: int, expected_output_tokens: int, *, cached_tokens: int = 0, pull_tokens: int = 0
) -> LeaseBudgets:
    """What a borrowed request holds on its node's lease: the prompt tokens it computes (at least one:
    the last prompt token is always computed), the KV of its input and expected output, the prefix it
    pulls from a prefill worker, its expected decode work and one task slot.

    ``cached_tokens``: prompt tokens already in the node's cache; ``pull_tokens``: prompt tokens pulled
    from a prefill worker's cache instead of computed. Raises ``ValueError`` for negative counts or
    when cached and pulled tokens exceed the prompt.
    """
    if min(input_tokens, expected_output_tokens, cached_tokens, pull_tokens) < 0:
        raise ValueError(
            f"borrowed_demand: token counts must be >= 0 (input {input_tokens}, output "
            f"{expected_output_tokens}, cached {cached_tokens}, pull {pull_tokens})"
        )
    if cached_tokens + pull_tokens > input_tokens:
        raise ValueError(
            f"borrowed_demand: cached ({cached_tokens}) + pulled ({pull_tokens}) tokens exceed the "
            f"prompt ({input_tokens})"
        )
    return LeaseBudgets(
        prefill_tokens=max(1, input_tokens - cached_tokens - pull_tokens),
        kv_tokens=input_tokens + expected_output_tokens,
        transfer_tokens=pull_tokens,
        decode_tokens=expected_output_tokens,
        tasks=1,
    )


def borrowed_start_blocked(
    *, waiting_to_join: int, waiting_for_kv: int, retracted: int, running: int, max_running: int
) -> str | None:
    """Decode first: why a borrowed prefill that has not started must wait now, or ``None``.

    A node starts no borrowed work while decode requests wait: requests whose KV arrived and have not
    joined the batch (``waiting_to_join``), requests waiting for KV pre-allocation
    (``waiting_for_kv``), retracted requests waiting to resume, or a full running batch. Started
    borrowed work is not affected (it holds its KV already).
    """
    if retracted > 0:
        return f"{retracted} retracted decode request(s) wait to resume"
    if waiting_to_join > 0:
        return f"{waiting_to_join} decode request(s) with their KV wait to join the batch"
    if waiting_for_kv > 0:
        return f"{waiting_for_kv} decode request(s) wait for KV pre-allocation"
    if running >= max_running:
        return f"the running batch is full ({running} of {max_running})"
    return None


def min_borrowed_chunk_tokens(bucket: LeaseTokenBucket, page_tokens: int) -> int:
    """The smallest borrowed chunk worth an iteration: a page, or all the credit the bucket can hold."""
    return max(1, min(page_tokens, int(bucket.rate_tokens_per_s * bucket.burst_s)))


class AdmitResult(Enum):
    """Why ``LocalPrefillAdmission.try_admit`` took or refused a borrowed request."""

    ADMITTED = "admitted"
    NO_LEASE = "no_lease"
    """The node has no lease, it is zero, or it has expired."""
    NO_ROOM = "no_room"
    """The live lease cannot hold the request beside what is already held (see ``short``)."""


@dataclass(frozen=True, slots=True)
class AdmitOutcome:
    """The answer to one borrowed request: a reservation, or the reason and the budgets that fell short."""

    result: AdmitResult
    demand: LeaseBudgets
    reservation_id: int | None = None
    short: tuple[str, ...] = ()
    """Budget names (``BUDGET_FIELDS`` order) on which the demand exceeds what is available."""
    available: LeaseBudgets = field(default_factory=LeaseBudgets.zero)
    """What the lease had left when the request was refused (zero when admitted)."""

    @property
    def admitted(self) -> bool:
        return self.result is AdmitResult.ADMITTED

    def reason(self) -> str:
        """One line saying why (for logs and the abort message a router sees)."""
        if self.result is AdmitResult.ADMITTED:
            return f"admitted as reservation {self.reservation_id}"
        if self.result is AdmitResult.NO_LEASE:
            return "no live lease on this node"
        need, have = self.demand.to_dict(), self.available.to_dict()
        parts = ", ".join(f"{name} {need[name]} > {have[name]} left" for name in self.short)
        return f"the lease cannot hold it ({parts})"


@dataclass
class LocalPrefillAdmission:
    """A lending node's own view of its lease: admits borrowed requests and paces their prefill.

    The node installs each lease it is given (``install_lease``: a new epoch; un-started reservations
    that no longer fit are revoked, started ones keep counting, as in ``LeaseLedger.publish``) and asks
    ``try_admit`` for every borrowed request, which reserves the request's whole demand or nothing.
    The token bucket earns the lease's prefill rate while the lease is live; ``chunk_tokens`` says how
    many borrowed tokens the next iteration may compute and ``spend`` pays for them. A reservation's
    life: ``start`` (commit; ``False`` means its lease lapsed and it must not run) -> ``prefill_done``
    (compute, transfer and the task slot come back) -> ``finish`` (KV and decode work come back), or
    ``cancel`` before it starts. Times are seconds on the node's clock; not thread-safe beyond the
    ledger's own lock (one scheduler loop drives it).
    """

    node_id: int = 0
    burst_s: float = DEFAULT_CONTROL_INTERVAL_S
    """The bucket holds at most this many seconds of the lease's rate (the simulator uses the control
    interval)."""
    ledger: LeaseLedger = field(default_factory=LeaseLedger)
    bucket: LeaseTokenBucket = field(init=False)
    chunk_limits: ChunkLimits | None = field(default=None, init=False)
    """The per-iteration cap the lease's policy set (``install_lease``); ``None``: the bucket alone
    paces borrowed prefill."""
    pressure_rule: DecodePressureRule | None = field(default=None, init=False)
    """The lease's policy's decode-pressure test (``install_lease``): an un-started borrowed request
    waits while it holds (``start_paused``); ``None``: none sent, requests start when they fit."""

    def __post_init__(self) -> None:
        self.bucket = LeaseTokenBucket(burst_s=self.burst_s)

    # ---- the lease ----------------------------------------------------------------------------
    def install_lease(
        self,
        budgets: LeaseBudgets,
        ttl_s: float,
        now_s: float,
        *,
        chunk_limits: ChunkLimits | None = None,
        pressure_rule: DecodePressureRule | None = None,
    ) -> list[int]:
        """Make ``budgets`` the node's lease for ``[now_s, now_s + ttl_s)``, ``chunk_limits`` the cap
        on each borrowed iteration and ``pressure_rule`` the test that holds un-started borrowed
        requests back (``None``: none); returns the un-started reservations revoked because they no
        longer fit (in id order)."""
        self.chunk_limits = chunk_limits
        self.pressure_rule = pressure_rule
        before = set(self.ledger.pending_ids(self.node_id))
        lease = self.ledger.publish(self.node_id, budgets, now_s, ttl_s)
        self.bucket.set_lease(now_s, budgets.prefill_tokens / ttl_s, lease.expires_s)
        return sorted(before - set(self.ledger.pending_ids(self.node_id)))

    def revoke(self, now_s: float) -> list[int]:
        """Shrink the lease to zero now (decode pressure); returns the un-started reservations revoked.
        The chunk limits and the pressure rule stay: started work keeps the cap it had."""
        revoked = self.ledger.revoke(self.node_id, now_s)
        lease = self.ledger.lease(self.node_id)
        self.bucket.set_lease(now_s, 0.0, now_s if lease is None else lease.expires_s)
        return revoked

    def start_paused(self, state: NodeState) -> str | None:
        """Why an un-started borrowed request must wait now (the lease's ``pressure_rule`` on the
        node's ``state``: decode needs the node), or ``None``: it may start. The in-process node's
        ``pause`` verdict; the request is asked again later, and a revocation ends the wait."""
        return None if self.pressure_rule is None else self.pressure_rule.reason(state)

    def lease(self) -> Lease | None:
        """The node's current lease (possibly expired or zero), ``None`` before the first."""
        return self.ledger.lease(self.node_id)

    def is_live(self, now_s: float) -> bool:
        lease = self.ledger.lease(self.node_id)
        return lease is not None and lease.is_live(now_s) and not lease.budgets.is_zero()

    def expire(self, now_s: float) -> list[int]:
        """Close the un-started reservations whose lease has run out by ``now_s``; returns their ids."""
        return self.ledger.expire(now_s)

    # ---- admission ----------------------------------------------------------------------------
    def try_admit(
        self, input_tokens: int, expected_output_tokens: int, now_s: float, *, cached_tokens: int = 0
    ) -> AdmitOutcome:
        """Reserve a borrowed request's demand (``borrowed_demand``) on the node's live lease, or say
        why not: no live lease, or the budgets (tasks, KV, compute, ...) that cannot hold it."""
        demand = borrowed_demand(input_tokens, expected_output_tokens, cached_tokens=cached_tokens)
        if not self.is_live(now_s):
            return AdmitOutcome(AdmitResult.NO_LEASE, demand)
        reservation = self.ledger.reserve(self.node_id, demand, now_s)
        if reservation is not None:
            return AdmitOutcome(AdmitResult.ADMITTED, demand, reservation.reservation_id)
        available = self.ledger.available(self.node_id, now_s)
        short = tuple(
            name
            for name, need, have in zip(BUDGET_FIELDS, demand.as_tuple(), available.as_tuple(), strict=True)
            if need > have
        )
        return AdmitOutcome(AdmitResult.NO_ROOM, demand, short=short, available=available)

    def is_pending(self, reservation_id: int, now_s: float) -> bool:
        """The reservation may still start (not revoked, not expired, not started yet)."""
        return self.ledger.is_spendable(reservation_id, now_s) and (
            self.ledger.status(reservation_id) == "reserved"
        )

    def start(self, reservation_id: int, now_s: float) -> bool:
        """Commit the reservation as its prefill starts; ``False``: it can no longer run here."""
        return self.ledger.commit(reservation_id, now_s)

    def prefill_done(self, reservation_id: int) -> None:
        """The prompt is computed: return compute, transfer and the task slot; KV and decode stay held."""
        held = self.ledger.held_by(reservation_id)
        part = LeaseBudgets(
            prefill_tokens=held.prefill_tokens, transfer_tokens=held.transfer_tokens, tasks=held.tasks
        )
        if not part.is_zero():
            self.ledger.release(reservation_id, part)  # closes it when nothing else is held

    def finish(self, reservation_id: int) -> None:
        """The request left the node (finished or aborted after it started): return everything."""
        if self.ledger.status(reservation_id) in ("reserved", "committed"):
            self.ledger.release(reservation_id)

    cancel = finish
    """A request that will not start here (refused later, aborted, fell back) gives its budgets back."""

    def unstarted_kv_tokens(self, exclude: int | None = None) -> int:
        """KV tokens reservations that have not started hold (optionally but one): the room the node
        keeps out of its decode pre-allocation budget."""
        held = self.ledger.held(self.node_id, committed=False).kv_tokens
        if exclude is not None and self.ledger.status(exclude) == "reserved":
            held -= self.ledger.held_by(exclude).kv_tokens
        return held

    def held(self) -> LeaseBudgets:
        """Everything active reservations hold on the node."""
        return self.ledger.held(self.node_id)

    # ---- pacing -------------------------------------------------------------------------------
    def chunk_tokens(
        self,
        remaining_tokens: int,
        max_chunk_tokens: int,
        page_tokens: int,
        now_s: float,
        *,
        decode_batch: int = 0,
        decode_context_tokens: int = 0,
    ) -> int:
        """Borrowed prefill tokens the next iteration may compute beside a running batch of
        ``decode_batch`` requests (``decode_context_tokens`` of KV in all): ``borrowed_chunk_tokens``
        over the bucket's credit, at most ``max_chunk_tokens`` and the lease's ``chunk_limits`` for
        that batch (``capped_chunk_tokens``, as the simulator caps it); 0 means wait for credit."""
        min_chunk = min_borrowed_chunk_tokens(self.bucket, page_tokens)
        limit = self.chunk_limit(decode_batch, decode_context_tokens)
        max_chunk_tokens = capped_chunk_tokens(limit, max_chunk_tokens, min_chunk)
        return borrowed_chunk_tokens(
            min(self.bucket.available_tokens(now_s), max_chunk_tokens), remaining_tokens, min_chunk
        )

    def chunk_limit(self, decode_batch: int, decode_context_tokens: int) -> int | None:
        """The lease's cap for that running batch (``None``: no cap)."""
        return (
            None
            if self.chunk_limits is None
            else self.chunk_limits.limit(decode_batch, decode_context_tokens)
        )

    def spend(self, tokens: int, now_s: float) -> None:
        """Pay for ``tokens`` borrowed prefill tokens computed now (``ValueError`` if it overspends)."""
        self.bucket.spend(tokens, now_s)


__all__ = [
    "AdmitOutcome",
    "AdmitResult",
    "LeaseTokenBucket",
    "LocalPrefillAdmission",
    "borrowed_chunk_tokens",
    "borrowed_demand",
    "borrowed_start_blocked",
    "min_borrowed_chunk_tokens",
    "prealloc_fits",
]

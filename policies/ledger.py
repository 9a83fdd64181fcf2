"""The lease ledger: atomic reservations against each node's current lease.

Life of a reservation::

    reserve ──► reserved ──commit──► committed ──release (all of it)──► released
                   │                     └── release(part) keeps the rest held
                   ├── release ──► released      (the caller gave up before starting)
                   ├── revoke / publish (does not fit the new lease) ──► revoked ──reinstate──► committed
                   └── lease expired (expire(), or lazily at commit) ──► expired

Rules (the contract the property tests check):

* ``reserve`` takes all five budgets at once or nothing: it succeeds only if the lease is live and
  the node's held total (every active reservation, committed or not) plus the demand fits within the
  lease on *every* budget.
* ``publish`` supersedes the node's lease (epoch + 1). Committed reservations keep counting against
  the new lease until released, even if that over-commits it (work that has started is never dropped;
  ``available`` is then zero). Un-committed reservations are **carried over** in reservation order
  while they fit beside the committed ones, and **revoked** otherwise; ``revoke`` (shrink, possibly to
  zero) applies the same rule to a smaller lease.
* A reservation whose lease has expired, or that was revoked, can never be committed: ``commit``
  returns ``False`` (the caller falls back to the normal path). Unknown ids raise ``KeyError``.
* Therefore, on every node at every moment: if any un-committed reservation is active, the held total
  fits within the current lease; otherwise only committed work (admitted under some lease) is held.
* The one exception: ``reinstate`` re-opens a revoked reservation as committed, holding what it
  held. Its node had started it before the revocation reached it (a router's ledger learns of
  starts from the nodes' reports, a little after they happen). Like any committed work it may
  over-commit the lease. Un-committed reservations already beside it stay until the node's next
  ``publish`` or ``revoke``, which carries over only those that fit. Nothing new can be reserved
  on the node meanwhile.

All methods take a per-instance re-entrant lock, so an HTTP router's threads cannot double-spend.
Everything is deterministic: ids count up from 1 per ledger, carry-over walks reservations in id order.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from policies.lease import Lease, LeaseBudgets

ReservationStatus = Literal["reserved", "committed", "released", "revoked", "expired"]

REINSTATABLE = 4096
"""How many of the latest revoked reservations a ledger keeps so that ``reinstate`` can re-open them
(a node's report of a start comes within a control interval or two)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """A successful reservation: what was asked for, on which node and lease epoch, and when."""

    reservation_id: int
    node_id: int
    epoch: int
    """Lease epoch it was made against (updated when it is carried over to a newer lease)."""
    demand: LeaseBudgets
    reserved_s: float


@dataclass(slots=True)
class _Entry:
    reservation: Reservation
    held: LeaseBudgets
    """What it still holds (shrinks on a partial release)."""
    committed: bool = False


class LeaseLedger:
    """Holds each node's current lease and the reservations against it. See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._leases: dict[int, Lease] = {}
        self._active: dict[int, _Entry] = {}
        self._by_node: dict[int, dict[int, _Entry]] = {}
        """The active entries of each node, in reservation-id order (ids only grow)."""
        # Terminal states are kept so a late commit/arrival on a revoked id answers False, not KeyError.
        self._closed: dict[int, ReservationStatus] = {}
        self._revoked: OrderedDict[int, _Entry] = OrderedDict()
        """The latest revoked entries (at most ``REINSTATABLE``), which ``reinstate`` may re-open."""
        self._next_id = 1
        # Prefill tokens granted per node by leases no longer current, and when the current one began.
        self._granted_closed: dict[int, float] = {}
        self._grant_from_s: dict[int, float] = {}

    # ---- leases -------------------------------------------------------------------------------
    def publish(self, node_id: int, budgets: LeaseBudgets, now_s: float, ttl_s: float) -> Lease:
        """Issue ``node_id``'s next lease (epoch + 1) valid for ``[now_s, now_s + ttl_s)``.

        Un-committed reservations that no longer fit are revoked (see ``pending_ids`` to learn which).
        """
        with self._lock:
            previous = self._leases.get(node_id)
            lease = Lease(node_id, 0 if previous is None else previous.epoch + 1, budgets, now_s, ttl_s)
            self._install(lease, now_s, previous)
            return lease

    def revoke(self, node_id: int, now_s: float, shrink_to: LeaseBudgets | None = None) -> list[int]:
        """Shrink ``node_id``'s lease to ``shrink_to`` (default: zero) under a new epoch, same expiry.

        Returns the ids of the un-committed reservations revoked because they no longer fit (in id
        order). Committed work keeps counting. Raises ``ValueError`` if ``shrink_to`` would grow any
        budget (use ``publish`` to grow). A node without a lease returns ``[]``.
        """
        with self._lock:
            current = self._leases.get(node_id)
            if current is None:
                return []
            target = LeaseBudgets.zero() if shrink_to is None else shrink_to
            if not target.fits_within(current.budgets):
                raise ValueError(
                    f"revoke(node_id={node_id}): shrink_to {target.to_dict()} exceeds the current lease "
                    f"{current.budgets.to_dict()}; revoke only shrinks"
                )
            before = set(self.pending_ids(node_id))
            lease = Lease(node_id, current.epoch + 1, target, current.issued_s, current.ttl_s)
            self._install(lease, now_s, current)
            return sorted(before - set(self.pending_ids(node_id)))

    def expire(self, now_s: float) -> list[int]:
        """Close every un-committed reservation whose lease has expired by ``now_s``; return their ids.

        Expired leases stay recorded (``available`` is zero) until the node publishes again.
        """
        with self._lock:
            expired = self._unpaid(now_s, committed=False)
            for rid in expired:
                self._close(rid, "expired")
            return expired

    def lapsed(self, now_s: float) -> list[int]:
        """Committed (started) reservations on nodes whose lease has expired by ``now_s``, in id order.

        Nothing pays for that work any more: a node aborts it before its first token and the request
        falls back to the normal path (``LocalPrefill._abort_stalled_chunk``). A lease revoked to zero
        keeps its expiry, so started work waits for a new lease until then. Left active here: the
        caller releases each one as its node drops it (``release``).
        """
        with self._lock:
            return self._unpaid(now_s, committed=True)

    def lease(self, node_id: int) -> Lease | None:
        """The node's current lease (possibly expired or zero), or ``None`` if it never published."""
        with self._lock:
            return self._leases.get(node_id)

    def granted_prefill_tokens(self, node_id: int, now_s: float) -> float:
        """Prefill tokens the node's leases granted from its first lease up to ``now_s``.

        A lease grants ``budgets.prefill_tokens / ttl_s`` tokens per second from the moment it becomes
        current until it is superseded (a publish or a revocation) or expires, whichever is first.
        This is the denominator of lease utilisation, counted here independently of whoever spends.
        """
        with self._lock:
            lease = self._leases.get(node_id)
            if lease is None:
                return 0.0
            return self._granted_closed.get(node_id, 0.0) + _grant(lease, self._grant_from_s[node_id], now_s)

    def node_ids(self) -> list[int]:
        """Nodes that have ever published, ascending."""
        with self._lock:
            return sorted(self._leases)

    # ---- reservations ---------------------------------------------------------------------------
    def reserve(self, node_id: int, demand: LeaseBudgets, now_s: float) -> Reservation | None:
        """Atomically reserve all of ``demand`` on ``node_id``'s live lease, or return ``None``."""
        with self._lock:
            lease = self._leases.get(node_id)
            if lease is None or not lease.is_live(now_s):
                return None
            if not (self.held(node_id) + demand).fits_within(lease.budgets):
                return None
            res = Reservation(self._next_id, node_id, lease.epoch, demand, now_s)
            self._next_id += 1
            entry = _Entry(res, demand)
            self._active[res.reservation_id] = entry
            self._by_node.setdefault(node_id, {})[res.reservation_id] = entry
            return res

    def commit(self, reservation_id: int, now_s: float) -> bool:
        """Mark the reservation as started. Idempotent for committed ones.

        Returns ``False`` (and the reservation stays closed) when it was revoked, expired or its lease
        expired by ``now_s``; raises ``KeyError`` for an id never issued or already released.
        """
        with self._lock:
            entry = self._active.get(reservation_id)
            if entry is None:
                status = self.status(reservation_id)
                if status == "released":
                    raise KeyError(f"reservation {reservation_id} was already released")
                return False
            if entry.committed:
                return True
            lease = self._leases[entry.reservation.node_id]
            if not lease.is_live(now_s):
                self._close(reservation_id, "expired")
                return False
            # Carry-over rewrites the epoch; a mismatch here would be a ledger bug, not a caller error.
            assert entry.reservation.epoch == lease.epoch, "active reservation on a stale epoch"
            entry.committed = True
            return True

    def reinstate(self, reservation_id: int) -> bool:
        """Re-open a revoked reservation as committed, holding what it held when revoked, on its node's
        current lease: the node started it before the revocation reached it, so its work goes on and
        counts like any committed work (it may over-commit the lease). ``False`` (nothing done) unless
        it was revoked (and is among the latest ``REINSTATABLE`` revoked); ``KeyError`` for an id never
        issued."""
        with self._lock:
            if self.status(reservation_id) != "revoked":
                return False
            entry = self._revoked.pop(reservation_id, None)
            if entry is None:
                return False
            node_id = entry.reservation.node_id
            old = entry.reservation
            entry.reservation = Reservation(
                reservation_id, node_id, self._leases[node_id].epoch, old.demand, old.reserved_s
            )
            entry.committed = True
            del self._closed[reservation_id]
            self._active[reservation_id] = entry
            entries = self._by_node.setdefault(node_id, {})
            entries[reservation_id] = entry
            self._by_node[node_id] = dict(sorted(entries.items()))  # keep id order
            return True

    def is_spendable(self, reservation_id: int, now_s: float) -> bool:
        """True if the reservation is active and either committed or still committable at ``now_s``.

        Lazily expires an un-committed reservation whose lease has run out.
        """
        with self._lock:
            entry = self._active.get(reservation_id)
            if entry is None:
                return False
            if entry.committed:
                return True
            if not self._leases[entry.reservation.node_id].is_live(now_s):
                self._close(reservation_id, "expired")
                return False
            return True

    def release(self, reservation_id: int, part: LeaseBudgets | None = None) -> None:
        """Return ``part`` of what the reservation holds (default: all of it) to its node.

        When nothing is left held the reservation closes as ``released``. Raises ``KeyError`` if the
        reservation is not active, ``ValueError`` if ``part`` exceeds what it holds.
        """
        with self._lock:
            entry = self._active.get(reservation_id)
            if entry is None:
                raise KeyError(
                    f"reservation {reservation_id} is not active (status: {self._closed.get(reservation_id)})"
                )
            remaining = LeaseBudgets.zero() if part is None else entry.held - part
            if remaining.is_zero():
                self._close(reservation_id, "released")
            else:
                entry.held = remaining

    def status(self, reservation_id: int) -> ReservationStatus:
        """Current state of a reservation; ``KeyError`` for an id this ledger never issued."""
        with self._lock:
            entry = self._active.get(reservation_id)
            if entry is not None:
                return "committed" if entry.committed else "reserved"
            if reservation_id in self._closed:
                return self._closed[reservation_id]
            raise KeyError(f"reservation {reservation_id} was never issued by this ledger")

    def get(self, reservation_id: int) -> Reservation:
        """The active reservation with this id (``KeyError`` if not active)."""
        with self._lock:
            return self._active[reservation_id].reservation

    def held_by(self, reservation_id: int) -> LeaseBudgets:
        """What an active reservation still holds (``KeyError`` if not active)."""
        with self._lock:
            return self._active[reservation_id].held

    # ---- views ----------------------------------------------------------------------------------
    def held(self, node_id: int, *, committed: bool | None = None) -> LeaseBudgets:
        """Total held on ``node_id`` by active reservations (``committed`` filters: True/False/None=all)."""
        with self._lock:
            entries = self._by_node.get(node_id)
            if not entries:
                return LeaseBudgets.zero()
            return LeaseBudgets.total(
                e.held for e in entries.values() if committed is None or e.committed == committed
            )

    def available(self, node_id: int, now_s: float) -> LeaseBudgets:
        """What a new reservation could still take on ``node_id`` now (zero without a live lease)."""
        with self._lock:
            lease = self._leases.get(node_id)
            if lease is None or not lease.is_live(now_s):
                return LeaseBudgets.zero()
            return lease.budgets.saturating_sub(self.held(node_id))

    def has_active(self, node_id: int) -> bool:
        """Whether any reservation (committed or not) is active on ``node_id``."""
        with self._lock:
            return bool(self._by_node.get(node_id))

    def has_reservations(self) -> bool:
        """Whether any reservation (committed or not) is active on any node."""
        with self._lock:
            return bool(self._active)

    def pending_ids(self, node_id: int) -> list[int]:
        """Active, un-committed reservation ids on ``node_id`` in id order."""
        with self._lock:
            entries = self._by_node.get(node_id)
            if not entries:
                return []
            return [rid for rid, e in entries.items() if not e.committed]

    def active_ids(self, node_id: int | None = None) -> list[int]:
        """Active reservation ids (committed or not), optionally for one node, in id order."""
        with self._lock:
            return sorted(
                rid for rid, e in self._active.items() if node_id is None or e.reservation.node_id == node_id
            )

    # ---- internals ------------------------------------------------------------------------------
    def _unpaid(self, now_s: float, *, committed: bool) -> list[int]:
        """Active reservations, committed or not as asked, whose node's lease has expired by ``now_s``,
        in id order (``expire`` closes the un-committed ones; ``lapsed`` lists the committed ones)."""
        if not self._active:  # most control intervals: nothing reserved anywhere
            return []
        return sorted(
            rid
            for rid, e in self._active.items()
            if e.committed == committed and not self._leases[e.reservation.node_id].is_live(now_s)
        )

    def _install(self, lease: Lease, now_s: float, previous: Lease | None) -> None:
        """Make ``lease`` current in place of ``previous`` (the node's current lease, or ``None``);
        carry over the un-committed reservations that fit, revoke the rest."""
        node_id = lease.node_id
        if previous is not None:
            grant = _grant(previous, self._grant_from_s[node_id], now_s)
            self._granted_closed[node_id] = self._granted_closed.get(node_id, 0.0) + grant
        self._grant_from_s[node_id] = now_s
        self._leases[node_id] = lease
        if not self._by_node.get(node_id):
            return
        kept = self.held(node_id, committed=True)
        for rid in self.pending_ids(node_id):
            entry = self._active[rid]
            if (kept + entry.held).fits_within(lease.budgets):
                kept = kept + entry.held
                old = entry.reservation
                entry.reservation = Reservation(rid, node_id, lease.epoch, old.demand, old.reserved_s)
            else:
                self._close(rid, "revoked")

    def _close(self, reservation_id: int, status: ReservationStatus) -> None:
        entry = self._active.pop(reservation_id)
        del self._by_node[entry.reservation.node_id][reservation_id]
        self._closed[reservation_id] = status
        if status == "revoked":
            self._revoked[reservation_id] = entry
            if len(self._revoked) > REINSTATABLE:
                self._revoked.popitem(last=False)


def _grant(lease: Lease, since_s: float, now_s: float) -> float:
    """Prefill tokens ``lease`` grants over ``[since_s, min(now_s, expiry))``."""
    live_s = min(now_s, lease.expires_s) - since_s
    return lease.budgets.prefill_tokens / lease.ttl_s * live_s if live_s > 0 else 0.0

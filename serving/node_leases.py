"""The emulated decode nodes' lease side when their leases come over the wire, as on a real worker.

An SGLang decode worker running the Crossflow plugin holds no policy: the router's scheduler runs the
node policy on the states its lease agents report and pushes each node's lease to the worker
(``POST /set_internal_state`` with ``wire.lease_update_body``); the plugin installs it
(``policies.admission.LocalPrefillAdmission.install_lease``, or ``revoke`` for an all-zero one) and
checks every borrowed request against it. ``WireLeases`` is that node side for the emulated cluster's
simulator (``envs.live.LiveCluster(scheduler=WireLeases(n))``): the emulated decode workers answer
``/set_internal_state`` by installing the pushed lease here, and the simulator's hooks read it.

So the node's re-check is policy-independent: whichever policy the router serves, and after a policy
reload on its control plane, the node admits against the lease it was last sent, exactly what the
plugin does. What a node policy decides on the node in the in-process simulator reaches a wire-fed
node through its lease: the cap on each iteration's borrowed chunk from its ITL budget as the lease's
``ChunkLimits`` (the policy's answer tabulated by running batch, looked up before every borrowed
iteration), its decode-pressure test as the lease's ``DecodePressureRule`` (a borrowed request that
has not started waits while it holds, the in-process node's ``pause``), and decode pressure at a
control interval as a zero lease.

Hooks the simulator calls (``envs.simulator.SchedulerHooks``):

* ``on_control_interval``: no policy runs; returns the reservations revoked by leases installed since
  the last interval, those whose lease expired, and the started ones on a node whose lease expired
  (the plugin aborts those before their first token), which the simulator falls back;
* ``on_task_arrival``: ``fallback`` once the reservation is not spendable, ``pause`` while the
  lease's pressure rule holds on the node's state, else ``run``;
* start, prefill done, finish, fallback: the reservation's life in the node's ledger;
* ``borrowed_chunk_tokens``: the installed lease's ``ChunkLimits`` for the running batch (``None``
  without one), as the plugin's ``LocalPrefillAdmission.chunk_tokens`` caps it; ``choose_path`` is
  never called (requests arrive placed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.admission import LocalPrefillAdmission
from policies.chunk_limits import ChunkLimits
from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger
from policies.node_policies import DecodePressureRule
from policies.node_state import NodeState
from policies.slo import DEFAULT_CONTROL_INTERVAL_S


class WireLeases:
    """Leases installed over the wire on ``n_decode`` emulated decode nodes (see the module docstring).
    ``burst_s``: the plugin's token-bucket depth (its ``LocalPrefillAdmission.burst_s``)."""

    uses_gateway_decode_pick = False
    reconsiders_waiting = False

    def __init__(self, n_decode: int, *, burst_s: float = DEFAULT_CONTROL_INTERVAL_S) -> None:
        if n_decode < 1:
            raise ValueError(f"WireLeases needs at least one decode node, got {n_decode}")
        self.ledger = LeaseLedger()
        self.nodes = [
            LocalPrefillAdmission(node_id=j, burst_s=burst_s, ledger=self.ledger) for j in range(n_decode)
        ]
        self.installs = [0] * n_decode
        """Lease updates installed per node."""
        self._revoked: list[int] = []

    def _node(self, node_id: int) -> LocalPrefillAdmission:
        if not 0 <= node_id < len(self.nodes):
            raise ValueError(f"no decode node {node_id} (nodes 0..{len(self.nodes) - 1})")
        return self.nodes[node_id]

    # ---- the lease ------------------------------------------------------------------------------
    def install_lease(
        self,
        node_id: int,
        budgets: LeaseBudgets,
        ttl_s: float,
        now_s: float,
        *,
        chunk_limits: ChunkLimits | None = None,
        pressure_rule: DecodePressureRule | None = None,
    ) -> list[int]:
        """Install a pushed lease on ``node_id`` (all zero revokes) with its per-iteration cap on
        borrowed prefill (``chunk_limits``) and its decode-pressure test (``pressure_rule``), as the
        plugin installs them; the un-started reservations it revoked. ``LiveCluster.install_lease``
        falls back those queued on the node at once, as the plugin aborts them; any still in flight
        to it fall back on arrival (not spendable), and every one is also handed back at the next
        control interval (a no-op for those gone)."""
        node = self._node(node_id)
        if budgets.is_zero():
            revoked = node.revoke(now_s)
        else:
            revoked = node.install_lease(
                budgets, ttl_s, now_s, chunk_limits=chunk_limits, pressure_rule=pressure_rule
            )
        self.installs[node_id] += 1
        self._revoked.extend(revoked)
        return revoked

    def lease_rate(self, node_id: int) -> tuple[float, float]:
        """``(prefill tokens per second, expiry)`` of the node's lease; ``(0, 0)`` before the first."""
        lease = self._node(node_id).lease()
        if lease is None:
            return 0.0, 0.0
        return lease.budgets.prefill_tokens / lease.ttl_s, lease.expires_s

    def granted_prefill_tokens(self, node_id: int, now_s: float) -> float:
        return self.ledger.granted_prefill_tokens(node_id, now_s)

    def on_control_interval(self, now_s: float, states: Sequence[NodeState]) -> list[int]:
        revoked = self._revoked + self.ledger.expire(now_s)
        self._revoked = []
        # started borrowed work on a node whose lease ran out cannot be paid for: the plugin aborts it
        # with 503 before its first token (``LocalPrefill._abort_stalled_chunk``); so does this node
        revoked += self.ledger.lapsed(now_s)
        return sorted(set(revoked))

    # ---- borrowed requests ------------------------------------------------------------------------
    def on_task_arrival(self, reservation_id: int, state: NodeState, now_s: float) -> str:
        if not self.ledger.is_spendable(reservation_id, now_s):
            return "fallback"
        return "pause" if self._of(reservation_id).start_paused(state) else "run"

    def _of(self, reservation_id: int) -> LocalPrefillAdmission:
        return self._node(self.ledger.get(reservation_id).node_id)

    def on_task_started(self, reservation_id: int, now_s: float) -> bool:
        return self._of(reservation_id).start(reservation_id, now_s)

    def on_prefill_done(self, reservation_id: int) -> None:
        self._of(reservation_id).prefill_done(reservation_id)

    def on_request_finished(self, reservation_id: int) -> None:
        self._of(reservation_id).finish(reservation_id)

    def on_fallback(self, reservation_id: int) -> None:
        # a reservation the node revoked or let expire is closed already (the reason it falls back)
        if self.ledger.status(reservation_id) in ("reserved", "committed"):
            self._of(reservation_id).cancel(reservation_id)

    def unstarted_kv_tokens(self, node_id: int, exclude: int | None = None) -> int:
        return self._node(node_id).unstarted_kv_tokens(exclude)

    def pull_tokens(self, reservation_id: int) -> int:
        if self.ledger.status(reservation_id) not in ("reserved", "committed"):
            return 0  # revoked or expired since it was made: it falls back on arrival
        return self.ledger.held_by(reservation_id).transfer_tokens

    def borrowed_chunk_tokens(
        self, node_id: int, decode_batch: int, decode_context_tokens: int
    ) -> int | None:
        return self._node(node_id).chunk_limit(decode_batch, decode_context_tokens)

    def local_chunk_tokens(self, node_id: int) -> int:
        return 0

    # ---- never asked: requests arrive placed ---------------------------------------------------------
    def choose_path(self, query: Any, now_s: float) -> Any:
        raise RuntimeError("WireLeases: the emulated cluster's requests arrive placed by the router")

    def reconsider_path(self, query: Any, now_s: float) -> Any:
        return None


__all__ = ["WireLeases"]

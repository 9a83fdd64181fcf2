"""The plugin's Prometheus metrics, on the worker's own registry.

SGLang runs Prometheus in multiprocess mode when started with ``--enable-metrics``: every process
writes its samples under ``PROMETHEUS_MULTIPROC_DIR`` and the HTTP server's ``/metrics`` merges them
(``sglang.srt.utils.common.add_prometheus_middleware``). Metrics made in the scheduler process
therefore appear at the worker's ``/metrics`` beside ``sglang:*``. Only the scheduler rank that
reports SGLang's own scheduler metrics reports these.

    crossflow:lease_budget{budget}            the node's current lease (0 without one)
    crossflow:lease_held{budget}              what borrowed work holds on it
    crossflow:lease_rate_tokens_per_s         the prefill rate the token bucket earns
    crossflow:lease_expires_in_s              seconds until the lease expires (0 when expired)
    crossflow:lease_bucket_credit_tokens      the token bucket's credit at the last decision
    crossflow:local_prefill_queued_requests   admitted borrowed requests not started
    crossflow:local_prefill_started_requests  borrowed requests started and not finished
    crossflow:local_prefill_events_total{event}  admitted, started, finished, rejected_*, lapsed_*,
                                              aborted_queued, extend_batches, leases, ...
    crossflow:local_prefill_tokens_total{kind}   computed (paid by the bucket), overspent
"""

from __future__ import annotations

from typing import Any

from policies.lease import BUDGET_FIELDS

TOKEN_COUNTERS = ("local_prefill_tokens", "overspent_tokens")
"""Counter names that count tokens (``crossflow:local_prefill_tokens_total{kind}``); the rest count
events."""

_MIN_UPDATE_NS = 100_000_000
"""Gauges are refreshed at most every 0.1 s (they are written to a memory-mapped file each time)."""


class PluginMetrics:
    """``crossflow:*`` metrics of one node. ``gauge`` and ``counter`` are ``prometheus_client``'s
    ``Gauge`` and ``Counter`` (or look-alikes in tests)."""

    def __init__(self, node_id: int, gauge: Any, counter: Any) -> None:
        labels = {"node_id": str(node_id)}
        self._labels = labels

        def g(name: str, doc: str, *extra: str) -> Any:
            return gauge(name, doc, labelnames=[*labels, *extra], multiprocess_mode="mostrecent")

        self.budget = g("crossflow:lease_budget", "The node's current lease, per budget.", "budget")
        self.held = g("crossflow:lease_held", "What borrowed work holds on the lease, per budget.", "budget")
        self.rate = g("crossflow:lease_rate_tokens_per_s", "Prefill tokens per second the lease grants.")
        self.expires_in = g("crossflow:lease_expires_in_s", "Seconds until the lease expires.")
        self.credit = g(
            "crossflow:lease_bucket_credit_tokens", "Borrowed prefill credit at the last decision."
        )
        self.queued = g("crossflow:local_prefill_queued_requests", "Admitted borrowed requests not started.")
        self.started = g(
            "crossflow:local_prefill_started_requests", "Borrowed requests started, not finished."
        )
        self.events = counter(
            "crossflow:local_prefill_events",
            "Decode-local prefill events.",
            labelnames=[*labels, "event"],
        )
        self.tokens = counter(
            "crossflow:local_prefill_tokens",
            "Borrowed prefill tokens computed (paid by the bucket) and overspent.",
            labelnames=[*labels, "kind"],
        )
        self._last_update_ns: int | None = None
        self._dirty = True

    @classmethod
    def create(cls, node_id: int) -> PluginMetrics:
        """Metrics on ``prometheus_client``'s default registry (import it only once SGLang has set
        ``PROMETHEUS_MULTIPROC_DIR``, as SGLang does)."""
        from prometheus_client import Counter, Gauge

        return cls(node_id, Gauge, Counter)

    def count(self, name: str, n: int = 1) -> None:
        self._dirty = True  # something changed: the next update refreshes the gauges at once
        if name in TOKEN_COUNTERS:
            kind = "computed" if name == "local_prefill_tokens" else "overspent"
            self.tokens.labels(**self._labels, kind=kind).inc(n)
        else:
            self.events.labels(**self._labels, event=name).inc(n)

    def update(self, node: Any, now_s: float, now_ns: int) -> None:
        """Refresh the gauges from ``node`` (a ``LocalPrefill``): at once after an event, otherwise
        at most every 0.1 s (for the lease's time to expiry)."""
        recent = self._last_update_ns is not None and now_ns - self._last_update_ns < _MIN_UPDATE_NS
        if recent and not self._dirty:
            return
        self._last_update_ns, self._dirty = now_ns, False
        admission = node.admission
        lease = admission.lease()
        budgets = lease.budgets.to_dict() if lease is not None else dict.fromkeys(BUDGET_FIELDS, 0)
        held = admission.held().to_dict()
        for name in BUDGET_FIELDS:
            self.budget.labels(**self._labels, budget=name).set(budgets[name])
            self.held.labels(**self._labels, budget=name).set(held[name])
        self.rate.labels(**self._labels).set(admission.bucket.rate_tokens_per_s)
        self.expires_in.labels(**self._labels).set(
            0.0 if lease is None else max(0.0, lease.expires_s - now_s)
        )
        # the credit as of the last decision: advancing the bucket here, on one rank only, could round
        # differently from the other tensor-parallel ranks
        self.credit.labels(**self._labels).set(admission.bucket.credit_tokens)
        self.queued.labels(**self._labels).set(len(node.queue))
        self.started.labels(**self._labels).set(len(node.started))


__all__ = ["TOKEN_COUNTERS", "PluginMetrics"]

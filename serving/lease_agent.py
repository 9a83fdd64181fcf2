"""Lease agents: one per decode worker, reporting its ``NodeState`` to the router's control plane.

Each control interval an agent reads its worker's state and posts it to the router
(``POST /crossflow/v1/node_state`` with ``Authorization: Bearer <token>``); the router's
``ClusterScheduler`` runs the node policy on it and publishes or revokes the node's lease, and the
answer tells the agent the lease now held. The state comes from:

* ``/server_info``, when the worker runs the Crossflow plugin (or is an emulated worker): each rank's
  ``internal_states[i].crossflow.node_state`` is the exact ``NodeState`` the simulator would compute
  (``serving.sglang_plugin.wire.node_states_from_server_info``);
* otherwise SGLang's own ``/v1/loads`` and ``/metrics`` (:func:`node_state_from_loads`): batch size,
  KV use and capacity, queue length and the running batch's summed sequence lengths. What they do not
  report (context spread, remaining output, step times, borrowed work) is zero, so a policy sees an
  idle-looking node there; it is a degraded view, for workers without the plugin.

With the plugin the report also names the borrowed requests whose prefill has begun on the worker
(``started_borrowed``), so the router commits their reservations as the simulator does when a node
starts one.

Besides reporting every ``interval_s``, an agent reads once more just before each of the router's
control intervals: the answer to each report says how far ahead the next one is
(``next_control_in_s``), and the agent sleeps until its read will land that far ahead less its own
last report's round trip, twice over (``TICK_LEAD_ROUND_TRIPS``). So the state a control interval
runs on is a few milliseconds old, as the simulator's ticks read the node's state at the tick, not up
to a report interval old.

An agent that stops (killed, or its worker unreachable) stops reporting; the router then leaves the
node out of the next control intervals and its lease expires at its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from typing import Any

from policies.node_state import NodeState
from serving.http import dumps, loads
from serving.router import NODE_STATE_PATH
from serving.sglang_plugin.wire import (
    node_states_from_server_info,
    started_borrowed_from_server_info,
    takes_lease_updates,
)
from serving.upstream import JSON_HEADERS, UpstreamClient, UpstreamError

_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(?P<value>\S+)$")


def _metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> the first sample of each metric name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and m["name"] not in out:
            with contextlib.suppress(ValueError):
                out[m["name"]] = float(m["value"])
    return out


def node_state_from_loads(node_id: int, time_s: float, loads: dict[str, Any], metrics_text: str) -> NodeState:
    """A degraded ``NodeState`` from SGLang's ``/v1/loads`` answer (its first rank) and ``/metrics``
    text, for a worker without the plugin (see the module docstring). ``ValueError`` naming the
    missing field."""
    try:
        snap = loads["loads"][0]
        running = int(snap["num_running_reqs"])
        used, capacity = int(snap["num_used_tokens"]), int(snap["max_total_num_tokens"])
        waiting, max_running = int(snap["num_waiting_reqs"]), int(snap["max_running_requests"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"/v1/loads answer lacks field {exc}") from None
    seq_lens = _metric_values(metrics_text).get("sglang:decode_sum_seq_lens", 0.0)
    return NodeState(
        node_id=node_id,
        time_s=time_s,
        decode_batch_size=running,
        context_tokens_mean=seq_lens / running if running else 0.0,
        context_tokens_std=0.0,
        remaining_output_tokens_mean=0.0,
        kv_capacity_tokens=capacity,
        kv_used_tokens=used,
        kv_reserved_tokens=0,
        queued_decode_requests=waiting,
        borrowed_tasks=0,
        borrowed_prefill_tokens_queued=0,
        recent_step_time_s=0.0,
        decode_only_step_time_s=0.0,
        max_running_requests=max_running,
    )


MIN_REPORT_INTERVAL_WALL_S = 0.01
"""Agents read no more often than this (wall seconds), aligned reads included: against nearly
instant emulated workers (a tiny time scale) a quarter of a control interval is well under a
millisecond, and the agents' reads would take the router's loop from the requests it serves."""
TICK_LEAD_ROUND_TRIPS = 2.0
"""An aligned read starts this many of the agent's last report round trips ahead of the control
interval it is for (plus ``TICK_LEAD_MIN_S``), so that it lands before it."""
TICK_LEAD_MIN_S = 0.001


def next_read_in_s(interval_s: float, answer: dict[str, Any], round_trip_s: float) -> float:
    """Wall seconds until an agent's next read: ``interval_s``, or sooner when the router's next
    control interval (``next_control_in_s`` in its ``answer``) comes before the read after that could
    land ahead of it; then the read starts so that it lands just before the interval (never sooner
    than ``MIN_REPORT_INTERVAL_WALL_S``: then the read just made is the one the interval runs on)."""
    due = answer.get("next_control_in_s")
    if isinstance(due, bool) or not isinstance(due, int | float) or not math.isfinite(due):
        return interval_s
    ahead = due - (TICK_LEAD_ROUND_TRIPS * max(0.0, round_trip_s) + TICK_LEAD_MIN_S)
    return ahead if MIN_REPORT_INTERVAL_WALL_S <= ahead < interval_s else interval_s


class LeaseAgent:
    """Reports decode worker ``node_id`` (at ``worker_url``) to the control plane every
    ``interval_s`` wall seconds. ``start()`` runs it as a task on the running loop; ``stop()``."""

    def __init__(
        self, worker_url: str, node_id: int, control_url: str, token: str, interval_s: float
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"LeaseAgent interval_s must be > 0, got {interval_s}")
        self.worker_url = worker_url.rstrip("/")
        self.node_id = node_id
        self.control_url = control_url.rstrip("/")
        self.token = token
        self.interval_s = interval_s
        self.reports = 0
        self.errors = 0
        self.last_lease: dict[str, Any] | None = None
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self.takes_leases = False
        """Whether the worker installs pushed leases (``wire.takes_lease_updates``; the router then
        pushes each lease it publishes for the node)."""
        self.started_borrowed: list[str] = []
        """The borrowed request ids whose prefill had begun on the worker at the last read (the router
        commits their reservations: ``wire.started_borrowed_from_server_info``)."""

    @staticmethod
    async def _call(
        client: UpstreamClient, method: str, url: str, body: bytes | None = None, **headers: str
    ) -> bytes:
        """One exchange; the body of a 200 answer, else ``UpstreamError`` naming the status."""
        status, data = await client.fetch(method, url, body, headers=headers or None)
        if status != 200:
            raise UpstreamError(f"{method} {url}: HTTP {status}: {data[:200].decode(errors='replace')}")
        return data

    async def read_state(self, client: UpstreamClient) -> NodeState:
        """The worker's ``NodeState`` now (``started_borrowed`` is set beside it, from the same read)."""
        info = loads(await self._call(client, "GET", self.worker_url + "/server_info"))
        self.takes_leases = isinstance(info, dict) and takes_lease_updates(info)
        self.started_borrowed = []
        try:
            state = node_states_from_server_info(info)[0]
        except ValueError:
            load = loads(await self._call(client, "GET", self.worker_url + "/v1/loads"))
            metrics = (await self._call(client, "GET", self.worker_url + "/metrics")).decode()
            return node_state_from_loads(self.node_id, time.time(), load, metrics)
        self.started_borrowed = started_borrowed_from_server_info(info)
        return state

    async def report_once(self, client: UpstreamClient) -> dict[str, Any]:
        """Read the worker's state and post it; the control plane's answer (the lease now held)."""
        read_from = time.perf_counter()
        state = await self.read_state(client)
        body = dumps(
            {
                "node_id": self.node_id,
                "node_state": state.to_dict(),
                "takes_leases": self.takes_leases,
                "started_borrowed": self.started_borrowed,
                "state_age_s": time.perf_counter() - read_from,
            }
        )
        headers = {**JSON_HEADERS, "Authorization": f"Bearer {self.token}"}
        answer: dict[str, Any] = loads(
            await self._call(client, "POST", self.control_url + NODE_STATE_PATH, body, **headers)
        )
        self.reports += 1
        self.last_lease = answer.get("lease")
        return answer

    async def run(self) -> None:
        client = UpstreamClient(timeout_s=5.0)
        try:
            while True:
                started = time.perf_counter()
                sleep_s = self.interval_s
                try:
                    answer = await self.report_once(client)
                    sleep_s = next_read_in_s(self.interval_s, answer, time.perf_counter() - started)
                except (UpstreamError, ValueError, TypeError) as exc:
                    self.errors += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(sleep_s)
        finally:
            await client.aclose()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


__all__ = ["MIN_REPORT_INTERVAL_WALL_S", "LeaseAgent", "next_read_in_s", "node_state_from_loads"]

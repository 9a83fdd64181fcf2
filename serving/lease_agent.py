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

An agent that stops (killed, or its worker unreachable) stops reporting; the router then leaves the
node out of the next control intervals and its lease expires at its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import httpx

from policies.node_state import NodeState
from serving.router import NODE_STATE_PATH
from serving.sglang_plugin.wire import node_states_from_server_info

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
        self._client: httpx.AsyncClient | None = None

    async def read_state(self, client: httpx.AsyncClient) -> NodeState:
        info = (await client.get(self.worker_url + "/server_info")).json()
        try:
            state = node_states_from_server_info(info)[0]
        except ValueError:
            loads = (await client.get(self.worker_url + "/v1/loads")).json()
            metrics = (await client.get(self.worker_url + "/metrics")).text
            return node_state_from_loads(self.node_id, time.time(), loads, metrics)
        return state

    async def report_once(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Read the worker's state and post it; the control plane's answer (the lease now held)."""
        state = await self.read_state(client)
        resp = await client.post(
            self.control_url + NODE_STATE_PATH,
            json={"node_id": self.node_id, "node_state": state.to_dict()},
            headers={"authorization": f"Bearer {self.token}"},
        )
        resp.raise_for_status()
        answer: dict[str, Any] = resp.json()
        self.reports += 1
        self.last_lease = answer.get("lease")
        return answer

    async def run(self) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
            while True:
                try:
                    await self.report_once(client)
                except (httpx.HTTPError, ValueError) as exc:
                    self.errors += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


__all__ = ["LeaseAgent", "node_state_from_loads"]

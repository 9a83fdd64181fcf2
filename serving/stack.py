"""Crossflow's router and its lease agents in front of an emulated PD cluster, on the cluster's loop.

``CrossflowStack`` builds the router's configuration from the cluster (its workers, model, cache and
routing settings, time scale), starts the router and one lease agent per decode worker reporting
every control interval, and stops them again. ``start`` returns once the router's first control
interval (run as soon as every agent reported) has published the leases and pushed them to the
nodes that take them: the first requests find leases, as with a router that ran before any traffic.
The router's scheduler is its own (its own ledger, fed by the agents); the emulated workers' lease,
which they re-check on arrival, is the live simulator's.

    with BackgroundCluster(EmulatedCluster(live)) as cluster:
        stack = CrossflowStack(cluster, scheduler=make_scheduler(...), estimator=...)
        run_on(cluster_loop, stack.start())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envs.cluster_config import ClusterConfig
from policies.routing import OverloadProtection
from serving.lease_agent import MIN_REPORT_INTERVAL_WALL_S, LeaseAgent
from serving.pd_cluster import EmulatedCluster
from serving.router import PolicyInfo, PolicyLoader, QueueEstimator, Router, RouterConfig, SchedulerLike


def router_config_for(
    config: ClusterConfig,
    cost_model: Any,
    prefill: Sequence[tuple[str, int | None]],
    decode: Sequence[str],
    **fields: Any,
) -> RouterConfig:
    """The router's configuration for workers serving ``config``'s model and settings (``cost_model``
    gives the model's vocabulary and a worker's KV capacity); ``fields`` override."""
    base: dict[str, Any] = {
        "prefill": tuple(prefill),
        "decode": tuple(decode),
        "model_name": cost_model.model.name,
        "context_window_tokens": config.context_window_tokens,
        "vocab_size": cost_model.model.vocab,
        "page_tokens": config.page_tokens,
        "prefill_chunk_tokens": config.prefill_chunk_tokens,
        "kv_capacity_tokens": cost_model.kv_capacity_tokens,
        "decode_prefix_cache": config.decode_prefix_cache,
        "prefill_routing": config.prefill_routing,
        "decode_routing": config.decode_routing,
        "overload": OverloadProtection() if config.router_overload_protection else None,
    }
    return RouterConfig(**{**base, **fields})


def router_config(cluster: EmulatedCluster, **fields: Any) -> RouterConfig:
    """The router's configuration for ``cluster``'s workers and model; ``fields`` override."""
    prefill = [(w.url, w.bootstrap_port) for w in cluster.prefill]
    fields = {"model_name": cluster.served_model_name, "time_scale": cluster.live.time_scale, **fields}
    return router_config_for(cluster.live.config, cluster.live.cm, prefill, cluster.decode_urls, **fields)


REPORTS_PER_INTERVAL = 4
"""Lease agents report this many times per control interval (and read once more just before each of
the router's intervals, ``lease_agent.next_read_in_s``, so the state an interval runs on is a few
milliseconds old)."""


LEASES_OUT_TIMEOUT_S = 5.0
"""``CrossflowStack.start`` waits this long, past two control intervals, for the first leases (an
agent that cannot reach its worker leaves the router serving without that node's lease)."""


def start_lease_agents(
    router: Router, decode_urls: Sequence[str], control_interval_s: float | None = None
) -> list[LeaseAgent]:
    """One lease agent per decode worker, reporting to ``router`` ``REPORTS_PER_INTERVAL`` times per
    ``control_interval_s`` (emulated; None: the router's scheduler's; at most once per
    ``MIN_REPORT_INTERVAL_WALL_S``), started on the running loop.
    None without a scheduler unless ``control_interval_s`` is given (a router that may reload a lease
    policy needs its nodes' states from the start)."""
    if control_interval_s is None:
        if router.scheduler is None:
            return []
        control_interval_s = router.scheduler.control_interval_s
    interval_wall_s = max(
        MIN_REPORT_INTERVAL_WALL_S, control_interval_s * router.config.time_scale / REPORTS_PER_INTERVAL
    )
    agents = [
        LeaseAgent(url, j, router.control_url, router.control_token, interval_wall_s)
        for j, url in enumerate(decode_urls)
    ]
    for agent in agents:
        agent.start()
    return agents


class CrossflowStack:
    """The router and lease agents over a running ``cluster`` (start and stop them on its loop)."""

    def __init__(
        self,
        cluster: EmulatedCluster,
        *,
        scheduler: SchedulerLike | None = None,
        estimator: QueueEstimator | None = None,
        policy: PolicyInfo | None = None,
        policy_loader: PolicyLoader | None = None,
        **fields: Any,
    ) -> None:
        self.cluster = cluster
        self.router = Router(
            router_config(cluster, **fields),
            scheduler=scheduler,
            estimator=estimator,
            policy=policy,
            policy_loader=policy_loader,
        )
        self.agents: list[LeaseAgent] = []

    async def start(self) -> None:
        await self.router.start()
        interval_s = self.cluster.live.config.control_interval_s if self.router.policy_loader else None
        self.agents = start_lease_agents(self.router, self.cluster.decode_urls, interval_s)
        scheduler = self.router.scheduler
        if scheduler is not None and self.agents:  # ready once the first leases are out
            wall_interval_s = scheduler.control_interval_s * self.router.config.time_scale
            await self.router.wait_leases_out(2 * wall_interval_s + LEASES_OUT_TIMEOUT_S)

    async def stop(self) -> None:
        for agent in self.agents:
            await agent.stop()
        await self.router.stop()


__all__ = ["CrossflowStack", "router_config", "router_config_for", "start_lease_agents"]

"""Crossflow's router and its lease agents in front of an emulated PD cluster, on the cluster's loop.

``CrossflowStack`` builds the router's configuration from the cluster (its workers, model, cache and
routing settings, time scale), starts the router and one lease agent per decode worker reporting
every control interval, and stops them again. The router's scheduler is its own (its own ledger,
fed by the agents); the emulated workers' lease, which they re-check on arrival, is the live
simulator's.

    with BackgroundCluster(EmulatedCluster(live)) as cluster:
        stack = CrossflowStack(cluster, scheduler=make_scheduler(...), estimator=...)
        run_on(cluster_loop, stack.start())
"""

from __future__ import annotations

from typing import Any

from envs.cluster_config import ClusterConfig
from policies.routing import OverloadProtection
from serving.lease_agent import LeaseAgent
from serving.pd_cluster import EmulatedCluster
from serving.router import PolicyInfo, QueueEstimator, Router, RouterConfig, SchedulerLike


def router_config(cluster: EmulatedCluster, **fields: Any) -> RouterConfig:
    """The router's configuration for ``cluster``'s workers and model; ``fields`` override."""
    config: ClusterConfig = cluster.live.config
    base: dict[str, Any] = {
        "prefill": tuple((w.url, w.bootstrap_port) for w in cluster.prefill),
        "decode": tuple(cluster.decode_urls),
        "model_name": cluster.served_model_name,
        "context_window_tokens": config.context_window_tokens,
        "vocab_size": cluster.live.cm.model.vocab,
        "page_tokens": config.page_tokens,
        "kv_capacity_tokens": cluster.live.cm.kv_capacity_tokens,
        "decode_prefix_cache": config.decode_prefix_cache,
        "prefill_routing": config.prefill_routing,
        "decode_routing": config.decode_routing,
        "overload": OverloadProtection() if config.router_overload_protection else None,
        "time_scale": cluster.live.time_scale,
    }
    return RouterConfig(**{**base, **fields})


class CrossflowStack:
    """The router and lease agents over a running ``cluster`` (start and stop them on its loop)."""

    def __init__(
        self,
        cluster: EmulatedCluster,
        *,
        scheduler: SchedulerLike | None = None,
        estimator: QueueEstimator | None = None,
        policy: PolicyInfo | None = None,
        **fields: Any,
    ) -> None:
        self.cluster = cluster
        self.router = Router(
            router_config(cluster, **fields), scheduler=scheduler, estimator=estimator, policy=policy
        )
        self.agents: list[LeaseAgent] = []

    async def start(self) -> None:
        await self.router.start()
        scheduler = self.router.scheduler
        if scheduler is None:
            return
        interval_wall_s = scheduler.control_interval_s * self.router.config.time_scale
        self.agents = [
            LeaseAgent(url, j, self.router.control_url, self.router.control_token, interval_wall_s)
            for j, url in enumerate(self.cluster.decode_urls)
        ]
        for agent in self.agents:
            agent.start()

    async def stop(self) -> None:
        for agent in self.agents:
            await agent.stop()
        await self.router.stop()


__all__ = ["CrossflowStack", "router_config"]

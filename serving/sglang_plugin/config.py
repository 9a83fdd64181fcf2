"""The plugin's settings, read from the worker's environment (SGLang's plugin entry point takes no
arguments, and every scheduler process inherits the server's environment)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

from policies.slo import DEFAULT_CONTROL_INTERVAL_S


@dataclass(frozen=True)
class PluginConfig:
    """Settings of the decode-local prefill plugin; each field has an environment variable."""

    node_id: int = 0
    """The node id this worker reports in ``NodeState`` (the router's and lease agent's id for it)."""
    burst_s: float = DEFAULT_CONTROL_INTERVAL_S
    """The lease token bucket holds at most this many seconds of the lease's prefill rate (the
    simulator uses the control interval)."""
    step_window_s: float = DEFAULT_CONTROL_INTERVAL_S
    """``NodeState.recent_step_time_s`` is over the iterations of this last stretch of time whenever
    the lease agent reads it: set it to the router's control interval (a simulator tick averages
    the interval that ends at it)."""
    metrics: bool = True
    """Export ``crossflow:*`` metrics on the worker's Prometheus registry (needs ``--enable-metrics``)."""

    ENV: ClassVar[dict[str, str]] = {
        "node_id": "CROSSFLOW_NODE_ID",
        "burst_s": "CROSSFLOW_LEASE_BURST_S",
        "step_window_s": "CROSSFLOW_STEP_WINDOW_S",
        "metrics": "CROSSFLOW_PLUGIN_METRICS",
    }

    def __post_init__(self) -> None:
        if self.node_id < 0:
            raise ValueError(f"{self.ENV['node_id']} must be >= 0, got {self.node_id}")
        for name in ("burst_s", "step_window_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{self.ENV[name]} must be a positive number of seconds, got {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PluginConfig:
        """The settings given in ``environ``; ``ValueError`` naming the variable for a bad value."""
        values: dict[str, object] = {}
        for f in fields(cls):
            name = cls.ENV[f.name]
            raw = environ.get(name)
            if raw is None or raw.strip() == "":
                continue
            text = raw.strip()
            try:
                if f.type == "bool":
                    if text.lower() not in ("0", "1", "true", "false"):
                        raise ValueError(text)
                    values[f.name] = text.lower() in ("1", "true")
                elif f.type == "int":
                    values[f.name] = int(text)
                else:
                    values[f.name] = float(text)
            except ValueError:
                raise ValueError(f"{name}={raw!r}: expected {f.type}") from None
        return cls(**values)  # type: ignore[arg-type]


__all__ = ["PluginConfig"]

"""Retries with backoff, a circuit breaker and health checks per worker, with smg 1.13.0's defaults.

The defaults are smg's command-line defaults, read from the 1.13.0 wheel's ``smg/router_args.py``
(``RouterArgs``, lines 155-176): ``retry_max_retries = 5`` (attempts in all: smg's
``--disable-retries`` "is equivalent to setting retry_max_retries=1"), ``retry_initial_backoff_ms =
50``, ``retry_max_backoff_ms = 30000``, ``retry_backoff_multiplier = 1.5``, ``retry_jitter_factor =
0.2``; ``health_failure_threshold = 3``, ``health_success_threshold = 2``,
``health_check_timeout_secs = 5``, ``health_check_interval_secs = 60``, ``health_check_endpoint =
"/health"``; ``cb_failure_threshold = 10``, ``cb_success_threshold = 3``, ``cb_timeout_duration_secs
= 60``, ``cb_window_duration_secs = 120``. Retryable statuses are smg's: 408, 429 and 5xx.

Times here are wall seconds (the router stretches them by the emulation's time scale itself).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def is_retryable(status: int) -> bool:
    """smg's rule: 408, 429 and every 5xx status are retried."""
    return status in (408, 429) or 500 <= status < 600


@dataclass(frozen=True)
class RetryConfig:
    """How often and how long to wait before sending a failed request again (smg's defaults)."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.050
    max_backoff_s: float = 30.0
    backoff_multiplier: float = 1.5
    jitter_factor: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryConfig.max_attempts must be >= 1, got {self.max_attempts}")
        if not (self.initial_backoff_s >= 0 and self.max_backoff_s >= self.initial_backoff_s):
            raise ValueError("RetryConfig: need 0 <= initial_backoff_s <= max_backoff_s")
        if not (self.backoff_multiplier >= 1 and math.isfinite(self.backoff_multiplier)):
            raise ValueError(
                f"RetryConfig.backoff_multiplier must be finite and >= 1, got {self.backoff_multiplier}"
            )
        if not 0 <= self.jitter_factor <= 1:
            raise ValueError(f"RetryConfig.jitter_factor must be in [0, 1], got {self.jitter_factor}")

    def backoff_s(self, attempt: int, rng: np.random.Generator) -> float:
        """Wait before attempt ``attempt + 1`` (``attempt`` >= 1 failed): exponential, capped, with
        a uniform jitter of +-``jitter_factor``."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.backoff_multiplier ** (attempt - 1))
        return base * (1.0 + self.jitter_factor * float(rng.uniform(-1.0, 1.0)))


@dataclass(frozen=True)
class BreakerConfig:
    """smg's circuit breaker: ``failure_threshold`` failures within ``window_s`` open it; after
    ``timeout_s`` it lets requests through again (half open) and ``success_threshold`` successes close
    it, one failure opens it again."""

    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_s: float = 60.0
    window_s: float = 120.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("BreakerConfig: thresholds must be >= 1")
        if not (self.timeout_s > 0 and self.window_s > 0):
            raise ValueError("BreakerConfig: timeout_s and window_s must be positive")


BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """One worker's breaker (see ``BreakerConfig``); ``clock`` returns wall seconds."""

    def __init__(self, config: BreakerConfig, clock: object = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._failures: deque[float] = deque()
        self._successes = 0
        self._opened_s: float | None = None
        self._state: BreakerState = "closed"

    def _now(self) -> float:
        return float(self._clock())  # type: ignore[operator]

    @property
    def state(self) -> BreakerState:
        if self._state == "open" and self._opened_s is not None:
            if self._now() - self._opened_s >= self.config.timeout_s:
                self._state, self._successes = "half_open", 0
        return self._state

    def allows(self) -> bool:
        return self.state != "open"

    def record(self, ok: bool) -> None:
        state, now = self.state, self._now()
        if ok:
            if state == "half_open":
                self._successes += 1
                if self._successes >= self.config.success_threshold:
                    self._state, self._failures = "closed", deque()
            return
        if state == "half_open":
            self._open(now)
            return
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.config.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.config.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state, self._opened_s, self._successes = "open", now, 0


@dataclass(frozen=True)
class HealthConfig:
    """smg's health checks: ``GET endpoint`` every ``interval_s`` with ``timeout_s``; a worker is
    unhealthy after ``failure_threshold`` consecutive failures and healthy again after
    ``success_threshold`` consecutive successes."""

    interval_s: float = 60.0
    timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    enabled: bool = True

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.timeout_s > 0):
            raise ValueError("HealthConfig: interval_s and timeout_s must be positive")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("HealthConfig: thresholds must be >= 1")


class Health:
    """One worker's health, from consecutive check results (see ``HealthConfig``)."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.healthy = True
        self._run = 0
        self._run_ok = True

    def record(self, ok: bool) -> None:
        if ok != self._run_ok:
            self._run, self._run_ok = 0, ok
        self._run += 1
        if ok and not self.healthy and self._run >= self.config.success_threshold:
            self.healthy = True
        elif not ok and self.healthy and self._run >= self.config.failure_threshold:
            self.healthy = False


__all__ = [
    "RETRYABLE_STATUSES",
    "BreakerConfig",
    "CircuitBreaker",
    "Health",
    "HealthConfig",
    "RetryConfig",
    "is_retryable",
]

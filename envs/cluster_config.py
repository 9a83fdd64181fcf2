"""Configuration of a simulated prefill/decode-disaggregated cluster."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

from policies.routing import check_routing_name
from policies.slo import DEFAULT_CONTROL_INTERVAL_S, DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S

ContextPolicy = Literal["compact", "reject"]

_SHAPE = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


def parse_shape(shape: str) -> tuple[int, int]:
    """``"2P4D"`` -> ``(2, 4)``: prefill and decode worker counts."""
    m = _SHAPE.match(shape)
    if not m:
        raise ValueError(f"cluster shape must look like '2P4D' (x prefill, y decode workers), got {shape!r}")
    n_prefill, n_decode = int(m.group(1)), int(m.group(2))
    if n_prefill < 1 or n_decode < 1:
        raise ValueError(f"cluster shape {shape!r} needs at least one prefill and one decode worker")
    return n_prefill, n_decode


@dataclass(frozen=True)
class ClusterConfig:
    """One PD cluster: hardware, model, pool sizes and the SGLang-like serving knobs."""

    gpu: str = "H200"
    """GPU of every worker (see ``envs.hardware``)."""
    model: str = "gpt-oss-120b"
    """Served model (see ``envs.hardware``)."""
    tp: int = 1
    """Tensor-parallel degree of one worker."""
    n_prefill: int = 2
    """Prefill workers."""
    n_decode: int = 4
    """Decode workers."""
    prefill_chunk_tokens: int = 8192
    """Chunked-prefill token budget of one prefill iteration (SGLang --chunked-prefill-size); borrowed
    prefill on a decode node mixes at most this many tokens into one iteration too."""
    max_running_requests: int = 256
    """Decode batch cap per decode worker (SGLang --max-running-requests)."""
    num_reserved_decode_tokens: int = 512
    """KV tokens a decode worker keeps for each active request's future output when it decides whether
    a new request may pre-allocate (SGLang --num-reserved-decode-tokens, default 512). Running requests
    that outgrow the free KV are retracted, newest first."""
    page_tokens: int = 256
    """Prefix-cache page size in tokens (also the granularity of the router's approximate tree)."""
    prefill_cache_fraction: float = 1.0
    """Share of a prefill worker's KV capacity usable as prefix cache."""
    decode_prefix_cache: bool = False
    """Decode workers keep finished requests' KV as a radix prefix cache in otherwise free KV (SGLang
    --disaggregation-decode-enable-radix-cache; off by default there and here). One setting for every
    policy of a comparison: with it on, the normal path transfers only the suffix the decode worker
    lacks, and borrowed prefill on that worker computes only that suffix."""
    prefill_routing: str = "cache_aware"
    """Prefill worker selection (``policies.routing``): smg 1.13.0's default ``cache_aware``,
    ``sglang_router_cache_aware``, ``round_robin``, ``least_load`` or ``power_of_two``."""
    decode_routing: str = "cache_aware"
    """Decode worker selection; smg applies its one ``--policy`` (default ``cache_aware``) to both pools."""
    router_overload_protection: bool = True
    """The gateway leaves out workers its last load poll saw overloaded (smg 1.13.0's default:
    ``policies.routing.OverloadProtection``)."""
    router_same_instant_race: bool = False
    """The gateway routes requests that reach it at the same instant on the in-flight counts from
    before that instant, so a same-instant burst of cache misses lands on one worker
    (``policies.routing.WorkerPool.same_instant_race``). True reproduces smg 1.13.0 as measured
    through it (``benchmarks/bench_emulation.py``); off by default, so the static baseline is not
    handicapped by an implementation race a practitioner would not choose (Crossflow's router counts
    every dispatch at once)."""
    kv_transfer_bandwidth_bytes_per_s: float = 50e9
    """KV-transfer link of each worker (one NIC): concurrent transfers through a worker share it."""
    kv_transfer_latency_s: float = 0.002
    """Fixed latency of one KV transfer (handshake and completion signal)."""
    control_interval_s: float = DEFAULT_CONTROL_INTERVAL_S
    """How often decode nodes report ``NodeState`` and leases are refreshed."""
    slo_ttft_s: float = DEFAULT_TTFT_SLO_S
    slo_tpot_s: float = DEFAULT_TPOT_SLO_S
    """Per-request SLO: TTFT within ``slo_ttft_s`` and mean inter-token time within ``slo_tpot_s``."""
    context_policy: ContextPolicy = "compact"
    """What happens to a request whose input plus output exceeds the model's context window:
    ``compact`` (default, as an agent harness does: its input is cut to fit the window and its cached
    prefix is lost) or ``reject`` (refused at arrival with a reason, outside the SLO denominator)."""
    max_context_tokens: int | None = None
    """Context window in tokens; ``None`` takes the catalog model's ``max_context_tokens``."""
    max_decode_jump_iters: int = 1 << 20
    """At most this many identical-batch decode iterations are simulated as one event. Exact: the
    jump computes every iteration's time and the clock as single events would, applies finished
    iterations before anything reads the worker, and an event that changes the batch cuts it at the
    iteration in flight, so any cap gives bit-identical results (``1`` simulates one by one)."""

    @classmethod
    def from_shape(cls, shape: str, **overrides: object) -> ClusterConfig:
        n_prefill, n_decode = parse_shape(shape)
        return cls(n_prefill=n_prefill, n_decode=n_decode, **overrides)  # type: ignore[arg-type]

    @property
    def shape(self) -> str:
        return f"{self.n_prefill}P{self.n_decode}D"

    def with_(self, **changes: object) -> ClusterConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def context_window_tokens(self) -> int:
        """The context window requests must fit (``max_context_tokens`` or the catalog model's)."""
        if self.max_context_tokens is not None:
            return self.max_context_tokens
        from envs.hardware import get_model

        return get_model(self.model).max_context_tokens

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"ClusterConfig.{f.name} must be non-negative, got {value}")
        if self.n_prefill < 1 or self.n_decode < 1:
            raise ValueError("ClusterConfig needs at least one prefill and one decode worker")
        check_routing_name("ClusterConfig.prefill_routing", self.prefill_routing)
        check_routing_name("ClusterConfig.decode_routing", self.decode_routing)
        if self.context_policy not in ("compact", "reject"):
            raise ValueError(
                f"ClusterConfig.context_policy must be 'compact' or 'reject', got {self.context_policy!r}"
            )
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"ClusterConfig.max_context_tokens must be >= 2, got {self.max_context_tokens}")
        if not (self.control_interval_s > 0 and self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise ValueError("ClusterConfig: control_interval_s, slo_ttft_s and slo_tpot_s must be > 0")
        if self.kv_transfer_bandwidth_bytes_per_s <= 0 or self.max_running_requests < 1:
            raise ValueError(
                "ClusterConfig: kv_transfer_bandwidth_bytes_per_s and max_running_requests must be > 0"
            )
        if self.page_tokens < 1 or self.prefill_chunk_tokens < self.page_tokens:
            raise ValueError("ClusterConfig: need 1 <= page_tokens <= prefill_chunk_tokens")

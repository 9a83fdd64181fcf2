"""Configuration of a simulated prefill/decode-disaggregated cluster."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

PrefillRouting = Literal["round_robin", "least_load", "cache_aware"]
DecodeRouting = Literal["round_robin", "least_load"]

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
    """Chunked-prefill token budget of one prefill iteration (SGLang --chunked-prefill-size)."""
    max_running_requests: int = 256
    """Decode batch cap per decode worker (SGLang --max-running-requests)."""
    decode_reserve_ratio: float = 0.5
    """Share of a request's remaining output reserved in KV at decode admission (SGLang's new-token
    ratio); when actual growth overruns the reservation the newest request is retracted."""
    page_tokens: int = 256
    """Prefix-cache page size in tokens."""
    prefill_cache_fraction: float = 1.0
    """Share of a prefill worker's KV capacity usable as prefix cache."""
    decode_prefix_cache: bool = True
    """Decode workers keep finished requests' KV as prefix cache in otherwise free KV."""
    prefill_routing: PrefillRouting = "cache_aware"
    decode_routing: DecodeRouting = "least_load"
    kv_transfer_bandwidth_bytes_per_s: float = 50e9
    """Prefill -> decode KV transfer bandwidth per worker pair."""
    kv_transfer_latency_s: float = 0.002
    control_interval_s: float = 1.0
    """How often decode nodes report ``NodeState`` and leases are refreshed."""
    slo_ttft_s: float = 5.0
    slo_itl_s: float = 0.05
    """Per-request SLO: TTFT within ``slo_ttft_s`` and mean ITL within ``slo_itl_s``."""
    max_decode_jump_iters: int = 32
    """At most this many identical-batch decode iterations are simulated as one event (exact
    timing: iteration times are summed analytically; an interrupting event splits the jump)."""

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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"ClusterConfig.{f.name} must be non-negative, got {value}")
        if self.n_prefill < 1 or self.n_decode < 1:
            raise ValueError("ClusterConfig needs at least one prefill and one decode worker")
        if self.prefill_routing not in ("round_robin", "least_load", "cache_aware"):
            raise ValueError(f"ClusterConfig.prefill_routing: unknown {self.prefill_routing!r}")
        if self.decode_routing not in ("round_robin", "least_load"):
            raise ValueError(f"ClusterConfig.decode_routing: unknown {self.decode_routing!r}")
        if self.page_tokens < 1 or self.prefill_chunk_tokens < self.page_tokens:
            raise ValueError("ClusterConfig: need 1 <= page_tokens <= prefill_chunk_tokens")

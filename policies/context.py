"""What every policy factory receives, and the name -> factory tables policies register in.

A policy is built from one :class:`PolicyContext`: the cost estimator the simulator and the router
share, the cluster it runs on (its SLOs, chunk size, control interval, shape) and, for the policies
that declare they need one, the interference model's predictor. A factory asks for what it needs
(``ctx.require_predictor(...)``); nothing outside a policy decides by its name what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from policies.node_policies import SafePrefillPredictor


class CostEstimator(Protocol):
    """Timing a policy may ask for (``envs.estimator.ClusterEstimator`` implements it)."""

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """``new_tokens`` prefilled alone on an idle prefill worker after ``cached_tokens`` of prefix."""
        ...

    def kv_transfer_time_s(self, tokens: int) -> float:
        """One KV transfer of ``tokens`` tokens over an idle link."""
        ...

    def mixed_step_time_s(self, prefill_tokens: int, decode_batch: int, decode_context_tokens: int) -> float:
        """One decode iteration of ``decode_batch`` requests (``decode_context_tokens`` of KV in all)
        with ``prefill_tokens`` of prefill mixed in."""
        ...

    def local_prefill_time_s(
        self,
        tokens: int,
        cached_tokens: int,
        chunk_tokens: int,
        decode_batch: int,
        decode_context_tokens: int,
    ) -> float:
        """One prompt prefilled on a decode node in ``chunk_tokens`` chunks, each mixed into an
        iteration of the node's decode batch (attention over the growing prefix included)."""
        ...


class ClusterView(Protocol):
    """The facts of the cluster a policy may read (``envs.cluster_config.ClusterConfig`` has them all)."""

    @property
    def n_prefill(self) -> int: ...

    @property
    def n_decode(self) -> int: ...

    @property
    def slo_ttft_s(self) -> float: ...

    @property
    def slo_tpot_s(self) -> float: ...

    @property
    def control_interval_s(self) -> float: ...

    @property
    def prefill_chunk_tokens(self) -> int:
        """SGLang's ``--chunked-prefill-size``: a prefill worker's token budget per iteration."""
        ...


@dataclass(frozen=True)
class PolicyContext:
    """Everything a node-policy or path-policy factory may use."""

    cost: CostEstimator
    cluster: ClusterView
    predictor: SafePrefillPredictor | None = None
    """The interference model; only policies registered with ``needs_predictor=True`` get one."""

    def require_predictor(self, who: str) -> SafePrefillPredictor:
        """The predictor, or a clear error naming the policy that needs it."""
        if self.predictor is None:
            raise ValueError(f"{who} needs an interference-model predictor (PolicyContext.predictor is None)")
        return self.predictor


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Registered(Generic[T]):
    """One registry entry: the factory and what it declares about itself."""

    name: str
    factory: Callable[..., T]
    """Called as ``factory(ctx, **params)``."""
    needs_predictor: bool = False
    summary: str = ""


class Registry(Generic[T]):
    """Name -> factory for one kind of plug-in. Module-level instances back the ``register_*`` helpers;
    build a private one in tests so registrations do not leak between them."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Registered[T]] = {}

    def register(
        self,
        name: str,
        factory: Callable[..., T],
        *,
        needs_predictor: bool = False,
        summary: str = "",
        replace: bool = False,
    ) -> None:
        if not name or not name.replace("-", "_").isidentifier():
            raise ValueError(f"{self.kind} name must be an identifier (dashes allowed), got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered (pass replace=True to override)")
        self._entries[name] = Registered(name, factory, needs_predictor, summary)

    def entry(self, name: str) -> Registered[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {self.names()}") from None

    def make(self, name: str, ctx: PolicyContext, **params: Any) -> T:
        entry = self.entry(name)
        if entry.needs_predictor:
            ctx.require_predictor(f"{self.kind} {name!r}")
        try:
            return entry.factory(ctx, **params)
        except TypeError as exc:
            raise TypeError(f"{self.kind} {name!r}: {exc}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


__all__ = [
    "ClusterView",
    "CostEstimator",
    "PolicyContext",
    "Registered",
    "Registry",
]

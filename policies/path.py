"""Path policies: for each request, the normal path (a prefill worker, then a KV transfer) or not.

Contract (``PathPolicy``): ``choose(query, now_s, ledger) -> PathDecision`` picks one of

* ``normal``: the gateway's prefill and decode workers, as static PD runs it;
* ``borrow``: prefill on a decode node's **lease** (Crossflow): the decision carries a reservation
  the ledger made, and the node pays the prefill from the lease's token bucket;
* ``local``: prefill on a decode node **without a lease** (the peers' conditional disaggregation):
  no reservation and no token bucket; the node mixes at most ``local_chunk_tokens(node_id)`` prefill
  tokens into each decode iteration. Nothing but the policy's own rule bounds how much goes there.

``plan(now_s, states)`` is asked at the start of each control interval, before leases are published,
and may return, per decode node, the share of its node policy's prefill headroom to publish (a path
policy that sizes leases together with its path choice, ``policies.rl_policy``; the default: none).
``observe(now_s, states)`` hands the policy each control interval's ``NodeState`` of every decode node;
a policy whose class says ``reconsiders_waiting = True`` is also asked, every control interval,
about each request still waiting on a prefill worker (``reconsider``), and may move it to ``local``.

Decisions are plain records with a reason code (``PathReason``) and a human-readable detail. Plug-ins
register a factory ``factory(ctx, **params)`` by name: ``register_path_policy("mine", factory)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Literal

from policies.context import CostEstimator, PolicyContext, Registry
from policies.ledger import LeaseLedger
from policies.node_state import NodeState

PathName = Literal["normal", "borrow", "local", "shed"]


class PathReason(StrEnum):
    """Why a path policy chose what it chose (one code per rule outcome; ``detail`` has the numbers)."""

    NORMAL_ONLY = "normal-only policy"
    NOT_CONGESTED = "prefill pool not congested"
    NO_LEASE_FITS = "no lease can hold it"
    MARGIN_NOT_MET = "borrow does not beat normal by the margin"
    BORROWED = "borrow on a lease"
    RESERVATION_FAILED = "reservation failed on every candidate"
    RULE_LOCAL = "rule says local"
    RULE_NORMAL = "rule says normal"
    DECODE_BUSY = "decode-busy guard vetoes local"
    DECODE_UNKNOWN = "decode load unknown"
    LOCAL_FASTER = "local beats the prefill path"
    LOCAL_NOT_FASTER = "local does not beat the prefill path"
    NO_NODE_STATE = "no decode node state yet"
    SHED = "shed: past capacity, no path meets the TTFT SLO"
    MIXED_SHARE_BUDGET = "every lease is on a node past its mixed-iteration share budget"


@dataclass(frozen=True, slots=True)
class PathQuery:
    """What the router/simulator knows about a request when it must pick a path."""

    request_id: int
    session_id: int
    input_tokens: int
    expected_output_tokens: int
    normal_uncached_tokens: int
    """Input tokens the normal path's prefill worker must compute (the rest hit its prefix cache)."""
    normal_queue_wait_s: float
    """Estimated queueing on the normal path's prefill worker (for a request already queued there:
    the work ahead of it)."""
    normal_prefill_worker: int
    decode_cached_tokens: Mapping[int, int] = field(default_factory=dict)
    """node_id -> leading input tokens already cached on that decode node."""
    prefill_cached_tokens: int = 0
    """Leading input tokens cached on the normal prefill worker (a decode node may pull them)."""
    normal_decode_worker: int | None = None
    """The decode worker the gateway picks for the normal path (``None``: not known)."""
    normal_queued_tokens: int = 0
    """Uncomputed prefill tokens already queued on the normal prefill worker (not this request's)."""
    decode_kv_load_tokens: Mapping[int, int] = field(default_factory=dict)
    """node_id -> KV tokens the router counts on that decode node (held, plus routed requests not yet
    holding theirs), not counting this request. A router-side view: decisions taken at the same
    instant do not see each other."""
    decode_kv_capacity_tokens: int = 0
    """KV capacity of one decode node in tokens (0: not known)."""

    def __post_init__(self) -> None:
        if (
            self.input_tokens >= 0
            and self.expected_output_tokens >= 0
            and 0 <= self.normal_uncached_tokens <= self.input_tokens
            and self.prefill_cached_tokens >= 0
            and self.normal_queued_tokens >= 0
            and self.decode_kv_capacity_tokens >= 0
            and self.normal_queue_wait_s >= 0
        ):
            return  # the usual case, checked in one pass (a router builds one for every request)
        for name in (
            "input_tokens",
            "expected_output_tokens",
            "normal_uncached_tokens",
            "prefill_cached_tokens",
            "normal_queued_tokens",
            "decode_kv_capacity_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"PathQuery.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.normal_uncached_tokens > self.input_tokens:
            raise ValueError(
                f"PathQuery.normal_uncached_tokens ({self.normal_uncached_tokens}) exceeds input_tokens "
                f"({self.input_tokens})"
            )
        if self.normal_queue_wait_s < 0:
            raise ValueError(f"PathQuery.normal_queue_wait_s must be >= 0, got {self.normal_queue_wait_s!r}")

    def decode_uncached_tokens(self, node_id: int) -> int:
        """Input tokens ``node_id`` would compute to prefill this request itself (at least one)."""
        cached = min(max(0, self.decode_cached_tokens.get(node_id, 0)), self.input_tokens - 1)
        return max(1, self.input_tokens - max(0, cached))


@dataclass(frozen=True, slots=True)
class PathDecision:
    path: PathName
    node_id: int | None
    """Decode node of a ``borrow`` or ``local`` decision; ``None`` for ``normal`` and ``shed``."""
    reservation_id: int | None
    """The ledger reservation of a ``borrow`` decision; ``None`` otherwise."""
    est_normal_s: float
    est_borrow_s: float | None
    """Estimate of the best alternative to the normal path the policy considered (borrow or local;
    ``None`` when it considered none)."""
    reason: str
    """Human-readable detail with the numbers behind ``code``."""
    code: PathReason = PathReason.NORMAL_ONLY

    def __post_init__(self) -> None:
        if self.path in ("normal", "shed") and (self.node_id is not None or self.reservation_id is not None):
            raise ValueError(f"a {self.path} PathDecision has no node_id and no reservation_id")
        if self.path in ("borrow", "local") and self.node_id is None:
            raise ValueError(f"a {self.path} PathDecision needs a node_id")
        if (self.path == "borrow") != (self.reservation_id is not None):
            raise ValueError("exactly the borrow PathDecisions carry a reservation_id")


def normal_path_estimate_s(cost: CostEstimator, q: PathQuery) -> float:
    """The normal path's time to first token: queue wait + prefill of the uncached tokens + KV transfer."""
    cached = q.input_tokens - q.normal_uncached_tokens
    return (
        q.normal_queue_wait_s
        + cost.prefill_time_s(q.normal_uncached_tokens, cached_tokens=cached)
        + cost.kv_transfer_time_s(q.input_tokens)
    )


class PathPolicy(ABC):
    """Per-request path choice (see the module docstring). Deterministic: same inputs, same answer."""

    uses_leases: ClassVar[bool] = False
    """True for policies that send work to decode nodes only through the lease ledger (``borrow``)."""
    reconsiders_waiting: ClassVar[bool] = False
    """True for policies whose ``reconsider`` may move a request that waits on a prefill worker."""
    uses_gateway_decode_pick: ClassVar[bool] = False
    """True for policies that read ``PathQuery.normal_decode_worker`` (the router then makes the
    gateway's decode pick before asking; otherwise it is ``None``)."""

    def __init__(self) -> None:
        self.states: dict[int, NodeState] = {}
        """The latest ``NodeState`` of each decode node (empty before the first control interval;
        after an interval the scheduler replayed, those of the interval before, equal to the current
        ones apart from ``time_s``: see ``observes_only_states``)."""

    observe_replayable: ClassVar[bool] = False
    """An override of ``observe`` that never reads the states' ``time_s``, so a replayed interval may
    call it again with the last states (``observes_only_states``)."""

    def observe(self, now_s: float, states: Sequence[NodeState]) -> None:
        """Each control interval: the decode nodes' states. Overrides must call this one."""
        self.states = {s.node_id: s for s in states}

    def plan(self, now_s: float, states: Sequence[NodeState]) -> Mapping[int, float] | None:
        """Before this interval's leases are published: ``{node_id: share}`` of each node policy's
        prefill headroom to publish (each in [0, 1]; a missing node gets all of it), or ``None`` for
        all of it everywhere (the default). Called only when ``uses_leases``."""
        return None

    @abstractmethod
    def choose(self, q: PathQuery, now_s: float, ledger: LeaseLedger) -> PathDecision:
        """The path of a request arriving now (a ``borrow`` decision has reserved on ``ledger``)."""

    def local_chunk_tokens(self, node_id: int) -> int:
        """Prefill tokens of ``local`` requests a decode iteration of ``node_id`` may mix in (0: none)."""
        return 0

    def reconsider(self, q: PathQuery, now_s: float) -> PathDecision | None:
        """For a request still waiting on its prefill worker: a ``local`` decision to move it, or
        ``None`` to leave it (only called when ``reconsiders_waiting``)."""
        return None


def observes_only_states(policy: PathPolicy) -> bool:
    """Whether ``policy`` keeps ``PathPolicy``'s own ``plan`` (it scales nothing) and an ``observe``
    that a replay may repeat: ``PathPolicy``'s own (it only stores the states), or one whose class
    sets ``observe_replayable`` (it reads ``now_s`` and the states but never their ``time_s``). For
    such a policy an interval whose states equal the last one's apart from their clock is the last
    one again, so the scheduler may replay it (``ClusterScheduler.replay_control_interval``), handing
    ``observe`` the last states. A policy with its own ``plan`` (``LearnedPath``) is never replayed."""
    cls = type(policy)
    return cls.plan is PathPolicy.plan and (cls.observe is PathPolicy.observe or cls.observe_replayable)


class NormalOnly(PathPolicy):
    """Every request takes the normal path (static PD; the path policy of lease-free node policies)."""

    def __init__(self, cost: CostEstimator) -> None:
        super().__init__()
        self.cost = cost

    def choose(self, q: PathQuery, now_s: float, ledger: LeaseLedger) -> PathDecision:
        est = normal_path_estimate_s(self.cost, q)
        return PathDecision("normal", None, None, est, None, "normal path only", PathReason.NORMAL_ONLY)


# ---- registry -------------------------------------------------------------------------------------
PathPolicyFactory = Callable[..., PathPolicy]

PATH_POLICIES: Registry[PathPolicy] = Registry("path policy")
"""The process-wide table of path policies (``factory(ctx, **params)``)."""


def register_path_policy(
    name: str, factory: PathPolicyFactory, *, needs_predictor: bool = False, summary: str = ""
) -> None:
    """Make ``make_path_policy(name, ctx, **params)`` call ``factory(ctx, **params)``."""
    PATH_POLICIES.register(name, factory, needs_predictor=needs_predictor, summary=summary)


def make_path_policy(name: str, ctx: PolicyContext, **params: Any) -> PathPolicy:
    return PATH_POLICIES.make(name, ctx, **params)


def path_policy_names() -> list[str]:
    return PATH_POLICIES.names()


register_path_policy("normal", lambda ctx: NormalOnly(ctx.cost), summary="every request on the normal path")

__all__ = [
    "PATH_POLICIES",
    "NormalOnly",
    "PathDecision",
    "PathName",
    "PathPolicy",
    "PathQuery",
    "PathReason",
    "make_path_policy",
    "normal_path_estimate_s",
    "observes_only_states",
    "path_policy_names",
    "register_path_policy",
]

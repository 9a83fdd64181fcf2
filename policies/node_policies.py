"""Node policies: how much a decode node lends, from its live ``NodeState``.

Contract (``NodePolicy``): ``propose(state) -> LeaseBudgets`` is the **new headroom** the node can
take on now, net of the work it already carries as ``state`` reports it (the scheduler adds the
ledger's committed holdings back when it publishes, so started borrowed work is not counted twice).
Zero budgets mean "no lease". ``ttl_s`` is how long a proposal stays valid. A policy may also define
``decode_pressure(state) -> str | None`` (a reason when decode needs the node back); the scheduler
uses it to pause borrowed prefill that has arrived but not started, and otherwise treats a zero
proposal as pressure.

Policies are pure functions of the state (no hidden state, no randomness), so the simulator and the
router get identical answers. Plug-ins register a factory ``factory(ctx, **params)`` by name
(``register_node_policy("mine", f, needs_predictor=True)``); ``ctx`` is the one ``PolicyContext`` every
policy factory receives (cost estimator, cluster, and the predictor for those that declare a need).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from policies.context import CostEstimator, PolicyContext, Registry
from policies.lease import LeaseBudgets
from policies.node_state import NodeState
from policies.slo import DEFAULT_ITL_BUDGET_SHARE, DEFAULT_TPOT_SLO_S, itl_budget_s


@runtime_checkable
class NodePolicy(Protocol):
    """What the cluster scheduler needs from a node policy."""

    @property
    def ttl_s(self) -> float:
        """Seconds a published lease stays valid."""
        ...

    def propose(self, state: NodeState) -> LeaseBudgets:
        """New headroom the node offers now; ``LeaseBudgets.zero()`` for no lease.

        A pure function of ``state`` that never reads ``state.time_s`` (so does ``decode_pressure``
        where a policy has one): the scheduler reuses the last proposal of a node whose state, apart
        from the clock, has not changed."""
        ...


@runtime_checkable
class SafePrefillPredictor(Protocol):
    """The interference model's predictor, as the heuristic uses it (duck-typed)."""

    def safe_prefill_tokens_per_s(
        self,
        decode_batch_size: int,
        context_tokens_mean: float,
        context_tokens_std: float,
        remaining_output_tokens_mean: float,
        kv_occupancy: float,
        remaining_output_tokens_max: float | None = None,
        remaining_output_tokens_context_weighted: float | None = None,
    ) -> float: ...


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


def _check_fraction(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{owner}.{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True, slots=True)
class StaticPolicy:
    """Plain PD: never lends."""

    ttl_s: float = 1.0

    def propose(self, state: NodeState) -> LeaseBudgets:
        return LeaseBudgets.zero()


@dataclass(frozen=True, slots=True)
class UtilisationPolicy:
    """Naive baseline: lend a fixed slice whenever one utilisation figure is under a threshold.

    Utilisation = ``max(recent_step_time_s / itl_target_s, decode_batch_size / max_running_requests)``.
    It ignores context lengths, remaining output and how the load is spread, which is exactly what
    the paper shows makes "low utilisation" a poor guide to safe lending. Kept as a baseline.
    """

    itl_target_s: float = DEFAULT_TPOT_SLO_S
    threshold: float = 0.5
    """Lend only while utilisation is strictly below this."""
    ttl_s: float = 1.0
    prefill_tokens_per_s: float = 8000.0
    """The fixed slice of local prefill compute."""
    kv_tokens: int = 65536
    """Fixed KV slice (capped by the node's free KV)."""
    transfer_tokens: int = 32768
    decode_tokens: int = 16384
    tasks: int = 2

    def __post_init__(self) -> None:
        _check_positive("UtilisationPolicy", itl_target_s=self.itl_target_s, ttl_s=self.ttl_s)
        if self.threshold < 0:
            raise ValueError(f"UtilisationPolicy.threshold must be >= 0, got {self.threshold!r}")

    def utilisation(self, state: NodeState) -> float:
        batch_share = (
            state.decode_batch_size / state.max_running_requests if state.max_running_requests else 1.0
        )
        return max(state.recent_step_time_s / self.itl_target_s, batch_share)

    def propose(self, state: NodeState) -> LeaseBudgets:
        if self.utilisation(state) >= self.threshold:
            return LeaseBudgets.zero()
        return LeaseBudgets(
            prefill_tokens=int(self.prefill_tokens_per_s * self.ttl_s),
            kv_tokens=min(self.kv_tokens, state.kv_free_tokens),
            transfer_tokens=self.transfer_tokens,
            decode_tokens=self.decode_tokens,
            tasks=self.tasks,
        )


@dataclass(frozen=True, slots=True)
class HeuristicPolicy:
    """Lend what the interference model says is safe, with a margin; decode always wins.

    Budgets while there is no decode pressure (see ``decode_pressure``):

    * prefill: ``margin x predictor.safe_prefill_tokens_per_s(state) x ttl_s`` minus the borrowed
      prefill tokens already queued on the node;
    * KV: free KV (``state.kv_free_tokens``, which already excludes admission reservations) minus
      headroom for the running requests' remaining output not covered by those reservations, and
      never past ``kv_high_watermark`` of capacity;
    * tasks: ``max_tasks`` minus borrowed tasks already there, and no more than the free decode slots
      (borrowed requests decode on this node afterwards);
    * decode work: ``tasks x decode_tokens_per_task``; transfer: ``transfer_tokens_per_s x ttl_s``
      capped by the KV budget (pulled KV must fit).

    With an ITL budget (``itl_budget_s``, the default: a share of the TPOT SLO, ``policies.slo``) the
    node also caps each iteration's borrowed chunk at the largest one whose mixed iteration with its
    running batch stays within the budget by the cost estimator (``borrowed_chunk_tokens``), and lends
    nothing when not even the smallest chunk fits.

    With ``discount_prealloc_kv`` the KV watermark (pressure and budget) leaves out the KV that SGLang's
    decode pre-allocation holds for requests still waiting for their prefill
    (``NodeState.kv_prealloc_waiting_tokens``), and the budget keeps room for those requests' expected
    output instead: that KV is not growing and lending compute does not touch it, while counting it
    stops a node lending exactly when the prefill pool is most behind (``docs/compare.md``). The KV a
    borrowed request takes is still only ever real free KV.

    If the prefill or task budget comes out zero the proposal is zero (a lease nobody can use).
    """

    predictor: SafePrefillPredictor
    itl_target_s: float = DEFAULT_TPOT_SLO_S
    """Per-token latency target the decode batch must keep."""
    ttl_s: float = 8.0
    """Lease length, and so the horizon of the prefill budget (``safe rate x ttl_s`` tokens may be
    queued on the node). Leases are refreshed every control interval and revoked at once under decode
    pressure, and the scheduler's ITL guard bounds the pool's step inflation, so the TTL mostly sets
    how much borrowed work a node accepts ahead; 8 s gave the lowest TTFT of 1, 2 and 8 s on the agent
    and Mooncake traces with mean ITL below static (docs/leases.md, benchmarks/bench_lease_ttl.py)."""
    margin: float = 0.8
    """Share of the predicted safe throughput actually lent (the predictor's error budget)."""
    kv_high_watermark: float = 0.9
    """Decode pressure when KV occupancy (used / capacity) exceeds this; KV budget stops here too."""
    batch_high_fraction: float = 0.9
    """Decode pressure when the batch reaches this share of ``max_running_requests``."""
    max_tasks: int = 4
    decode_tokens_per_task: int = 8192
    transfer_tokens_per_s: float = 262144.0
    """Share of the node's KV-transfer link offered to pulled prefixes."""
    itl_budget_s: float | None = None
    """Longest iteration with borrowed prefill mixed in (seconds); ``None``: no per-iteration budget
    (chunks are then the cluster's prefill chunk). Needs ``cost``."""
    cost: CostEstimator | None = None
    """Iteration timing that sizes the chunk within ``itl_budget_s``."""
    max_chunk_tokens: int = 8192
    """Largest borrowed chunk one iteration takes (the cluster's ``prefill_chunk_tokens``)."""
    discount_prealloc_kv: bool = False
    """Leave pre-allocated KV of requests still waiting for prefill out of the KV watermark."""
    _pressure: DecodePressureRule = field(init=False, repr=False, compare=False)
    """``decode_pressure``'s test, built once from the fields above (``pressure_rule``)."""

    def __post_init__(self) -> None:
        _check_positive("HeuristicPolicy", itl_target_s=self.itl_target_s, ttl_s=self.ttl_s)
        _check_fraction(
            "HeuristicPolicy",
            margin=self.margin,
            kv_high_watermark=self.kv_high_watermark,
            batch_high_fraction=self.batch_high_fraction,
        )
        if self.max_tasks < 0 or self.decode_tokens_per_task < 0 or self.transfer_tokens_per_s < 0:
            raise ValueError(
                "HeuristicPolicy: max_tasks, decode_tokens_per_task, transfer_tokens_per_s must be >= 0"
            )
        if not callable(getattr(self.predictor, "safe_prefill_tokens_per_s", None)):
            raise TypeError("HeuristicPolicy.predictor must have a safe_prefill_tokens_per_s(...) method")
        if self.itl_budget_s is not None:
            _check_positive("HeuristicPolicy", itl_budget_s=self.itl_budget_s)
            if self.cost is None:
                raise ValueError("HeuristicPolicy.itl_budget_s needs a cost estimator (cost=...)")
        if self.max_chunk_tokens < 1:
            raise ValueError(f"HeuristicPolicy.max_chunk_tokens must be >= 1, got {self.max_chunk_tokens!r}")
        rule = DecodePressureRule(
            self.itl_target_s, self.kv_high_watermark, self.batch_high_fraction, self.discount_prealloc_kv
        )
        object.__setattr__(self, "_pressure", rule)

    def decode_pressure(self, state: NodeState) -> str | None:
        """Why decode needs the whole node now, or ``None``. Any reason forces a zero lease."""
        return self._pressure.reason(state)

    def pressure_rule(self) -> DecodePressureRule:
        """``decode_pressure`` as data, for a node that holds no policy (it travels with the lease)."""
        return self._pressure

    def borrowed_chunk_tokens(self, decode_batch: int, decode_context_tokens: int) -> int | None:
        """Borrowed prefill tokens one iteration of the node may take with a running batch of
        ``decode_batch`` requests (``decode_context_tokens`` of KV in all): the largest chunk whose mixed
        iteration stays within ``itl_budget_s`` (``None``: no budget, no limit). Asked before every
        iteration, since requests join the batch between control intervals."""
        if self.itl_budget_s is None or self.cost is None:
            return None
        chunk, _ = largest_chunk_within(
            self.cost, decode_batch, decode_context_tokens, self.itl_budget_s, self.max_chunk_tokens
        )
        return chunk

    def propose(self, state: NodeState) -> LeaseBudgets:
        return self.propose_with_pressure(state)[0]

    def propose_with_pressure(self, state: NodeState) -> tuple[LeaseBudgets, str | None]:
        """``(propose(state), decode_pressure(state))`` in one pass (the pressure test is asked once;
        the scheduler calls this rather than the two)."""
        pressure = self.decode_pressure(state)
        if pressure is not None:
            return LeaseBudgets.zero(), pressure
        batch = state.decode_batch_size
        if self.itl_budget_s is not None and self.cost is not None:
            # borrowed_chunk_tokens(...) == 0, without the bisection for the size
            if smallest_chunk_breaks(
                self.cost,
                batch,
                int(state.context_tokens_mean * batch),
                self.itl_budget_s,
                self.max_chunk_tokens,
            ):
                return LeaseBudgets.zero(), None
        safe_tokens_per_s = predict_safe(self.predictor, state)
        return headroom_budgets(
            state,
            safe_tokens_per_s,
            share=self.margin,
            max_tasks=self.max_tasks,
            ttl_s=self.ttl_s,
            kv_high_watermark=self.kv_high_watermark,
            transfer_tokens_per_s=self.transfer_tokens_per_s,
            decode_tokens_per_task=self.decode_tokens_per_task,
            discount_prealloc_kv=self.discount_prealloc_kv,
        ), None


def decode_pressure_reason(
    state: NodeState,
    *,
    itl_target_s: float,
    kv_high_watermark: float,
    batch_high_fraction: float,
    discount_prealloc_kv: bool = False,
) -> str | None:
    """Why decode needs the whole node now, or ``None`` (decode always wins): decode requests queued
    for admission, KV occupancy above the watermark (without the KV pre-allocated for requests still
    waiting for prefill, with ``discount_prealloc_kv``), a batch near ``max_running_requests``, or the
    recent step above the ITL target while a decode batch runs. Shared by every lending policy.

    A slow recent step on a node with no decode batch and none queued was borrowed prefill with no
    decode token beside it: no inter-token latency to protect, so it is not pressure (a decode that
    joins later gets its iterations' borrowed chunk capped by the ITL budget, ``ChunkLimits``)."""
    if state.queued_decode_requests > 0:
        return f"{state.queued_decode_requests} decode request(s) queued for admission"
    occupancy = state.kv_decoding_occupancy if discount_prealloc_kv else state.kv_occupancy
    if occupancy > kv_high_watermark:
        return f"KV occupancy {occupancy:.3f} above watermark {kv_high_watermark}"
    if state.decode_batch_size >= batch_high_fraction * state.max_running_requests:
        return f"batch {state.decode_batch_size} near max_running_requests {state.max_running_requests}"
    if state.decode_batch_size > 0 and state.recent_step_time_s > itl_target_s:
        return f"recent step {state.recent_step_time_s:.4f} s above ITL target {itl_target_s} s"
    return None


@dataclass(frozen=True, slots=True)
class DecodePressureRule:
    """A node policy's decode-pressure test (``decode_pressure_reason``) as data: what a node that
    holds no policy (the SGLang plugin, a wire-fed emulated node) is sent with its lease, so that it
    holds back a borrowed request that arrives under decode pressure, as the in-process node does
    (``ClusterScheduler.on_task_arrival``'s ``pause``), instead of starting it."""

    itl_target_s: float
    kv_high_watermark: float
    batch_high_fraction: float
    discount_prealloc_kv: bool = False

    def __post_init__(self) -> None:
        _check_positive("DecodePressureRule", itl_target_s=self.itl_target_s)
        _check_fraction(
            "DecodePressureRule",
            kv_high_watermark=self.kv_high_watermark,
            batch_high_fraction=self.batch_high_fraction,
        )

    def reason(self, state: NodeState) -> str | None:
        """Why decode needs the node now (``decode_pressure_reason``), or ``None``."""
        return decode_pressure_reason(
            state,
            itl_target_s=self.itl_target_s,
            kv_high_watermark=self.kv_high_watermark,
            batch_high_fraction=self.batch_high_fraction,
            discount_prealloc_kv=self.discount_prealloc_kv,
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "decode pressure rule") -> DecodePressureRule:
        """The rule in ``data`` (``to_dict``'s shape); ``ValueError`` naming ``source`` and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: must be an object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        numbers = names[:3]  # the flag after them has a default
        extra = sorted(set(data) - set(names))
        missing = [k for k in numbers if k not in data]
        if extra or missing:
            raise ValueError(f"{source}: unknown field(s) {extra}, missing field(s) {missing}")
        for k in numbers:
            value = data[k]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{source}: field {k!r} must be a finite number, got {value!r}")
        flag = data.get("discount_prealloc_kv", False)
        if not isinstance(flag, bool):
            raise ValueError(f"{source}: field 'discount_prealloc_kv' must be true or false, got {flag!r}")
        try:
            return cls(
                float(data["itl_target_s"]),
                float(data["kv_high_watermark"]),
                float(data["batch_high_fraction"]),
                flag,
            )
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


CHUNK_GRANULARITY_TOKENS = 64
"""Chunks within a step budget are sized in steps of this many tokens (the bisection's resolution)."""


def largest_chunk_within(
    cost: CostEstimator,
    decode_batch: int,
    decode_context_tokens: int,
    step_target_s: float,
    max_chunk_tokens: int,
) -> tuple[int, float]:
    """``(chunk tokens, mixed iteration time)`` of the largest prefill chunk (at most
    ``max_chunk_tokens``, in steps of ``CHUNK_GRANULARITY_TOKENS``) whose iteration mixed with a decode
    batch of ``decode_batch`` requests (``decode_context_tokens`` of KV in all) takes at most
    ``step_target_s`` by ``cost.mixed_step_time_s``. ``(0, 0.0)`` when even the smallest chunk breaks
    the target; an empty batch has no decode to protect and takes ``max_chunk_tokens``. The step time
    grows with the chunk, so bisection finds the largest."""

    def step(c: int) -> float:
        return cost.mixed_step_time_s(c, decode_batch, decode_context_tokens)

    if decode_batch == 0:
        return max_chunk_tokens, step(max_chunk_tokens)
    if smallest_chunk_breaks(cost, decode_batch, decode_context_tokens, step_target_s, max_chunk_tokens):
        return 0, 0.0
    if step(max_chunk_tokens) <= step_target_s:
        return max_chunk_tokens, step(max_chunk_tokens)
    # bisect in units of CHUNK_GRANULARITY_TOKENS: step(lo units) is within the target, hi's is not
    lo, hi = 1, -(-max_chunk_tokens // CHUNK_GRANULARITY_TOKENS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step(mid * CHUNK_GRANULARITY_TOKENS) <= step_target_s else (lo, mid)
    return lo * CHUNK_GRANULARITY_TOKENS, step(lo * CHUNK_GRANULARITY_TOKENS)


def smallest_chunk_breaks(
    cost: CostEstimator,
    decode_batch: int,
    decode_context_tokens: int,
    step_target_s: float,
    max_chunk_tokens: int,
) -> bool:
    """Whether ``largest_chunk_within(...)`` with these arguments finds no chunk (size 0): a running
    batch whose iteration with even the smallest chunk breaks ``step_target_s``: ``largest_chunk_within``'s
    first test, without the bisection that sizes a chunk that does fit."""
    if decode_batch == 0:
        return False
    smallest = min(CHUNK_GRANULARITY_TOKENS, max_chunk_tokens)
    return cost.mixed_step_time_s(smallest, decode_batch, decode_context_tokens) > step_target_s


def predict_safe(predictor: SafePrefillPredictor, state: NodeState) -> float:
    """The interference model's safe prefill tokens/s at ``state`` (0 for a non-finite answer)."""
    value = float(
        predictor.safe_prefill_tokens_per_s(
            decode_batch_size=state.decode_batch_size,
            context_tokens_mean=state.context_tokens_mean,
            context_tokens_std=state.context_tokens_std,
            remaining_output_tokens_mean=state.remaining_output_tokens_mean,
            kv_occupancy=state.kv_occupancy,
            remaining_output_tokens_max=state.remaining_output_tokens_max,
            remaining_output_tokens_context_weighted=state.remaining_output_tokens_context_weighted,
        )
    )
    return value if math.isfinite(value) and value > 0 else 0.0


def headroom_budgets(
    state: NodeState,
    safe_tokens_per_s: float,
    *,
    share: float,
    max_tasks: int,
    ttl_s: float,
    kv_high_watermark: float,
    transfer_tokens_per_s: float,
    decode_tokens_per_task: int,
    discount_prealloc_kv: bool = False,
) -> LeaseBudgets:
    """New headroom from a safe prefill rate, net of the borrowed work ``state`` already shows.

    prefill: ``share x safe rate x ttl_s`` minus queued borrowed tokens; tasks: ``max_tasks`` minus
    borrowed tasks, within the free decode slots; KV: free KV minus the running requests' remaining
    output not covered by reservations, never past ``kv_high_watermark`` (with ``discount_prealloc_kv``
    the watermark leaves out KV pre-allocated for requests waiting for prefill, and the budget keeps
    room for their expected output instead); transfer: the link share over
    the TTL, within the KV budget; decode work: ``tasks x decode_tokens_per_task``. Zero when the
    prefill or task budget would be zero (a lease nobody can use). Shared by the heuristic and the RL
    policy, which differ only in how they pick ``share`` and ``max_tasks``.
    """
    if not math.isfinite(safe_tokens_per_s) or safe_tokens_per_s <= 0 or share <= 0 or max_tasks <= 0:
        return LeaseBudgets.zero()
    prefill = int(share * safe_tokens_per_s * ttl_s) - state.borrowed_prefill_tokens_queued
    free_slots = state.max_running_requests - state.decode_batch_size - state.queued_decode_requests
    tasks = min(max_tasks - state.borrowed_tasks, free_slots - state.borrowed_tasks)
    if prefill <= 0 or tasks <= 0:
        return LeaseBudgets.zero()
    # KV must keep room for the running requests' remaining output beyond their reservations.
    output_need = state.decode_batch_size * state.remaining_output_tokens_mean
    counted_used = state.kv_used_tokens
    if discount_prealloc_kv:
        output_need += state.prealloc_waiting_output_tokens
        counted_used -= state.kv_prealloc_waiting_tokens
    uncovered_output = max(0, math.ceil(output_need) - state.kv_reserved_tokens)
    below_watermark = int(kv_high_watermark * state.kv_capacity_tokens) - (
        counted_used + state.kv_reserved_tokens
    )
    kv = max(0, min(state.kv_free_tokens - uncovered_output, below_watermark))
    return LeaseBudgets(
        prefill_tokens=prefill,
        kv_tokens=kv,
        transfer_tokens=min(kv, int(transfer_tokens_per_s * ttl_s)),
        decode_tokens=tasks * decode_tokens_per_task,
        tasks=tasks,
    )


def make_heuristic(
    ctx: PolicyContext,
    predictor: SafePrefillPredictor,
    *,
    itl_budget_share: float | None = DEFAULT_ITL_BUDGET_SHARE,
    **params: Any,
) -> HeuristicPolicy:
    """The heuristic on ``ctx``'s cluster with ``predictor``: ITL target the TPOT SLO, ITL budget
    ``itl_budget_share`` of it (``None``: no budget), chunks at most the cluster's prefill chunk, the
    cost estimator sizing them; ``params`` override any ``HeuristicPolicy`` field."""
    defaults: dict[str, Any] = {
        "itl_target_s": ctx.cluster.slo_tpot_s,
        "cost": ctx.cost,
        "max_chunk_tokens": ctx.cluster.prefill_chunk_tokens,
        "itl_budget_s": None
        if itl_budget_share is None
        else itl_budget_s(ctx.cluster.slo_tpot_s, itl_budget_share),
        "discount_prealloc_kv": True,
    }
    return HeuristicPolicy(predictor, **{**defaults, **params})


# ---- registry -------------------------------------------------------------------------------------
NodePolicyFactory = Callable[..., NodePolicy]
"""``factory(ctx: PolicyContext, **params) -> NodePolicy``."""

NodePolicyRegistry = Registry[NodePolicy]


def _default_registry() -> NodePolicyRegistry:
    registry = NodePolicyRegistry("node policy")
    registry.register("static", lambda ctx, **params: StaticPolicy(**params), summary="never lends")
    registry.register(
        "utilisation",
        lambda ctx, **params: UtilisationPolicy(**{"itl_target_s": ctx.cluster.slo_tpot_s, **params}),
        summary="lends a fixed slice while one utilisation figure is low",
    )
    registry.register(
        "heuristic",
        lambda ctx, **params: make_heuristic(ctx, ctx.require_predictor("heuristic"), **params),
        needs_predictor=True,
        summary="lends what the interference model predicts is safe, with a margin",
    )
    return registry


NODE_POLICIES = _default_registry()
"""The process-wide plug-in table (the only module-level mutable object: a registry of factories)."""


def register_node_policy(
    name: str,
    factory: NodePolicyFactory,
    *,
    needs_predictor: bool = False,
    summary: str = "",
    replace: bool = False,
) -> None:
    """Make ``make_node_policy(name, ctx, **params)`` call ``factory(ctx, **params)``."""
    NODE_POLICIES.register(name, factory, needs_predictor=needs_predictor, summary=summary, replace=replace)


def make_node_policy(name: str, ctx: PolicyContext, **params: Any) -> NodePolicy:
    """Build a registered node policy by name (``static``, ``utilisation``, ``heuristic``, ...)."""
    return NODE_POLICIES.make(name, ctx, **params)


def node_policy_names() -> list[str]:
    return NODE_POLICIES.names()

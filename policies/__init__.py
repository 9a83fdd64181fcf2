"""Leases, the lease ledger, node policies and the cluster scheduler's path choice.

Imports only ``interference_model`` (and the standard library / numpy); never ``envs``, ``serving``
or ``train``. See ``docs/leases.md`` for the lease life cycle and the decisions behind it.
"""

from __future__ import annotations

from policies.lease import BUDGET_FIELDS, Lease, LeaseBudgets
from policies.ledger import LeaseLedger, Reservation, ReservationStatus
from policies.node_policies import (
    NODE_POLICIES,
    HeuristicPolicy,
    NodePolicy,
    NodePolicyRegistry,
    SafePrefillPredictor,
    StaticPolicy,
    UtilisationPolicy,
    make_node_policy,
    node_policy_names,
    register_node_policy,
)
from policies.node_state import NodeState
from policies.rl_policy import RLPolicy  # registers the ``rl`` node policy
from policies.scheduler import ClusterScheduler, CostEstimator, PathDecision, PathQuery

__all__ = [
    "BUDGET_FIELDS",
    "NODE_POLICIES",
    "ClusterScheduler",
    "CostEstimator",
    "HeuristicPolicy",
    "Lease",
    "LeaseBudgets",
    "LeaseLedger",
    "NodePolicy",
    "NodePolicyRegistry",
    "NodeState",
    "PathDecision",
    "PathQuery",
    "RLPolicy",
    "Reservation",
    "ReservationStatus",
    "SafePrefillPredictor",
    "StaticPolicy",
    "UtilisationPolicy",
    "make_node_policy",
    "node_policy_names",
    "register_node_policy",
]

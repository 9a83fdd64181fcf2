"""Leases, the lease ledger, node policies, path policies, the peers and the cluster scheduler.

Imports only ``interference_model`` (and the standard library / numpy); never ``envs``, ``serving``
or ``train``. See ``docs/leases.md`` for the lease life cycle and the decisions behind it.
"""

from __future__ import annotations

from policies import peers  # registers the peers
from policies.catalog import PolicySpec, make_scheduler, policy_names, policy_spec
from policies.context import PolicyContext
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
from policies.path import PathPolicy, PathReason, make_path_policy, path_policy_names, register_path_policy
from policies.rl_policy import LearnedPath  # registers the ``rl`` and ``greedy-model`` policies
from policies.scheduler import ClusterScheduler, CostEstimator, PathDecision, PathQuery

__all__ = [
    "BUDGET_FIELDS",
    "NODE_POLICIES",
    "ClusterScheduler",
    "CostEstimator",
    "HeuristicPolicy",
    "LearnedPath",
    "Lease",
    "LeaseBudgets",
    "LeaseLedger",
    "NodePolicy",
    "NodePolicyRegistry",
    "NodeState",
    "PathDecision",
    "PathPolicy",
    "PathQuery",
    "PathReason",
    "PolicyContext",
    "PolicySpec",
    "Reservation",
    "ReservationStatus",
    "SafePrefillPredictor",
    "StaticPolicy",
    "UtilisationPolicy",
    "make_node_policy",
    "make_path_policy",
    "make_scheduler",
    "node_policy_names",
    "path_policy_names",
    "peers",
    "policy_names",
    "policy_spec",
    "register_node_policy",
    "register_path_policy",
]

"""What travels between a router or lease agent and an SGLang decode worker running the plugin.

Three things, all through SGLang 0.5.23's own HTTP server (no extra port, SGLang's API key applies):

* **The marker.** A borrowed request carries ``"do_local_prefill": true`` at the top level of its
  ``/generate`` (or OpenAI) body, plus the fallback prefill worker's bootstrap fields (a decode worker
  refuses a request without ``bootstrap_room``: ``scheduler.py`` 0.5.23, ``_handle_generate_request``).
  Stock SGLang drops unknown body keys, so the plugin's tokenizer-side hook carries the marker to the
  scheduler on ``routing_key`` (:func:`mark_routing_key`), the one request field that reaches ``Req``
  untouched and means nothing else unless the routing-key schedule policy is on; the scheduler side
  takes it off again (:func:`unmark_routing_key`) before anything else reads the key.
* **The lease.** ``POST /set_internal_state`` with :func:`lease_update_body`: numeric keys
  ``crossflow_lease_<budget>`` for the five budgets and ``crossflow_lease_ttl_s``, and optionally
  ``crossflow_lease_chunk_limits``: the lease policy's cap on each borrowed iteration by running batch
  (``policies.chunk_limits.ChunkLimits.to_dict``; absent: the token bucket alone paces borrowed
  prefill), and ``crossflow_lease_pressure_rule``: the lease policy's decode-pressure test
  (``policies.node_policies.DecodePressureRule.to_dict``), under which the worker holds a borrowed
  request that has not started yet, as the in-process node pauses it (absent: it starts when it
  fits). SGLang broadcasts a
  control request to every scheduler rank at the same point of its request stream, so all tensor
  parallel ranks install the lease at the same iteration and keep deciding alike. All budgets zero
  revokes the lease.
* **The node's state.** ``GET /server_info`` lists each data-parallel rank's internal state; the
  plugin adds ``crossflow`` to it: the ``NodeState`` the lease agent feeds its policy, the lease and
  queue the plugin holds (:func:`node_states_from_server_info`), and the request ids of the borrowed
  requests whose prefill has begun there (:func:`started_borrowed_from_server_info`): the router
  commits their reservations then, as the simulator commits one when the node starts it, so a
  revocation cannot take back room the node is already spending.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from policies.chunk_limits import ChunkLimits
from policies.lease import BUDGET_FIELDS, LeaseBudgets
from policies.node_policies import DecodePressureRule
from policies.node_state import NodeState

MARKER_FIELD = "do_local_prefill"
"""The request body field that asks a decode worker to prefill locally (SGLang PR #34773's name)."""

ROUTING_KEY_MARK = "crossflow-local-prefill"
"""What the tokenizer-side hook puts on ``routing_key`` (``<mark>`` or ``<mark>:<the client's key>``)."""

LEASE_KEY_PREFIX = "crossflow_lease_"
LEASE_TTL_KEY = f"{LEASE_KEY_PREFIX}ttl_s"
LEASE_KEYS: tuple[str, ...] = (*(f"{LEASE_KEY_PREFIX}{name}" for name in BUDGET_FIELDS), LEASE_TTL_KEY)
"""The ``server_args`` keys of a lease update, all required."""
LEASE_CHUNK_LIMITS_KEY = f"{LEASE_KEY_PREFIX}chunk_limits"
"""The optional key of a lease update that carries its ``ChunkLimits``."""
LEASE_PRESSURE_RULE_KEY = f"{LEASE_KEY_PREFIX}pressure_rule"
"""The optional key of a lease update that carries its ``DecodePressureRule``."""

INTERNAL_STATE_KEY = "crossflow"
"""The key the plugin adds to each scheduler's internal state (``/server_info``'s ``internal_states``)."""


def mark_routing_key(routing_key: str | None) -> str:
    """The routing key that carries the marker, keeping the client's own key after it."""
    return ROUTING_KEY_MARK if not routing_key else f"{ROUTING_KEY_MARK}:{routing_key}"


def unmark_routing_key(routing_key: str | None) -> tuple[bool, str | None]:
    """``(marked, the client's routing key)``: undoes :func:`mark_routing_key`; anything else is
    returned unchanged and unmarked."""
    if routing_key == ROUTING_KEY_MARK:
        return True, None
    if routing_key is not None and routing_key.startswith(ROUTING_KEY_MARK + ":"):
        return True, routing_key[len(ROUTING_KEY_MARK) + 1 :]
    return False, routing_key


def requests_local_prefill(body: bytes | str | Mapping[str, Any] | None) -> bool:
    """Whether a request body asks for decode-local prefill.

    Bytes or text are parsed as JSON only when the field name occurs in them (a prompt of token ids
    is not parsed twice for nothing). Raises ``ValueError`` naming the field when it is not a boolean,
    or when a batch body (several prompts) asks for it: borrowed requests are single requests, and
    SGLang 0.5.23 does not pass a batch's routing key on to its requests.
    """
    if body is None:
        return False
    if isinstance(body, bytes | str):
        raw = body.encode() if isinstance(body, str) else body
        if MARKER_FIELD.encode() not in raw:
            return False
        try:
            body = json.loads(raw)
        except ValueError:
            return False  # not JSON: the server's own parser reports it
    if not isinstance(body, Mapping) or body.get(MARKER_FIELD) is None:
        return False
    value = body[MARKER_FIELD]
    if not isinstance(value, bool):
        raise ValueError(f"{MARKER_FIELD} must be true or false, got {json.dumps(value)[:80]}")
    if value and _is_batch(body):
        raise ValueError(f"{MARKER_FIELD}: a batch of prompts cannot be prefilled locally; send each alone")
    return value


def _is_batch(body: Mapping[str, Any]) -> bool:
    """Several prompts in one body: ``text`` or ``prompt`` a list of strings, ``input_ids`` or
    ``prompt`` a list of token lists (an OpenAI ``prompt`` of token ids is one prompt)."""
    for key in ("text", "prompt", "input_ids"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            return True
    return False


class LeaseUpdate(NamedTuple):
    """A lease update as :func:`parse_lease_update` reads it."""

    budgets: LeaseBudgets
    ttl_s: float
    chunk_limits: ChunkLimits | None
    """The per-iteration cap on borrowed prefill (``None``: none sent)."""
    pressure_rule: DecodePressureRule | None = None
    """The test that holds un-started borrowed requests back (``None``: none sent)."""


def lease_update_body(
    budgets: LeaseBudgets,
    ttl_s: float,
    chunk_limits: ChunkLimits | None = None,
    pressure_rule: DecodePressureRule | None = None,
) -> dict[str, dict[str, Any]]:
    """The ``/set_internal_state`` body that installs ``budgets`` as the worker's lease for ``ttl_s``,
    with ``chunk_limits`` as its cap on each borrowed iteration and ``pressure_rule`` as the test that
    holds un-started borrowed requests back (each omitted when ``None``)."""
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError(f"lease ttl_s must be positive and finite, got {ttl_s!r}")
    args: dict[str, Any] = {f"{LEASE_KEY_PREFIX}{k}": v for k, v in budgets.to_dict().items()}
    args[LEASE_TTL_KEY] = float(ttl_s)
    if chunk_limits is not None:
        args[LEASE_CHUNK_LIMITS_KEY] = chunk_limits.to_dict()
    if pressure_rule is not None:
        args[LEASE_PRESSURE_RULE_KEY] = pressure_rule.to_dict()
    return {"server_args": args}


def is_lease_update(server_args: Mapping[str, Any]) -> bool:
    """Whether a ``set_internal_state`` request touches the lease (any ``crossflow_lease_*`` key)."""
    return any(str(k).startswith(LEASE_KEY_PREFIX) for k in server_args)


def parse_lease_update(server_args: Mapping[str, Any]) -> LeaseUpdate:
    """The lease update in ``server_args``; ``ValueError`` naming the keys that are missing, unknown
    or mixed with other settings, the budget that is not a non-negative integer, or what is wrong in
    the chunk limits or the pressure rule."""
    keys = set(server_args)
    missing = [k for k in LEASE_KEYS if k not in keys]
    optional = (LEASE_CHUNK_LIMITS_KEY, LEASE_PRESSURE_RULE_KEY)
    extra = sorted(k for k in keys if k not in LEASE_KEYS and k not in optional)
    if extra:
        raise ValueError(
            f"lease update: unexpected key(s) {extra}; send the lease keys {list(LEASE_KEYS)} alone"
        )
    if missing:
        raise ValueError(f"lease update: missing key(s) {missing}")
    ttl_s = server_args[LEASE_TTL_KEY]
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, int | float)
        or not (ttl_s > 0 and math.isfinite(ttl_s))
    ):
        raise ValueError(f"lease update: {LEASE_TTL_KEY} must be a positive number, got {ttl_s!r}")
    values = {name: server_args[f"{LEASE_KEY_PREFIX}{name}"] for name in BUDGET_FIELDS}
    budgets = LeaseBudgets.from_dict(values, source="lease update")
    limits = server_args.get(LEASE_CHUNK_LIMITS_KEY)
    chunk_limits = (
        None
        if limits is None
        else ChunkLimits.from_dict(limits, source=f"lease update: {LEASE_CHUNK_LIMITS_KEY}")
    )
    rule = server_args.get(LEASE_PRESSURE_RULE_KEY)
    pressure_rule = (
        None
        if rule is None
        else DecodePressureRule.from_dict(rule, source=f"lease update: {LEASE_PRESSURE_RULE_KEY}")
    )
    return LeaseUpdate(budgets, float(ttl_s), chunk_limits, pressure_rule)


def takes_lease_updates(server_info: Mapping[str, Any]) -> bool:
    """Whether a worker installs lease updates sent with :func:`lease_update_body`: every rank of its
    ``/server_info`` carries the plugin's ``crossflow.lease`` (the plugin always reports it, ``None``
    before its first lease). A worker without the plugin, or an emulated worker whose leases come
    from its own in-process scheduler, does not."""
    states = server_info.get("internal_states")
    if not isinstance(states, list) or not states:
        return False
    for state in states:
        plugin = state.get(INTERNAL_STATE_KEY) if isinstance(state, Mapping) else None
        if not isinstance(plugin, Mapping) or "lease" not in plugin:
            return False
    return True


def lease_update_accepted(answer: Any) -> bool:
    """Whether a ``/set_internal_state`` answer says the update was installed: SGLang 0.5.23 answers
    one boolean per data-parallel rank (``[true]``), false where no hook took the keys."""
    return isinstance(answer, list) and bool(answer) and all(a is True for a in answer)


def node_states_from_server_info(server_info: Mapping[str, Any]) -> list[NodeState]:
    """The ``NodeState`` of every data-parallel rank of a worker running the plugin, from its
    ``/server_info`` answer; ``ValueError`` when a rank reports none (the plugin is not loaded)."""
    states = server_info.get("internal_states")
    if not isinstance(states, list) or not states:
        raise ValueError("server_info has no internal_states (is this an SGLang 0.5.23 worker?)")
    out = []
    for i, state in enumerate(states):
        plugin = state.get(INTERNAL_STATE_KEY) if isinstance(state, Mapping) else None
        if not isinstance(plugin, Mapping) or not isinstance(plugin.get("node_state"), Mapping):
            raise ValueError(
                f"internal_states[{i}] has no {INTERNAL_STATE_KEY}.node_state: is the Crossflow plugin "
                "loaded (SGLANG_PLUGINS=crossflow) and the worker in decode mode?"
            )
        out.append(NodeState(**plugin["node_state"]))
    return out


STARTED_BORROWED_KEY = "started_borrowed"
"""The plugin's list (under ``crossflow``) of the borrowed request ids whose prefill has begun there."""


def is_request_id_list(value: object) -> bool:
    """Whether ``value`` is a list of request ids (strings), as ``started_borrowed`` must be wherever
    it travels: from the node to its lease agent, and from the agent to the router."""
    return isinstance(value, list) and all(isinstance(r, str) for r in value)


def started_borrowed_from_server_info(server_info: Mapping[str, Any]) -> list[str]:
    """The request ids of the borrowed requests whose prefill has begun on any data-parallel rank of a
    worker running the plugin (sorted, no repeats); none from a rank that does not report them (a
    plugin older than the key). ``ValueError`` when a rank reports something other than strings."""
    states = server_info.get("internal_states")
    out: set[str] = set()
    for i, state in enumerate(states if isinstance(states, list) else ()):
        plugin = state.get(INTERNAL_STATE_KEY) if isinstance(state, Mapping) else None
        rids = plugin.get(STARTED_BORROWED_KEY) if isinstance(plugin, Mapping) else None
        if rids is None:
            continue
        if not is_request_id_list(rids):
            raise ValueError(
                f"internal_states[{i}].{INTERNAL_STATE_KEY}.{STARTED_BORROWED_KEY} must be a list of "
                "request ids"
            )
        out.update(rids)
    return sorted(out)


__all__ = [
    "INTERNAL_STATE_KEY",
    "LEASE_CHUNK_LIMITS_KEY",
    "LEASE_KEYS",
    "LEASE_KEY_PREFIX",
    "LEASE_PRESSURE_RULE_KEY",
    "LEASE_TTL_KEY",
    "MARKER_FIELD",
    "ROUTING_KEY_MARK",
    "STARTED_BORROWED_KEY",
    "LeaseUpdate",
    "is_lease_update",
    "is_request_id_list",
    "lease_update_accepted",
    "lease_update_body",
    "mark_routing_key",
    "node_states_from_server_info",
    "parse_lease_update",
    "requests_local_prefill",
    "started_borrowed_from_server_info",
    "takes_lease_updates",
    "unmark_routing_key",
]

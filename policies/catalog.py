"""The policies a user names (``crossflow compare --policies ...``): a node policy plus a path policy.

A ``PolicySpec`` names a registered node policy (lease sizing, ``policies.node_policies``) and a
registered path policy (per-request path, ``policies.path``), the grid ``crossflow tune`` searches, and
where its rule comes from. ``make_scheduler(name, ctx)`` builds the ``ClusterScheduler`` the simulator
and the router run, with the tuned values shipped in ``policies/data/`` unless given others: a model
``crossflow tune --model M`` was run for has its own file (``tuned_policies-M.json``), and every other
model, or a policy that file does not hold, takes ``tuned_policies.json`` (tuned on
``DEFAULT_TUNED_MODEL``). What a policy needs (a predictor) is declared by its node and path
registrations; nobody keys on its name.

Parameters are flat, dotted by the part they configure: ``node.ttl_s`` goes to the node policy's
factory, ``path.local_chunk_tokens`` to the path policy's, ``scheduler.itl_guard`` to
``ClusterScheduler``. Adding a policy is one file that registers its path policy (if new) and its
``PolicySpec`` (see ``policies/peers/``).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies import lease_path  # noqa: F401  (registers the ``lease`` path policy)
from policies.context import PolicyContext
from policies.ledger import LeaseLedger
from policies.node_policies import NODE_POLICIES, make_node_policy
from policies.path import PATH_POLICIES, make_path_policy
from policies.scheduler import ClusterScheduler

PARAM_GROUPS = ("node", "path", "scheduler")
"""The parts a dotted parameter name may address."""
SCHEDULER_PARAMS = ("itl_guard",)
"""``ClusterScheduler`` keyword arguments a policy may set (the control interval is the cluster's)."""

TUNED_FORMAT = "crossflow-tuned-policies/1"
TUNED_DIR = Path(__file__).resolve().parent / "data"
TUNED_FILE = TUNED_DIR / "tuned_policies.json"
"""Tuned values shipped with the project (written by ``crossflow tune``, with its command line); the
values of every model without a file of its own (``model_tuned_file``)."""
DEFAULT_TUNED_MODEL = "gpt-oss-120b"
"""The model ``TUNED_FILE`` was tuned on (its ``spec.model``)."""


def model_tuned_file(model: str, folder: str | Path | None = None) -> Path:
    """Where the tuned values of ``model`` live in ``folder`` (default: the shipped ``TUNED_DIR``):
    ``tuned_policies.json`` for ``DEFAULT_TUNED_MODEL``, ``tuned_policies-<model>.json`` for any other
    model (whether or not it exists yet)."""
    root = Path(folder) if folder is not None else TUNED_DIR
    key = model.strip().lower()
    if key == DEFAULT_TUNED_MODEL:
        return root / TUNED_FILE.name
    if not _file_name_model(key):
        raise ValueError(f"model {model!r}: not a catalog model name a tuned file can carry")
    return root / f"tuned_policies-{key}.json"


def _file_name_model(key: str) -> bool:
    """Whether ``key`` (a lower-cased model name) can name a tuned file: a catalog name, not a Hugging
    Face id or a config path (those run the default model's values)."""
    return bool(key) and "/" not in key and "\\" not in key and not key.startswith(".")


@dataclass(frozen=True)
class PolicySpec:
    """A user-facing policy (see the module docstring)."""

    name: str
    summary: str
    node: str = "static"
    """Node policy registry name."""
    path: str = "normal"
    """Path policy registry name."""
    grid: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """Tuning axes: dotted parameter name -> values (the grid is their product)."""
    source: str = ""
    """Where the rule comes from (a paper, or a file and line of a public repository)."""
    passive: bool = False
    """Runs with no scheduler at all: every request on the normal path, no control ticks."""
    grid_level: bool = False
    """Chosen over whole simulations after the fact (``hindsight-split``), not a per-request rule:
    ``compare`` and ``tune`` build it from static runs; ``make_scheduler`` refuses it."""
    tuned_from: str | None = None
    """Another policy whose shipped tuned values this one runs with for every part but its path
    policy (its own tuned values, if any, take precedence): ``rl`` sizes leases as the tuned
    ``heuristic`` does."""
    bundle_of: str | None = None
    """For a policy bundle's alias (``train.compare.add_bundles``): the catalog policy it runs, with
    the bundle's parameters laid over that policy's shipped tuned values."""

    @property
    def needs_predictor(self) -> bool:
        """Whether building it needs the interference model (declared by its node or path policy)."""
        if self.grid_level or self.passive:
            return False
        return (
            NODE_POLICIES.entry(self.node).needs_predictor or PATH_POLICIES.entry(self.path).needs_predictor
        )

    def grid_points(self) -> list[dict[str, Any]]:
        """Every parameter combination of ``grid`` (one empty combination when there is no grid)."""
        names = list(self.grid)
        return [dict(zip(names, values, strict=True)) for values in itertools.product(*self.grid.values())]

    def split_params(
        self, params: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """``{"node.x": 1, "path.y": 2}`` -> ``({"x": 1}, {"y": 2}, {})``; unknown groups raise."""
        parts: dict[str, dict[str, Any]] = {g: {} for g in PARAM_GROUPS}
        for key, value in params.items():
            group, _, name = key.partition(".")
            if group not in parts or not name:
                raise ValueError(
                    f"policy {self.name!r}: parameter {key!r} must be '<part>.<name>' with part one of "
                    f"{', '.join(PARAM_GROUPS)}"
                )
            if group == "scheduler" and name not in SCHEDULER_PARAMS:
                raise ValueError(f"policy {self.name!r}: unknown scheduler parameter {name!r}")
            parts[group][name] = value
        return parts["node"], parts["path"], parts["scheduler"]


_CATALOG: dict[str, PolicySpec] = {}


def register_policy(spec: PolicySpec, *, replace: bool = False) -> None:
    """Add ``spec`` to the catalog (its node and path policies must be registered already)."""
    if spec.name in _CATALOG and not replace:
        raise ValueError(f"policy {spec.name!r} is already registered (pass replace=True to override)")
    if not spec.grid_level:
        NODE_POLICIES.entry(spec.node)
        PATH_POLICIES.entry(spec.path)
    for key in spec.grid:
        spec.split_params({key: None})
    _CATALOG[spec.name] = spec


def policy_spec(name: str) -> PolicySpec:
    try:
        return _CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {policy_names()}") from None


def policy_names() -> list[str]:
    return sorted(_CATALOG)


def make_scheduler(
    name: str,
    ctx: PolicyContext,
    params: Mapping[str, Any] | None = None,
    *,
    ledger: LeaseLedger | None = None,
    model: str | None = None,
) -> ClusterScheduler | None:
    """The scheduler that runs policy ``name`` (``None`` for a passive one such as ``static``).

    ``params``: dotted parameters; ``None`` takes the shipped tuned values for ``model``
    (``tuned_params``), ``{}`` every factory's defaults.
    """
    spec = policy_spec(name)
    if spec.grid_level:
        raise ValueError(
            f"policy {name!r} is chosen over whole simulations after the fact, not per request: "
            "`crossflow compare` and `crossflow tune` build it from static runs"
        )
    if spec.passive:
        return None
    node_params, path_params, scheduler_params = spec.split_params(
        tuned_params(name, model) if params is None else params
    )
    node = make_node_policy(spec.node, ctx, **node_params)
    path = make_path_policy(spec.path, ctx, **path_params)
    return ClusterScheduler(
        node,
        ledger if ledger is not None else LeaseLedger(),
        ctx.cost,
        path=path,
        control_interval_s=ctx.cluster.control_interval_s,
        **scheduler_params,
    )


# ---- tuned values ---------------------------------------------------------------------------------
def load_tuned(path: str | Path = TUNED_FILE) -> dict[str, Any]:
    """The tuned-values file (``{}`` when it does not exist), checked: errors name the file and field."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != TUNED_FORMAT:
        raise ValueError(f"{p}: field 'format' must be {TUNED_FORMAT!r}")
    policies = data.get("policies")
    if not isinstance(policies, dict):
        raise ValueError(f"{p}: field 'policies' must be an object")
    for name, entry in policies.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("params"), dict):
            raise ValueError(f"{p}: field 'policies.{name}.params' must be an object")
        if name in _CATALOG:
            try:
                _CATALOG[name].split_params(entry["params"])
            except ValueError as exc:
                raise ValueError(f"{p}: policies.{name}.params: {exc}") from None
    return data


@functools.lru_cache(maxsize=8)
def _shipped_tuned(model: str) -> dict[str, Any]:
    """The shipped tuned file of ``model`` (``{}`` when it has none), checked to be tuned on it."""
    path = model_tuned_file(model)
    data = load_tuned(path)
    tuned_on = data.get("spec", {}).get("model") if data else model
    if str(tuned_on).lower() != model:
        raise ValueError(f"{path}: field 'spec.model' is {tuned_on!r}, the file holds {model!r}'s values")
    return data


def tuned_entry(name: str, model: str | None = None) -> tuple[dict[str, Any], str | None]:
    """Policy ``name``'s shipped tuned entry for ``model`` (its catalog name, any case) and the model it
    was tuned on: the model's own file when it holds the policy, else ``TUNED_FILE`` (``({}, None)``:
    not tuned)."""
    keys = [m.strip().lower() for m in (model, DEFAULT_TUNED_MODEL) if m]
    for source in dict.fromkeys(k for k in keys if _file_name_model(k)):
        entry = _shipped_tuned(source).get("policies", {}).get(name)
        if entry:
            return entry, source
    return {}, None


def tuned_params(name: str, model: str | None = None) -> dict[str, Any]:
    """The shipped tuned parameters of policy ``name`` for ``model`` (``tuned_entry``; ``{}``: not
    tuned, factory defaults), with the non-path ones of its ``tuned_from`` policy underneath."""
    entry, _ = tuned_entry(name, model)
    own = dict(entry["params"]) if entry else {}
    source = _CATALOG[name].tuned_from if name in _CATALOG else None
    if source is None:
        return own
    inherited = {k: v for k, v in tuned_params(source, model).items() if not k.startswith("path.")}
    return {**inherited, **own}


def describe_params(names: Sequence[str], models: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """The parameters each of ``names`` runs with by default on each of ``models`` (shipped tuned
    values, and the model they were tuned on), for run records."""
    return {
        n: {
            m: {"params": tuned_params(n, m), "tuned_on": tuned_entry(n, m)[1]}
            for m in (models or (DEFAULT_TUNED_MODEL,))
        }
        for n in names
    }


# ---- the house's own policies (peers register theirs in ``policies/peers/``) -------------------------
CROSSFLOW_SOURCE = "this repository: policies/node_policies.py, policies/lease_path.py, docs/leases.md"

register_policy(
    PolicySpec(
        "static",
        "static PD as SGLang runs it: every request on the normal path, no leases",
        passive=True,
    )
)
register_policy(
    PolicySpec(
        "utilisation",
        "naive lending baseline: a fixed lease slice while step time and batch share are low",
        node="utilisation",
        path="lease",
        source=CROSSFLOW_SOURCE,
    )
)
register_policy(
    PolicySpec(
        "heuristic",
        "Crossflow: leases sized by the interference model, borrowed on congestion when faster",
        node="heuristic",
        path="lease",
        grid={"node.ttl_s": (2.0, 8.0), "node.margin": (0.8, 1.0), "scheduler.itl_guard": ("slo", None)},
        source=CROSSFLOW_SOURCE,
    )
)
register_policy(
    PolicySpec(
        "heuristic-shed",
        "Crossflow's heuristic with admission control: past capacity, requests no path serves within 2x "
        "the TTFT SLO are shed (SLO misses)",
        node="heuristic",
        path="lease-shed",
        grid=dict(policy_spec("heuristic").grid),
        source=CROSSFLOW_SOURCE,
    )
)

__all__ = [
    "CROSSFLOW_SOURCE",
    "DEFAULT_TUNED_MODEL",
    "PolicySpec",
    "describe_params",
    "load_tuned",
    "make_scheduler",
    "model_tuned_file",
    "policy_names",
    "policy_spec",
    "register_policy",
    "tuned_entry",
    "tuned_params",
]

"""Policy bundles: one versioned folder that says everything a lease policy runs with.

A bundle is what ``crossflow simulate --policy-bundle``, ``crossflow compare --policy-bundle`` and
``crossflow serve/router --policy`` load instead of a policy name: the catalog policy
(``policies.catalog``), its node and path policy, every dotted parameter it runs with (the tuned
thresholds included), and the artifacts it needs, copied into the folder and pinned by SHA-256::

    my-bundle/
      bundle.json              the manifest (format below)
      interference_model/      model.txt + metadata.json (policies that need a predictor)
      rl_policy.npz, .json     trained RL weights (path policy ``rl``)

``bundle.json``::

    {"format": "crossflow-policy-bundle/1", "name": "heuristic-h200", "version": 1,
     "policy": "heuristic", "node_policy": "heuristic", "path_policy": "lease",
     "params": {"node.ttl_s": 8.0, ...},
     "files": {"interference_model/model.txt": "<sha256>", ...},
     "interference_model": "interference_model" | null, "rl_policy": "rl_policy.npz" | null,
     "created_utc": "...", "command": "crossflow bundle ..."}

:func:`load_policy_bundle` checks the manifest and every file hash (a mismatch or a missing file fails
naming the file) and returns a :class:`PolicyBundle`, whose :meth:`PolicyBundle.scheduler_params` is
what ``catalog.make_scheduler`` takes and :meth:`PolicyBundle.make_scheduler` builds the scheduler from a
``PolicyContext``. :func:`resolve_bundle` turns a W&B reference ``wandb:ENTITY/PROJECT/NAME:VERSION``
into a local folder (the local cache first; the W&B API only when the reference is not cached).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from policies.catalog import make_scheduler, policy_spec, tuned_params

BUNDLE_FORMAT = "crossflow-policy-bundle/1"
MANIFEST = "bundle.json"
IM_DIR = "interference_model"
RL_FILE = "rl_policy.npz"
CACHE_ENV = "CROSSFLOW_BUNDLE_CACHE"
"""Folder of W&B-referenced bundles already downloaded (default ``~/.cache/crossflow/bundles``)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class PolicyBundle:
    """A loaded, verified bundle (see the module docstring)."""

    folder: Path
    name: str
    version: int
    policy: str
    params: Mapping[str, Any]
    files: Mapping[str, str] = field(default_factory=dict)
    interference_model: Path | None = None
    rl_policy: Path | None = None

    @property
    def digest(self) -> str:
        """SHA-256 over the manifest's policy, parameters and file hashes: two bundles that run the
        same policy with the same artifacts have the same digest, whatever their folder."""
        payload = json.dumps(
            {"policy": self.policy, "params": dict(self.params), "files": dict(self.files)},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def scheduler_params(self) -> dict[str, Any]:
        """The dotted parameters ``catalog.make_scheduler`` takes (the RL weights' path included)."""
        params = dict(self.params)
        if self.rl_policy is not None:
            from policies.rl_policy import ARTIFACT_PARAM

            params[ARTIFACT_PARAM] = str(self.rl_policy)
        return params

    def run_params(self, model: str | None = None) -> dict[str, Any]:
        """What the bundle runs with on ``model``: ``scheduler_params`` laid over its policy's shipped
        tuned values for that model (``simulate``, ``compare``, ``serve`` and ``router`` alike)."""
        return {**tuned_params(self.policy, model), **self.scheduler_params()}

    def point_params(self) -> tuple[tuple[str, Any], ...]:
        """``scheduler_params`` as a sorted tuple (``train.experiment.Point.policy_params``)."""
        return tuple(sorted(self.scheduler_params().items()))

    def load_predictor(self, gpu: str, model: str, tp: int) -> Any:
        """The bundle's interference model for (gpu, model, tp); None when the bundle has none."""
        if self.interference_model is None:
            return None
        from interference_model.artifact import load_predictor

        return load_predictor(self.interference_model, gpu=gpu, model=model, tp=tp)

    def make_scheduler(self, ctx: Any, model: str | None = None) -> Any:
        """The ``ClusterScheduler`` of this bundle on ``ctx`` (a ``PolicyContext`` whose predictor is the
        bundle's interference model when the policy needs one) serving ``model``: ``run_params``."""
        return make_scheduler(self.policy, ctx, self.run_params(model))


def _fail(path: Path, problem: str) -> ValueError:
    return ValueError(f"{path}: {problem}")


def load_policy_bundle(folder: str | os.PathLike[str]) -> PolicyBundle:
    """Read and verify the bundle in ``folder``; errors name the file and field."""
    root = Path(folder)
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{root}: not a policy bundle (no {MANIFEST})")
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(manifest, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        raise _fail(manifest, f"field 'format' must be {BUNDLE_FORMAT!r}")
    for key, kind in (("name", str), ("version", int), ("policy", str), ("params", dict), ("files", dict)):
        if not isinstance(data.get(key), kind):
            raise _fail(manifest, f"field {key!r} must be a {kind.__name__}")
    try:
        spec = policy_spec(data["policy"])
    except KeyError as exc:
        raise _fail(manifest, f"field 'policy': {exc.args[0]}") from None
    for key, have in (("node_policy", spec.node), ("path_policy", spec.path)):
        if key in data and data[key] != have:
            raise _fail(manifest, f"field {key!r} is {data[key]!r} but policy {spec.name!r} runs {have!r}")
    try:
        spec.split_params(data["params"])
    except ValueError as exc:
        raise _fail(manifest, f"field 'params': {exc}") from None
    for rel, digest in data["files"].items():
        path = root / rel
        if not path.is_file():
            raise _fail(path, f"listed in {MANIFEST} but missing")
        if _sha256(path) != digest:
            raise _fail(path, f"SHA-256 differs from {MANIFEST} (the bundle was changed after it was made)")
    im = data.get("interference_model")
    rl = data.get("rl_policy")
    if spec.needs_predictor and im is None:
        raise _fail(manifest, f"field 'interference_model': policy {spec.name!r} needs one")
    if rl is not None:
        from policies.rl_policy import load_artifact

        load_artifact(root / rl)
    return PolicyBundle(
        folder=root,
        name=data["name"],
        version=data["version"],
        policy=spec.name,
        params=dict(data["params"]),
        files=dict(data["files"]),
        interference_model=None if im is None else root / im,
        rl_policy=None if rl is None else root / rl,
    )


def write_policy_bundle(
    out: str | os.PathLike[str],
    *,
    name: str,
    policy: str,
    params: Mapping[str, Any] | None = None,
    model: str | None = None,
    interference_model: str | os.PathLike[str] | None = None,
    rl_policy: str | os.PathLike[str] | None = None,
    version: int = 1,
    command: str = "",
) -> PolicyBundle:
    """Make a bundle folder at ``out`` (which must not exist or be empty); ``params`` None takes the
    shipped tuned values for ``model``. Written into a temp folder and renamed, so a failure leaves
    nothing."""
    spec = policy_spec(policy)
    if spec.passive or spec.grid_level:
        raise ValueError(f"policy {policy!r} has no scheduler to bundle")
    dest = Path(out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"{dest}: exists and is not an empty folder")
    chosen = dict(tuned_params(policy, model) if params is None else params)
    spec.split_params(chosen)
    if spec.needs_predictor and interference_model is None:
        raise ValueError(f"policy {policy!r} needs an interference model (interference_model=DIR)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        files: dict[str, str] = {}
        if interference_model is not None:
            src = Path(interference_model)
            for fname in ("model.txt", "metadata.json"):
                if not (src / fname).is_file():
                    raise ValueError(f"{src}: not an interference-model artifact (no {fname})")
            shutil.copytree(src, tmp / IM_DIR)
        if rl_policy is not None:
            from policies.rl_policy import load_artifact

            npz = Path(rl_policy).with_suffix(".npz")
            load_artifact(npz)
            shutil.copyfile(npz, tmp / RL_FILE)
            shutil.copyfile(npz.with_suffix(".json"), (tmp / RL_FILE).with_suffix(".json"))
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            files[path.relative_to(tmp).as_posix()] = _sha256(path)
        manifest = {
            "format": BUNDLE_FORMAT,
            "name": name,
            "version": int(version),
            "policy": spec.name,
            "node_policy": spec.node,
            "path_policy": spec.path,
            "params": chosen,
            "files": files,
            "interference_model": IM_DIR if interference_model is not None else None,
            "rl_policy": RL_FILE if rl_policy is not None else None,
            "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        for path in [tmp, *tmp.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_policy_bundle(dest)


# ---- W&B references ---------------------------------------------------------------------------------
WANDB_PREFIX = "wandb:"


def parse_wandb_reference(ref: str) -> tuple[str, str, str, str]:
    """``wandb:ENTITY/PROJECT/NAME:VERSION`` -> (entity, project, name, version)."""
    body = ref.removeprefix(WANDB_PREFIX)
    path, sep, version = body.rpartition(":")
    parts = path.split("/")
    if not sep or len(parts) != 3 or not all(parts) or not version:
        raise ValueError(f"W&B bundle reference must be wandb:ENTITY/PROJECT/NAME:VERSION, got {ref!r}")
    return parts[0], parts[1], parts[2], version


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "crossflow" / "bundles")


def resolve_bundle(ref: str | os.PathLike[str]) -> Path:
    """A local bundle folder for ``ref``: a folder path as is; a W&B reference from the local cache
    (``CACHE_ENV``/ENTITY/PROJECT/NAME/VERSION), else downloaded there through the W&B API, which needs
    ``wandb login`` and ``WANDB_MODE`` other than offline/disabled."""
    text = str(ref)
    if not text.startswith(WANDB_PREFIX):
        return Path(text)
    entity, project, name, version = parse_wandb_reference(text)
    local = cache_dir() / entity / project / name / version
    if (local / MANIFEST).is_file():
        return local
    if os.environ.get("WANDB_MODE", "offline").lower() in ("offline", "dryrun", "disabled"):
        raise FileNotFoundError(
            f"{text}: not in the local bundle cache ({local}) and W&B is offline; set WANDB_MODE=online "
            f"after `wandb login`, or put the bundle folder there (${CACHE_ENV} moves the cache)"
        )
    import wandb

    artifact = wandb.Api().artifact(f"{entity}/{project}/{name}:{version}", type="policy-bundle")
    artifact.download(root=str(local))
    return local


__all__ = [
    "BUNDLE_FORMAT",
    "PolicyBundle",
    "load_policy_bundle",
    "parse_wandb_reference",
    "resolve_bundle",
    "write_policy_bundle",
]

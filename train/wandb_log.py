"""W&B helpers shared by `crossflow compare` and RL training: offline by default, never needs a login.

W&B is slow to start per process, so callers collect what to log as :class:`RunLog` records and log
them all at the end from one process (:func:`log_runs`), finishing each run before the next starts.

Linking the interference-model artifact: ``run.use_artifact`` is refused in offline mode (measured with
wandb 0.31: ``TypeError: Cannot use artifact when in offline mode``), so offline runs record the
artifact's folder name, the SHA-256 of its model file and its key metadata in the run config
(``interference_model``); online runs additionally call ``use_artifact`` with a local
``wandb.Artifact`` of the folder, which links it as the run's input.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PROJECT = "crossflow"


def default_to_offline() -> None:
    """``WANDB_MODE=offline`` (and silent) unless the user already chose a mode."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")


def is_offline() -> bool:
    return os.environ.get("WANDB_MODE", "offline").lower() in ("offline", "dryrun", "disabled")


def artifact_reference(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What identifies an interference-model artifact folder: name, model-file SHA-256, key metadata.

    Reads ``metadata.json`` and ``model.txt`` directly (only identification, no validation: the loader
    validates). Raises ``ValueError`` naming the file when either is missing or unreadable.
    """
    path = Path(folder)
    meta_path, model_path = path / "metadata.json", path / "model.txt"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable interference-model artifact ({exc})") from exc
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object")
    keys = ("hardware", "model", "tp", "itl_target", "data_sha256", "format_version")
    return {"name": path.name, "model_sha256": digest, **{k: meta.get(k) for k in keys}}


@dataclass
class RunLog:
    """One W&B run to create: name, grouping, config, final summary and optional history rows."""

    name: str
    group: str
    tags: Sequence[str]
    config: Mapping[str, Any]
    summary: Mapping[str, Any]
    history: Sequence[Mapping[str, Any]] = field(default_factory=list)
    """Rows logged in order (one ``run.log`` each), e.g. a per-minute timeline."""
    artifact_dir: str | None = None
    """Interference-model artifact folder this run used (referenced in config; linked when online)."""
    job_type: str = "compare"
    images: Mapping[str, str] = field(default_factory=dict)
    """Plots to log as ``wandb.Image`` under these keys (PNG paths)."""
    tables: Mapping[str, tuple[Sequence[str], Sequence[Sequence[Any]]]] = field(default_factory=dict)
    """``wandb.Table`` s to log: key -> (columns, rows), e.g. one row per seed."""
    output_artifact: tuple[str, str, Sequence[str]] | None = None
    """(name, type, file paths) logged as a versioned output artifact of the run (offline too: it is
    uploaded by ``wandb sync``)."""
    policy_bundle: str | None = None
    """The policy bundle folder the run ran (:func:`log_bundle_artifact`: a ``policy-bundle`` artifact,
    its identity in the config as ``policy_bundle``)."""


def _link_artifact(run: Any, folder: str) -> str:
    """Reference (offline) or link (online) the artifact; returns how ("config" or "use_artifact")."""
    import wandb

    if is_offline():
        return "config"
    try:
        ref = artifact_reference(folder)
        artifact = wandb.Artifact(f"interference-{ref['name']}", type="interference-model", metadata=ref)
        artifact.add_dir(folder)
        run.use_artifact(artifact)
        return "use_artifact"
    except Exception as exc:  # online linking can fail for many reasons (network, quota); config suffices
        print(f"wandb: could not link artifact {folder}: {exc}; referenced in config only", file=sys.stderr)
        return "config"


def _bundle_artifact(folder: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """A ``policy-bundle`` artifact of a bundle folder (verified), named after the bundle, and the
    bundle's identity (name, version, policy, digest)."""
    import wandb

    from policies.bundle import load_policy_bundle

    bundle = load_policy_bundle(folder)
    meta = {"name": bundle.name, "policy": bundle.policy, "version": bundle.version, "digest": bundle.digest}
    artifact = wandb.Artifact(
        bundle.name, type="policy-bundle", metadata={**meta, "files": dict(bundle.files)}
    )
    artifact.add_dir(str(folder))
    return artifact, meta


def log_bundle_artifact(run: Any, folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Record that ``run`` ran the bundle in ``folder``; its identity and how it was linked.

    Online: ``use_artifact`` (the bundle becomes a versioned artifact and the run's input: lineage).
    Offline W&B refuses ``use_artifact``, so the run logs it as its output instead: the artifact's
    manifest is in the offline run's log and ``wandb sync`` uploads it (the same bytes give the same
    version, so many runs of one bundle make one version). Either way the config's ``policy_bundle``
    holds the bundle's name, version, policy and digest."""
    artifact, meta = _bundle_artifact(folder)
    if is_offline():
        run.log_artifact(artifact)
        link = "log_artifact"
    else:
        try:
            run.use_artifact(artifact)
            link = "use_artifact"
        except Exception as exc:  # see _link_artifact
            print(f"wandb: could not link {folder}: {exc}; logged as the run's output", file=sys.stderr)
            run.log_artifact(artifact)
            link = "log_artifact"
    run.config.update({"policy_bundle": {**meta, "link": link}})
    return {**meta, "link": link}


def log_bundle(
    folder: str | os.PathLike[str], *, wandb_dir: str | os.PathLike[str], project: str = DEFAULT_PROJECT
) -> str:
    """Log a policy bundle folder as a versioned ``policy-bundle`` artifact named after the bundle, in
    a ``job_type="bundle"`` run; returns the local run folder. Offline, the artifact is uploaded by
    ``wandb sync`` and then resolves as ``wandb:ENTITY/PROJECT/NAME:v0`` (``policies.bundle``)."""
    import wandb

    default_to_offline()
    artifact, meta = _bundle_artifact(folder)
    Path(wandb_dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project, name=f"bundle|{meta['name']}", job_type="bundle", config=meta, dir=str(wandb_dir)
    )
    run.log_artifact(artifact)
    where = str(Path(run.dir).parent)
    run.finish()
    return where


def log_runs(
    runs: Sequence[RunLog], *, wandb_dir: str | os.PathLike[str], project: str = DEFAULT_PROJECT
) -> list[str]:
    """Create one W&B run per record, sequentially, in this process; returns the local run folders.

    ``wandb_dir`` is where W&B writes (offline runs stay there until ``wandb sync``). A failure to log
    one run is reported on stderr and the rest continue; an empty list means W&B is not installed.
    """
    default_to_offline()
    try:
        import wandb
    except ImportError:
        print("wandb is not installed; skipping W&B logging", file=sys.stderr)
        return []
    Path(wandb_dir).mkdir(parents=True, exist_ok=True)
    folders: list[str] = []
    for rec in runs:
        config = dict(rec.config)
        if rec.artifact_dir is not None:
            config["interference_model"] = artifact_reference(rec.artifact_dir)
        try:
            run = wandb.init(
                project=project,
                group=rec.group,
                name=rec.name,
                tags=list(rec.tags),
                job_type=rec.job_type,
                config=config,
                dir=str(wandb_dir),
            )
            if rec.artifact_dir is not None:
                run.config.update({"interference_model_link": _link_artifact(run, rec.artifact_dir)})
            for row in rec.history:
                run.log(dict(row))
            if rec.images:
                run.log({key: wandb.Image(path) for key, path in rec.images.items()})
            for key, (columns, rows) in rec.tables.items():
                run.log({key: wandb.Table(columns=list(columns), data=[list(r) for r in rows])})
            if rec.output_artifact is not None:
                name, kind, paths = rec.output_artifact
                artifact = wandb.Artifact(name, type=kind)
                for path in paths:
                    artifact.add_file(str(path))
                run.log_artifact(artifact)
            if rec.policy_bundle is not None:
                log_bundle_artifact(run, rec.policy_bundle)
            run.summary.update(dict(rec.summary))
            folders.append(str(Path(run.dir).parent))
            run.finish()
        except Exception as exc:  # W&B has many failure modes (disk, network online); the results stand
            print(f"wandb: logging run {rec.name!r} failed: {exc}", file=sys.stderr)
    return folders

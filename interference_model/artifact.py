"""Versioned artifacts: a folder with ``model.txt`` (LightGBM text) and ``metadata.json``.

The metadata records what a consumer must agree with before trusting a prediction: the feature
names and order, the label (ITL target, TPOT cap, horizon, KV room), hardware / model / TP and the
node's KV capacity, the conformal shift, the SHA-256 of the training profiles and of ``model.txt``,
library versions, metrics, and the command that produced it.

Format history: 1 -- the instantaneous label (one iteration); 2 -- the lease label over a horizon
(``interference_model.labels``), with ``label`` and ``kv_capacity_tokens``; 3 -- the drain features
(``interference_model.columns.DRAIN_FEATURES``) among the inputs; 4 -- ``decode_step_model`` (a
``fit.DecodeStepModel`` or null) and, with one, its slack among ``model_features``. Versions 3 and 4
are read (a version-3 artifact has no decode-step model); older artifacts predict another quantity
or from other inputs and are refused: refit them.
:func:`load_predictor` checks all of that and fails with :class:`ArtifactError` naming the file.

Writes are crash-safe per file (temp file + rename), and ``metadata.json`` is written last and
carries the model's hash, so a half-written artifact fails to load instead of loading wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd

from interference_model.fit import ConformalShift, DecodeStepModel, FitResult, LeaseCap, ModelInputs
from interference_model.labels import DEFAULT_HORIZON_S, ItlTarget, LeaseLabel
from interference_model.predictor import SafeThroughputPredictor
from interference_model.schema import FEATURES, PROFILE_SCHEMA_VERSION

ARTIFACT_FORMAT_VERSION = 4
READABLE_FORMAT_VERSIONS = (3, 4)
MODEL_FILE = "model.txt"
METADATA_FILE = "metadata.json"
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_ITL_TARGET = "40ms"
"""ITL target of the shipped artifacts: a mixed step may take 40 ms, the ITL budget the heuristic sizes
its borrowed chunks to (``policies.slo.itl_budget_s``: 0.8 x the default 50 ms TPOT SLO; a test
keeps the two equal). The earlier ``"1.5x|25ms"`` (1.5x the decode-only step, or 25 ms when looser)
promised less than the heuristic enforces, so an accurate model of it lent too little: measured in
docs/interference_model.md ("What the label's ITL target costs in use")."""


class ArtifactError(ValueError):
    """A missing, corrupt or mismatched interference-model artifact."""


def artifact_slug(gpu: str, model: str, tp: int) -> str:
    """Folder name of a shipped default artifact, e.g. ``h200_gpt-oss-120b_tp1``."""
    return f"{gpu}_{model}_tp{tp}".lower().replace("/", "-").replace(" ", "-")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; artifacts are shipped and shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def library_versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "lightgbm": lgb.__version__,
        "numpy": np.__version__,
        "pandas": pd.__version__,
    }


def save_artifact(
    path: str | os.PathLike[str],
    fit: FitResult,
    *,
    hardware: str,
    model: str,
    tp: int,
    data_sha256: str,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``fit`` as an artifact folder at ``path`` (created if needed) and return it.

    ``extra`` is merged into the metadata (e.g. ``command``, ``cached_prefix_tokens``,
    ``heldout_metrics``); it may not override the keys this function sets.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    label = fit.cap.label
    model_text = fit.booster.model_to_string()
    meta: dict[str, Any] = {
        "format_version": ARTIFACT_FORMAT_VERSION,
        "profile_schema_version": PROFILE_SCHEMA_VERSION,
        "features": list(FEATURES),
        "model_features": list(fit.inputs.names),
        "decode_step_model": None if fit.inputs.decode_step is None else fit.inputs.decode_step.to_dict(),
        "target_transform": "log1p",
        "label": label.to_dict(),
        "itl_target": label.to_dict()["itl_target"],
        "horizon_s": label.horizon_s,
        "kv_capacity_tokens": fit.cap.kv_capacity_tokens,
        "min_rate_tokens_per_s": fit.cap.min_rate_tokens_per_s,
        "hardware": hardware,
        "model": model,
        "tp": int(tp),
        "shift_batch_edges": list(fit.shift.batch_edges),
        "log_shifts": list(fit.shift.log_shifts),
        "monotone_constraints": list(fit.monotone_constraints),
        "fit_config": {k: getattr(fit.config, k) for k in fit.config.__dataclass_fields__},
        "cv_metrics": fit.cv_metrics,
        "feature_importance_gain": fit.feature_importance(),
        "n_trees": fit.booster.num_trees(),
        "data_sha256": data_sha256,
        "model_sha256": hashlib.sha256(model_text.encode()).hexdigest(),
        "library_versions": library_versions(),
    }
    for key, value in (extra or {}).items():
        if key in meta:
            raise ValueError(f"save_artifact: extra key {key!r} would override a recorded field")
        meta[key] = value
    _write_atomic(out / MODEL_FILE, model_text)
    _write_atomic(out / METADATA_FILE, json.dumps(meta, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return out


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``metadata.json`` of an artifact folder, with required keys checked."""
    meta_path = Path(path) / METADATA_FILE
    if not meta_path.is_file():
        raise ArtifactError(f"{meta_path}: missing (not an interference-model artifact folder?)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{meta_path}: corrupt JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise ArtifactError(f"{meta_path}: expected a JSON object")
    if meta.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise ArtifactError(
            f"{meta_path}: field 'format_version' is {meta.get('format_version')!r}; this code "
            f"reads versions {list(READABLE_FORMAT_VERSIONS)} (the lease label with drain features); "
            "refit with `crossflow fit-interference`"
        )
    required = (
        "format_version",
        "features",
        "model_features",
        "label",
        "itl_target",
        "horizon_s",
        "kv_capacity_tokens",
        "hardware",
        "model",
        "tp",
        "shift_batch_edges",
        "log_shifts",
        "model_sha256",
    )
    missing = [k for k in required if k not in meta]
    if missing:
        raise ArtifactError(f"{meta_path}: missing field(s) {missing}")
    try:
        LeaseLabel.from_dict(meta["label"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{meta_path}: field 'label' is malformed ({exc})") from exc
    step = meta.get("decode_step_model")
    if step is not None:
        try:
            DecodeStepModel.from_dict(step)
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{meta_path}: field 'decode_step_model' is malformed ({exc})") from exc
    return meta


def artifact_label(meta: dict[str, Any]) -> LeaseLabel:
    """The :class:`LeaseLabel` an artifact was fitted on (``meta`` from :func:`read_metadata`)."""
    return LeaseLabel.from_dict(meta["label"])


def artifact_inputs(meta: dict[str, Any]) -> ModelInputs:
    """What an artifact's trees see (``meta`` from :func:`read_metadata`)."""
    step = meta.get("decode_step_model")
    return ModelInputs(artifact_label(meta), None if step is None else DecodeStepModel.from_dict(step))


def _check(meta_path: Path, field: str, have: Any, want: Any) -> None:
    if want is not None and have != want:
        raise ArtifactError(f"{meta_path}: field {field!r} is {have!r}, but the caller expects {want!r}")


def load_predictor(
    path: str | os.PathLike[str],
    *,
    gpu: str | None = None,
    model: str | None = None,
    tp: int | None = None,
    itl_target: ItlTarget | str | None = None,
    horizon_s: float | None = None,
) -> SafeThroughputPredictor:
    """Load an artifact folder as a :class:`SafeThroughputPredictor`.

    Every expectation given (``gpu``, ``model``, ``tp``, ``itl_target`` as an :class:`ItlTarget` or a
    spec like ``"1.5x"``, ``horizon_s``: the lease TTL the caller multiplies the rate by) must match
    the metadata (names case-insensitively); the feature list must equal this code's ``FEATURES`` and
    the model file its recorded SHA-256. Raises :class:`ArtifactError`.
    """
    folder = Path(path)
    meta = read_metadata(folder)
    meta_path = folder / METADATA_FILE
    _check(meta_path, "features", meta["features"], list(FEATURES))
    inputs = artifact_inputs(meta)
    _check(meta_path, "model_features", meta["model_features"], list(inputs.names))
    _check(meta_path, "hardware", str(meta["hardware"]).lower(), gpu.lower() if gpu else None)
    _check(meta_path, "model", str(meta["model"]).lower(), model.lower() if model else None)
    _check(meta_path, "tp", meta["tp"], tp)
    if itl_target is not None:
        want = ItlTarget.parse(itl_target) if isinstance(itl_target, str) else itl_target
        have = meta["itl_target"]
        _check(
            meta_path,
            "itl_target",
            (have.get("kind"), float(have.get("value", "nan")), float(have.get("floor_ms", 0.0))),
            (want.kind, want.value, want.floor_ms),
        )
    if horizon_s is not None:
        _check(meta_path, "horizon_s", float(meta["horizon_s"]), float(horizon_s))
    model_path = folder / MODEL_FILE
    if not model_path.is_file():
        raise ArtifactError(f"{model_path}: missing")
    model_bytes = model_path.read_bytes()
    digest = hashlib.sha256(model_bytes).hexdigest()
    if digest != meta["model_sha256"]:
        raise ArtifactError(
            f"{model_path}: corrupt or replaced (SHA-256 {digest[:12]}... differs from the "
            f"metadata's {str(meta['model_sha256'])[:12]}...)"
        )
    try:
        booster = lgb.Booster(model_str=model_bytes.decode("utf-8"))
        shift = ConformalShift(
            tuple(float(e) for e in meta["shift_batch_edges"]), tuple(float(v) for v in meta["log_shifts"])
        )
        cap = LeaseCap(
            inputs.label, float(meta["kv_capacity_tokens"]), float(meta["min_rate_tokens_per_s"])
        )
        return SafeThroughputPredictor(booster, shift, cap, meta, inputs)
    except (lgb.basic.LightGBMError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{model_path}: cannot be compiled into a predictor ({exc})") from exc


def load_booster(path: str | os.PathLike[str]) -> lgb.Booster:
    """The raw LightGBM booster of an artifact (for analysis; the hot path uses :func:`load_predictor`)."""
    return lgb.Booster(model_file=str(Path(path) / MODEL_FILE))


def default_predictor(gpu: str = "H200", model: str = "gpt-oss-120b", tp: int = 1) -> SafeThroughputPredictor:
    """The shipped artifact for ``gpu`` x ``model`` x ``tp`` (``interference_model/data/``): the lease
    label over ``DEFAULT_HORIZON_S`` seconds."""
    folder = DATA_DIR / artifact_slug(gpu, model, tp)
    if not folder.is_dir():
        have = sorted(p.name for p in DATA_DIR.iterdir() if p.is_dir()) if DATA_DIR.is_dir() else []
        raise ArtifactError(
            f"no shipped interference model for {gpu}/{model}/tp{tp} (have {have}); "
            "fit one with `crossflow fit-interference --out DIR` and pass it with `--interference-model DIR`"
        )
    return load_predictor(folder, gpu=gpu, model=model, tp=tp, horizon_s=DEFAULT_HORIZON_S)


def log_artifact_to_wandb(
    path: str | os.PathLike[str],
    *,
    project: str = "crossflow",
    name: str | None = None,
    wandb_dir: str | os.PathLike[str] | None = None,
    summary: dict[str, Any] | None = None,
) -> bool:
    """Log an artifact folder to W&B (offline unless ``WANDB_MODE`` says otherwise); never needs a login.
    ``summary``: figures for the run's summary (e.g. the fit's cross-validated metrics).

    ``wandb_dir`` is where the run's files go (default: ``WANDB_DIR`` or the current folder); it is
    passed to ``wandb.init`` because W&B otherwise keeps the first directory a process used.
    Returns False (with a message on stderr) when wandb is not importable or logging fails.
    """
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb
    except ImportError:
        print("wandb is not installed; skipping artifact logging", file=sys.stderr)
        return False
    folder = Path(path)
    meta = read_metadata(folder)
    art_name = name or f"interference-{artifact_slug(meta['hardware'], meta['model'], meta['tp'])}"
    try:
        run = wandb.init(
            project=project,
            job_type="fit-interference",
            config={"artifact": meta},
            dir=str(wandb_dir or os.environ.get("WANDB_DIR") or Path.cwd()),
            reinit=True,
        )
        artifact = wandb.Artifact(art_name, type="interference-model", metadata=meta)
        artifact.add_dir(str(folder))
        run.log_artifact(artifact)
        if summary:
            run.summary.update(summary)
        run.finish()
    except Exception as exc:  # W&B has many failure modes (disk, network in online mode); none is fatal here
        print(f"wandb logging failed, artifact kept locally only: {exc}", file=sys.stderr)
        return False
    return True

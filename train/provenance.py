"""Provenance of a result: the code version that made it and a key over its full configuration.

``code_version()`` is the package version, ``git describe`` of the checkout when there is one, and the
SHA-256 of every source and data file of the five packages (``*.py``, ``*.json``, ``*.txt``, ``*.npz``,
``*.csv.gz`` under ``interference_model/ policies/ envs/ serving/ train/``), so an edit that is not
committed yet still changes it. ``config_key(payload)`` hashes a JSON-able description of one job with
the source hash: two jobs share a key only when they are the same simulation on the same code, which is
what lets ``crossflow compare`` skip finished work when it is rerun into the same folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("interference_model", "policies", "envs", "serving", "train")
SUFFIXES = (".py", ".json", ".txt", ".npz", ".gz", ".csv")


@functools.lru_cache(maxsize=1)
def source_sha256() -> str:
    """SHA-256 over the relative path and bytes of every source/data file of the packages (sorted)."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                h.update(path.relative_to(ROOT).as_posix().encode())
                h.update(b"\0")
                h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """``{"package": "0.1.0", "git": "v0.1-12-gabc123-dirty" | None, "source_sha256": ...}``."""
    try:
        version = metadata.version("crossflow")
    except metadata.PackageNotFoundError:
        version = None
    try:
        git = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        git = None
    return {"package": version, "git": git or None, "source_sha256": source_sha256()}


def config_key(payload: Any) -> str:
    """A 24-hex-digit key over ``payload`` (JSON-able; key order does not matter) and the source hash."""
    text = json.dumps({"config": payload, "source": source_sha256()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


__all__ = ["code_version", "config_key", "source_sha256"]

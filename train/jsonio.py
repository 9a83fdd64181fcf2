"""One way to write figures as JSON: atomically (temp file in the same folder, then rename), so a
reader never sees half a file; strict JSON (a value that is not a finite number — NaN, infinity — is
written as ``null``, never as the ``NaN`` literal other parsers reject); numpy scalars and arrays as
plain numbers; readable by the file's group and others as an ordinary file would be."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def strict(payload: Any) -> Any:
    """``payload`` with every non-finite float (numpy's too) replaced by ``None`` and numpy values made
    plain, ready for ``json.dumps(..., allow_nan=False)``."""
    if isinstance(payload, float | np.floating):
        value = float(payload)
        return value if math.isfinite(value) else None
    if isinstance(payload, dict):
        return {k: strict(v) for k, v in payload.items()}
    if isinstance(payload, list | tuple):
        return [strict(v) for v in payload]
    if isinstance(payload, np.ndarray):
        return strict(payload.tolist())
    if isinstance(payload, np.generic):
        return strict(payload.item())
    return payload


def dumps(payload: Any, *, indent: int | None = 2) -> str:
    """Strict JSON text of ``payload`` (see ``strict``)."""
    return json.dumps(strict(payload), indent=indent, default=_default, allow_nan=False)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike[str] | None, payload: Any, *, indent: int | None = 2) -> None:
    """Write ``payload`` to ``path`` atomically as strict JSON; a no-op when ``path`` is empty or None."""
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(payload, indent=indent) + "\n"  # fail before anything is written
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

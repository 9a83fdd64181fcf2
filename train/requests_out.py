"""Per-request export (``--requests-out PATH.parquet`` of ``simulate`` and ``compare``).

One row per request of a simulation: its path (``normal``, ``borrowed``, ``fallback``, ``local``), the
prefill and decode worker it ran on, TTFT, mean inter-token latency (TPOT) and end-to-end latency, and
the scheduler's last decision on it (``decision_code``, ``decision_reason``, ``lease_id``: the lease
reservation a borrowed prefill spent, else null). Latencies are in seconds; an unfinished request has
null TTFT/ITL. The ITL of one request is its mean ``(finish - first token) / (output tokens - 1)``; the
simulator keeps the full ITL distribution per decode worker (``RunMetrics.itl_p99_s``), not per request.

Decision columns come from the scheduler's records, which keep the newest 10,000 (``ClusterScheduler``
``max_records``): on longer runs the earliest requests have null decision columns (counted in
``meta["requests_without_decision"]``). Static (no scheduler) has no decisions at all.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

COLUMNS = (
    "request_id", "session_id", "input_tokens", "output_tokens", "cached_tokens", "arrival_s",
    "path", "prefill_worker", "decode_worker", "ttft_s", "itl_mean_s", "e2e_s", "retractions", "error",
    "decision_code", "decision_reason", "lease_id",
)  # fmt: skip


def requests_table(result: Any) -> pd.DataFrame:
    """The per-request table of ``result`` (an ``envs.metrics.SimResult``), columns ``COLUMNS``."""
    df = result.requests
    out = df[
        ["request_id", "session_id", "input_tokens", "output_tokens", "cached_tokens", "arrival_s"]
    ].copy()
    out["path"] = df["path"].astype(str)
    out["prefill_worker"] = df["prefill_worker"]
    out["decode_worker"] = df["decode_worker"]
    out["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    n_out = df["output_tokens"].to_numpy(dtype=np.float64)
    decode_s = (df["finish_s"] - df["first_token_s"]).to_numpy(dtype=np.float64)
    out["itl_mean_s"] = np.where(
        n_out > 1, decode_s / np.maximum(n_out - 1, 1), np.where(n_out > 0, 0.0, np.nan)
    )
    out.loc[df["finish_s"].isna().to_numpy(), "itl_mean_s"] = np.nan
    out["e2e_s"] = df["finish_s"] - df["arrival_s"]
    out["retractions"] = df["retractions"]
    out["error"] = df["error"].astype(str)
    last: dict[int, Mapping[str, Any]] = {}
    for rec in result.decisions:
        if rec.get("kind") in ("decision", "reconsider") and rec.get("request_id") is not None:
            last[int(rec["request_id"])] = rec
    ids = out["request_id"].to_numpy()
    out["decision_code"] = pd.array([_get(last, i, "code") for i in ids], dtype="string")
    out["decision_reason"] = pd.array([_get(last, i, "reason") for i in ids], dtype="string")
    out["lease_id"] = pd.array([_get(last, i, "reservation_id") for i in ids], dtype="Int64")
    return out[list(COLUMNS)].reset_index(drop=True)


def _get(last: Mapping[int, Mapping[str, Any]], rid: Any, key: str) -> Any:
    rec = last.get(int(rid))
    if rec is None:
        return None
    value = rec.get(key)
    return None if value is None else value


def check_requests_out(path: str | os.PathLike[str]) -> None:
    """Refuse a ``--requests-out`` that is an existing folder (called before any simulation runs)."""
    if Path(path).is_dir():
        raise ValueError(f"--requests-out: {path} is a folder; give a file path such as requests.parquet")


def write_parquet(frames: Iterable[pd.DataFrame], path: str | os.PathLike[str]) -> int:
    """Concatenate ``frames`` and write them to ``path`` atomically (temp file, then rename); returns
    the row count. Refuses a path that is an existing folder (naming it)."""
    check_requests_out(path)
    out = Path(path)
    parts = [f for f in frames if len(f)]
    table = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(COLUMNS))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        table.to_parquet(tmp, index=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(table)


__all__ = ["COLUMNS", "check_requests_out", "requests_table", "write_parquet"]

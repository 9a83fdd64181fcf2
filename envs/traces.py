"""The compact bundle format, the bundled-trace registry, and ``load_trace`` for any supported file.

The loaders of the original public formats live in :mod:`envs.trace_formats` and are re-exported
here. Malformed input raises :class:`TraceFormatError` naming the file, the 1-based line and the field.

Regenerate the bundled files from the original public data (not shipped; see ``envs/data/traces``)::

    python -m envs.traces build --source DIR --out envs/data/traces
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import io
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from envs.request import Request, Trace
from envs.trace_formats import (
    TraceFormatError,
    _fail,
    _open_text,
    load_azure,
    load_mooncake,
    load_weka,
)

__all__ = [
    "BUNDLED_TRACES",
    "TraceFormatError",
    "build_bundles",
    "build_servegen_curves",
    "bundled_path",
    "load_azure",
    "load_bundle",
    "load_mooncake",
    "load_trace",
    "load_weka",
    "save_bundle",
    "trace_stats",
]

BUNDLE_MAGIC = "# crossflow-trace v1"

BUNDLED_TRACES: dict[str, str] = {
    "agent": "weka_claude_code.csv.gz",
    "mooncake": "mooncake_conversation.csv.gz",
    "mooncake-synthetic": "mooncake_synthetic.csv.gz",
    "azure-code": "azure_code_2023.csv.gz",
}
"""Bundled trace name -> file name inside the package data folder ``envs/data/traces``."""

SERVEGEN_CURVES_FILE = "servegen_rate_curves.csv"

_REQUEST_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Request))


def save_bundle(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as a bundle (gzip CSV), atomically and byte-reproducibly (gzip mtime 0)."""
    path = Path(path)
    header = (
        f"{BUNDLE_MAGIC} name={quote(trace.name)} closed_loop={int(trace.closed_loop)} "
        f"block_size={trace.block_size_tokens} source={quote(trace.source)}\n"
    )
    text = io.StringIO()
    text.write(header)
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(_REQUEST_COLUMNS)
    for r in trace.requests:
        # repr() round-trips floats exactly; integral floats are written as ints to stay compact
        writer.writerow(
            [v if not isinstance(v, float) else (int(v) if v.is_integer() else repr(v)) for v in _astuple(r)]
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(text.getvalue().encode("utf-8"))
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; bundles are shared data files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _astuple(r: Request) -> tuple[Any, ...]:
    return tuple(getattr(r, name) for name in _REQUEST_COLUMNS)


def _parse_bundle_header(line: str, path: str | Path) -> dict[str, str]:
    if not line.startswith(BUNDLE_MAGIC):
        raise _fail(path, 1, "<header>", f"expected a line starting with {BUNDLE_MAGIC!r}")
    meta: dict[str, str] = {}
    for item in line[len(BUNDLE_MAGIC) :].split():
        key, sep, value = item.partition("=")
        if not sep:
            raise _fail(path, 1, "<header>", f"expected key=value, got {item!r}")
        meta[key] = unquote(value)
    for key in ("name", "closed_loop", "block_size"):
        if key not in meta:
            raise _fail(path, 1, key, "missing from the header line")
    return meta


def load_bundle(path: str | Path) -> Trace:
    """Read and validate a bundle written by :func:`save_bundle`."""
    with _open_text(path) as f:
        meta = _parse_bundle_header(f.readline(), path)
        reader = csv.reader(f)
        columns = next(reader, None)
        if columns is None or tuple(columns) != _REQUEST_COLUMNS:
            raise _fail(path, 2, "<columns>", f"expected {','.join(_REQUEST_COLUMNS)}, got {columns!r}")
        requests: list[Request] = []
        for line, row in enumerate(reader, start=3):
            requests.append(_bundle_row(row, len(requests), requests, path, line))
    try:
        block_size = int(meta["block_size"])
        closed_loop = {"0": False, "1": True}[meta["closed_loop"]]
    except (ValueError, KeyError):
        raise _fail(path, 1, "<header>", "bad closed_loop or block_size value") from None
    return Trace(meta["name"], requests, closed_loop, meta.get("source", ""), block_size)


def _bundle_row(
    row: list[str], expected_id: int, earlier: list[Request], path: str | Path, line: int
) -> Request:
    """Parse and validate one bundle row against the requests before it."""
    if len(row) != len(_REQUEST_COLUMNS):
        raise _fail(path, line, "<row>", f"expected {len(_REQUEST_COLUMNS)} columns, got {len(row)}")
    values: dict[str, Any] = {}
    for name, cell in zip(_REQUEST_COLUMNS, row, strict=True):
        try:
            values[name] = float(cell) if name in ("arrival_s", "think_time_s") else int(cell)
        except ValueError:
            raise _fail(path, line, name, f"expected a number, got {cell!r}") from None
    r = Request(**values)
    rid = r.request_id

    def check(ok: bool, name: str, problem: str) -> None:
        if not ok:
            raise _fail(path, line, name, problem)

    check(rid == expected_id, "request_id", f"expected {expected_id} (ids are dense and in order), got {rid}")
    for name in ("input_tokens", "output_tokens", "shared_prefix_tokens", "turn"):
        check(values[name] >= 0, name, f"expected non-negative, got {values[name]}")
    check(math.isfinite(r.arrival_s) and r.arrival_s >= 0, "arrival_s", f"expected >= 0, got {r.arrival_s}")
    check(
        math.isfinite(r.think_time_s) and r.think_time_s >= 0,
        "think_time_s",
        f"expected >= 0, got {r.think_time_s}",
    )
    check(r.session_id >= -1, "session_id", f"expected >= -1, got {r.session_id}")
    check(-1 <= r.parent_id < rid, "parent_id", f"expected -1 or an earlier id, got {r.parent_id}")
    check(-1 <= r.depends_on < rid, "depends_on", f"expected -1 or an earlier id, got {r.depends_on}")
    if r.parent_id < 0:
        check(r.shared_prefix_tokens == 0, "shared_prefix_tokens", "expected 0 without a parent")
    else:
        limit = min(r.input_tokens, earlier[r.parent_id].input_tokens)
        check(
            r.shared_prefix_tokens <= limit,
            "shared_prefix_tokens",
            f"expected <= {limit} (both inputs), got {r.shared_prefix_tokens}",
        )
    return r


# ---------------------------------------------------------------------------------------------------
# Registry, format detection, building the bundled files.


def bundled_path(name: str) -> Path:
    """Path of a bundled trace file (``KeyError`` lists the known names)."""
    if name not in BUNDLED_TRACES:
        raise KeyError(f"unknown bundled trace {name!r}; known: {', '.join(BUNDLED_TRACES)}")
    return Path(str(resources.files("envs").joinpath("data", "traces", BUNDLED_TRACES[name])))


def drop_empty_requests(trace: Trace) -> Trace:
    """``trace`` without its requests of zero input or zero output tokens (nothing for a cluster to
    serve), their count in ``meta["dropped_empty_requests"]``. References stay meaningful: a request
    that depended on a dropped one depends on that one's dependency (the dropped think time added to
    its own), and a prefix parent that was dropped is replaced by its nearest kept ancestor, sharing at
    most what every link of the chain shared."""
    from envs.arrivals import subset  # envs.arrivals reads this module's curve file name

    reqs = trace.requests
    dropped = {r.request_id for r in reqs if r.input_tokens <= 0 or r.output_tokens <= 0}
    if not dropped:
        return trace
    fixed: list[Request] = []
    for r in reqs:
        if r.request_id in dropped:
            fixed.append(r)
            continue
        dep, think = r.depends_on, r.think_time_s
        while dep in dropped:
            think += reqs[dep].think_time_s
            dep = reqs[dep].depends_on
        parent, shared = r.parent_id, r.shared_prefix_tokens
        while parent in dropped:
            shared = min(shared, reqs[parent].shared_prefix_tokens)
            parent = reqs[parent].parent_id
        if parent < 0:
            shared = 0
        if (dep, parent) != (r.depends_on, r.parent_id):
            r = dataclasses.replace(
                r, depends_on=dep, think_time_s=think, parent_id=parent, shared_prefix_tokens=shared
            )
        fixed.append(r)
    kept = [r.request_id for r in reqs if r.request_id not in dropped]
    out = subset(dataclasses.replace(trace, requests=fixed), kept, trace.name)
    out.meta["dropped_empty_requests"] = len(dropped)
    return out


def load_trace(name_or_path: str | Path) -> Trace:
    """Load a bundled trace by name, a bundle file, or an original Mooncake / Azure / WEKA file.

    Files are recognised by content: a bundle header line, an Azure CSV header, or the keys of the
    first JSON line (``requests`` -> WEKA sessions, ``hash_ids`` + ``timestamp`` -> Mooncake).
    Requests with zero input or output tokens are dropped (``drop_empty_requests``); a file with no
    request left is an error naming it.
    """
    if isinstance(name_or_path, str) and name_or_path in BUNDLED_TRACES:
        return _load_bundled(name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        raise FileNotFoundError(f"{path}: a directory, not a trace file")
    trace = _load_file(path)
    if not trace.requests:
        raise TraceFormatError(f"{path.name}: empty trace (no requests)")
    kept = drop_empty_requests(trace)
    if not kept.requests:
        raise TraceFormatError(
            f"{path.name}: no request has both input and output tokens ({len(trace)} requests, all empty)"
        )
    return kept


_BUNDLED_LOADED: dict[str, tuple[tuple[int, int], Trace]] = {}
"""Bundled trace name -> (its file's (mtime, size) when read, the trace as ``load_trace`` returns it):
a process that asks for the same bundled trace twice (``crossflow simulate`` checks its flags against
it before running) reads the file once."""


def _load_bundled(name: str) -> Trace:
    """``load_trace(name)`` of a bundled trace: read once per process while its file is unchanged;
    each call gets its own ``Trace`` (its own request list and ``meta``; requests are immutable)."""
    path = bundled_path(name)
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _BUNDLED_LOADED.get(name)
    if cached is None or cached[0] != stamp:
        trace = drop_empty_requests(load_bundle(path))
        trace.name = name
        cached = _BUNDLED_LOADED[name] = (stamp, trace)
    trace = cached[1]
    return dataclasses.replace(trace, requests=list(trace.requests), meta=dict(trace.meta))


def _load_file(path: Path) -> Trace:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a bundled trace name ({', '.join(BUNDLED_TRACES)}) nor a file")
    with _open_text(path) as f:
        first_no, first = next(((n, line) for n, line in enumerate(f, start=1) if line.strip()), (1, ""))
    if not first.strip():
        raise TraceFormatError(f"{path.name}: empty trace (no lines)")
    if first.startswith(BUNDLE_MAGIC):
        return load_bundle(path)
    if first.strip().startswith("TIMESTAMP"):
        return load_azure(path)
    try:
        obj = json.loads(first)
    except json.JSONDecodeError as exc:
        if ".jsonl" in path.name:
            raise _fail(path, first_no, "<json>", f"invalid JSON ({exc.msg})") from None
        obj = None
    if isinstance(obj, dict) and "requests" in obj:
        return load_weka(path)
    if isinstance(obj, dict) and "hash_ids" in obj and "timestamp" in obj:
        return load_mooncake(path)
    raise _fail(
        path, 1, "<format>", "not a crossflow bundle, Azure CSV, Mooncake JSONL or WEKA sessions file"
    )


_SOURCES: dict[str, tuple[str, Any]] = {
    "agent": ("weka_claude_code/weka_cc_traces.jsonl.gz", load_weka),
    "mooncake": ("mooncake/conversation_trace.jsonl", load_mooncake),
    "mooncake-synthetic": ("mooncake/synthetic_trace.jsonl", load_mooncake),
    "azure-code": ("azure_llm_2023/AzureLLMInferenceTrace_code.csv", load_azure),
}


def build_servegen_curves(aggregates_path: str | Path, out_path: str | Path) -> None:
    """Write the compact per-model rate curve from ServeGen's 10-minute window aggregates.

    Output columns: ``category,model,window_start_s,requests_per_s,input_output_ratio,
    mean_input_tokens,mean_output_tokens``. Windows missing from the aggregates are written with all
    value columns empty, so each model's curve is on a gap-free 600 s grid; the gaps are upstream data
    gaps (the rate on both sides is typically far from 0), so they must not be read as zero traffic.
    """
    by_model: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
    with _open_text(aggregates_path) as f:
        for row in csv.DictReader(f):
            by_model.setdefault((row["category"], row["model"]), {})[int(row["window_start_s"])] = row
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        [
            "category",
            "model",
            "window_start_s",
            "requests_per_s",
            "input_output_ratio",
            "mean_input_tokens",
            "mean_output_tokens",
        ]
    )
    window_s = 600
    for (category, model), windows in by_model.items():
        for start_s in range(0, max(windows) + window_s, window_s):
            agg = windows.get(start_s)
            if agg is None:
                writer.writerow([category, model, start_s, "", "", "", ""])
                continue
            with_dist = float(agg["requests_with_dist"])
            inp, out_tok = float(agg["input_tokens"]), float(agg["output_tokens"])
            writer.writerow(
                [
                    category,
                    model,
                    start_s,
                    f"{float(agg['requests_all']) / window_s:.5g}",
                    f"{inp / out_tok:.4g}" if out_tok > 0 else "",
                    f"{inp / with_dist:.0f}" if with_dist > 0 else "",
                    f"{out_tok / with_dist:.0f}" if with_dist > 0 else "",
                ]
            )
    _write_text_atomic(Path(out_path), out.getvalue())


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; bundles are shared data files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_bundles(source_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Derive every bundled file from the original public traces under ``source_dir``.

    ``source_dir`` has the upstream layout (``mooncake/``, ``azure_llm_2023/``, ``weka_claude_code/``,
    ``servegen/``). Returns the written paths. Output is byte-reproducible.
    """
    source, out = Path(source_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, (relative, loader) in _SOURCES.items():
        trace = loader(source / relative)
        trace.name = name
        target = out / BUNDLED_TRACES[name]
        save_bundle(trace, target)
        written.append(target)
    curves = out / SERVEGEN_CURVES_FILE
    build_servegen_curves(source / "servegen" / "servegen_window_aggregates.csv.gz", curves)
    written.append(curves)
    return written


def trace_stats(trace: Trace) -> dict[str, float]:
    """Summary figures: requests, sessions, mean input/output tokens, prefix-hit share, span.

    ``prefix_hit_share`` is the share of input tokens covered by ``shared_prefix_tokens``, i.e. the hit
    rate of an unbounded prefix cache that keeps every earlier request.
    """
    n = len(trace.requests)
    input_tokens = sum(r.input_tokens for r in trace.requests)
    arrivals = [r.arrival_s for r in trace.requests]
    return {
        "requests": n,
        "sessions": len([s for s in trace.session_ids if s >= 0]),
        "mean_input_tokens": input_tokens / n if n else 0.0,
        "mean_output_tokens": sum(r.output_tokens for r in trace.requests) / n if n else 0.0,
        "prefix_hit_share": sum(r.shared_prefix_tokens for r in trace.requests) / input_tokens
        if input_tokens
        else 0.0,
        "span_s": max(arrivals) - min(arrivals) if n else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m envs.traces build --source DIR --out DIR`` regenerates the bundled files;
    ``python -m envs.traces stats NAME_OR_PATH...`` prints :func:`trace_stats` per trace."""
    parser = argparse.ArgumentParser(prog="python -m envs.traces", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="derive the bundled traces from the original public files")
    build.add_argument("--source", required=True, help="folder with the original public traces")
    build.add_argument("--out", required=True, help="output folder, normally envs/data/traces")
    stats = sub.add_parser("stats", help="print summary figures of traces")
    stats.add_argument("traces", nargs="+", help=f"bundled names ({', '.join(BUNDLED_TRACES)}) or files")
    args = parser.parse_args(argv)
    if args.command == "build":
        for path in build_bundles(args.source, args.out):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
        return 0
    print("trace                requests  sessions  mean_in  mean_out  prefix_hit   span_s")
    for name in args.traces:
        st = trace_stats(load_trace(name))
        print(
            f"{name:<20} {st['requests']:>9.0f} {st['sessions']:>9.0f} {st['mean_input_tokens']:>8.0f} "
            f"{st['mean_output_tokens']:>9.0f} {st['prefix_hit_share']:>10.1%} {st['span_s']:>8.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

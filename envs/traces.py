"""Trace loaders for the public formats, the compact bundle format, and the bundled-trace registry.

Every loader returns a :class:`~envs.request.Trace` whose requests are in ``request_id`` order
(0, 1, 2, ...). Prefix identity is derived from the original block hashes: a request's ``parent_id`` is
the most recent earlier request sharing the longest leading run of block hashes with it, and
``shared_prefix_tokens`` is that run times the block size, capped at both input lengths. All public
traces we load use *chained* block ids (a block id implies its whole prefix), which makes the search a
dictionary lookup plus a binary search per request.

Malformed input raises :class:`TraceFormatError` naming the file, the 1-based line and the field.

Regenerate the bundled files from the original public data (not shipped; see ``envs/data/traces``)::

    python -m envs.traces build --source DIR --out envs/data/traces
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import itertools
import json
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import fields
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, unquote

from envs.request import Request, Trace

MOONCAKE_BLOCK_TOKENS = 512
WEKA_BLOCK_TOKENS = 64
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


class TraceFormatError(ValueError):
    """A trace file is malformed; the message reads ``file:line: field 'name': problem``."""


def _fail(path: str | Path, line: int, field_name: str, problem: str) -> TraceFormatError:
    return TraceFormatError(f"{Path(path).name}:{line}: field {field_name!r}: {problem}")


def _int_field(obj: dict[str, Any], key: str, path: str | Path, line: int, default: int | None = None) -> int:
    """A non-negative int from a JSON object (bools and fractional floats are rejected)."""
    if key not in obj:
        if default is not None:
            return default
        raise _fail(path, line, key, "missing")
    value = obj[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(path, line, key, f"expected non-negative int, got {value!r}")
    return value


def _float_field(
    obj: dict[str, Any], key: str, path: str | Path, line: int, default: float | None = None
) -> float:
    """A finite float from a JSON object (ints allowed, bools rejected)."""
    if key not in obj:
        if default is not None:
            return default
        raise _fail(path, line, key, "missing")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(path, line, key, f"expected a finite number, got {value!r}")
    return float(value)


def _hash_ids_field(obj: dict[str, Any], key: str, path: str | Path, line: int) -> list[int]:
    value = obj.get(key)
    if not isinstance(value, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        raise _fail(path, line, key, f"expected a list of ints, got {str(value)[:40]!r}")
    return value


def _open_text(path: str | Path) -> IO[str]:
    """Open a text file, transparently gunzipping ``*.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line of a JSONL(.gz) file."""
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fail(path, line_no, "<json>", f"invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise _fail(path, line_no, "<json>", "expected a JSON object")
            yield line_no, obj


class _PrefixIndex:
    """Longest-leading-run matcher over chained block ids.

    Because ids are chained, the set of a request's blocks already seen is prefix-closed, so the
    longest matched run is found by binary search, and the most recent request holding the last
    matched block shares the whole run.
    """

    def __init__(self) -> None:
        self._last_holder: dict[int, int] = {}

    def match(self, block_ids: Sequence[int]) -> tuple[int, int]:
        """Return ``(parent_request_id, matched_blocks)``; ``(-1, 0)`` when nothing matches."""
        seen = self._last_holder
        lo, hi = 0, len(block_ids)  # invariant: block_ids[:lo] all seen, block_ids[hi:] not known seen
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_ids[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        return (seen[block_ids[lo - 1]], lo) if lo else (-1, 0)

    def add(self, block_ids: Sequence[int], request_id: int) -> None:
        self._last_holder.update(zip(block_ids, itertools.repeat(request_id)))


def _prefix_fields(
    index: _PrefixIndex, block_ids: Sequence[int], input_tokens: int, inputs: Sequence[int], block_tokens: int
) -> tuple[int, int]:
    """``(parent_id, shared_prefix_tokens)`` for the next request, given earlier requests' inputs."""
    parent, blocks = index.match(block_ids)
    if parent < 0:
        return -1, 0
    shared = min(blocks * block_tokens, input_tokens, inputs[parent])
    return (parent, shared) if shared > 0 else (-1, 0)


def load_mooncake(path: str | Path) -> Trace:
    """Load a Mooncake FAST'25 JSONL trace (``timestamp`` ms, 512-token ``hash_ids``, global ids).

    Open-loop; requests are ordered by timestamp (stable, so file order breaks ties); no sessions
    (``session_id=-1``, ``turn=0``).
    """
    rows: list[tuple[float, int, int, list[int]]] = []
    for line_no, obj in _json_lines(path):
        ts_ms = _float_field(obj, "timestamp", path, line_no)
        if ts_ms < 0:
            raise _fail(path, line_no, "timestamp", f"expected non-negative milliseconds, got {ts_ms!r}")
        rows.append(
            (
                ts_ms / 1000.0,
                _int_field(obj, "input_length", path, line_no),
                _int_field(obj, "output_length", path, line_no),
                _hash_ids_field(obj, "hash_ids", path, line_no),
            )
        )
    rows.sort(key=lambda r: r[0])
    index = _PrefixIndex()
    inputs: list[int] = []
    requests: list[Request] = []
    for rid, (arrival_s, input_tokens, output_tokens, block_ids) in enumerate(rows):
        parent, shared = _prefix_fields(index, block_ids, input_tokens, inputs, MOONCAKE_BLOCK_TOKENS)
        requests.append(Request(rid, -1, 0, arrival_s, input_tokens, output_tokens, parent, shared))
        index.add(block_ids, rid)
        inputs.append(input_tokens)
    return Trace(
        name=Path(path).name.split(".")[0],
        requests=requests,
        closed_loop=False,
        source=f"Mooncake FAST'25 trace {Path(path).name} (kvcache-ai/Mooncake, Apache-2.0)",
        block_size_tokens=MOONCAKE_BLOCK_TOKENS,
    )


_AZURE_TICKS_PER_S = 10**7  # the file's resolution (7 fractional digits); integer ticks avoid float loss


def _parse_azure_timestamp(text: str, path: str | Path, line: int) -> int:
    """Ticks (0.1 us) since the epoch of ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (finer digits are dropped)."""
    whole, _, fraction = text.strip().partition(".")
    try:
        base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        if fraction and not fraction.isdigit():
            raise ValueError(fraction)
    except ValueError:
        raise _fail(
            path, line, "TIMESTAMP", f"expected 'YYYY-MM-DD HH:MM:SS.fffffff', got {text!r}"
        ) from None
    seconds = int((base - datetime(1970, 1, 1)).total_seconds())
    return seconds * _AZURE_TICKS_PER_S + int(fraction[:7].ljust(7, "0") or 0)


def load_azure(path: str | Path) -> Trace:
    """Load an Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Open-loop, no prefix or session information; arrivals are seconds after the earliest timestamp.
    """
    rows: list[tuple[int, int, int]] = []
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise _fail(
                path, 1, "<header>", f"expected TIMESTAMP,ContextTokens,GeneratedTokens, got {header!r}"
            )
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 3:
                raise _fail(path, line, "<row>", f"expected 3 columns, got {len(row)}")
            values = []
            for name, cell in zip(("ContextTokens", "GeneratedTokens"), row[1:], strict=True):
                try:
                    value = int(cell)
                except ValueError:
                    value = -1
                if value < 0:
                    raise _fail(path, line, name, f"expected non-negative int, got {cell!r}")
                values.append(value)
            rows.append((_parse_azure_timestamp(row[0], path, line), values[0], values[1]))
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0
    requests = [
        Request(rid, -1, 0, (ticks - t0) / _AZURE_TICKS_PER_S, inp, out)
        for rid, (ticks, inp, out) in enumerate(rows)
    ]
    return Trace(
        name=Path(path).name.split(".")[0],
        requests=requests,
        closed_loop=False,
        source=f"Azure LLM inference trace 2023 {Path(path).name} (Azure/AzurePublicDataset, CC-BY-4.0)",
        block_size_tokens=0,
    )


def _weka_session(
    session: dict[str, Any], path: str | Path, line: int
) -> list[tuple[float, int, float, int, int, list[int], float, bool]]:
    """Flatten one WEKA session into release-ordered tuples.

    Tuples are in flattening order (parent chain, each sub-agent's chain at its marker):
    ``(release_key_s, depends_on_flat, arrival_s, input, output, hash_ids, think_s, think_missing)``.
    ``depends_on_flat`` indexes this list (-1 = session start); ``release_key_s`` is the recorded
    time raised to the dependency's key, so sorting by ``(key, index)`` keeps dependencies first.
    """
    reqs = session.get("requests")
    if not isinstance(reqs, list):
        raise _fail(path, line, "requests", "expected a list")
    flat: list[tuple[float, int, float, int, int, list[int], float, bool]] = []

    def add_chain(chain: list[Any], offset_s: float, first_dep: int, where: str) -> None:
        prev = first_dep
        for k, item in enumerate(chain):
            name = f"{where}[{k}]"
            if not isinstance(item, dict):
                raise _fail(path, line, name, "expected an object")
            t = offset_s + _float_field(item, "t", path, line)
            if item.get("type") == "subagent":
                sub = item.get("requests")
                if not isinstance(sub, list):
                    raise _fail(path, line, f"{name}.requests", "expected a list")
                # a sub-agent is released by the parent-chain request issued just before its marker
                add_chain(sub, t, prev, f"{name}.requests")
                continue
            try:
                inp = _int_field(item, "in", path, line)
                out = _int_field(item, "out", path, line)
                ids = _hash_ids_field(item, "hash_ids", path, line)
                think = _float_field(item, "think_time", path, line, default=math.nan)
            except TraceFormatError as exc:
                raise TraceFormatError(str(exc).replace("field '", f"field '{name}.", 1)) from None
            # a request is never released before what it depends on, even if recorded clocks disagree
            key = max(t, flat[prev][0]) if prev >= 0 else t
            flat.append((key, prev, t, inp, out, ids, think, math.isnan(think)))
            prev = len(flat) - 1

    add_chain(reqs, 0.0, -1, "requests")
    return flat


def load_weka(path: str | Path) -> Trace:
    """Load WEKA kv-cache-tester Claude Code sessions (JSONL or JSONL.gz, one session per line).

    Closed-loop: each request depends on the previous request of its chain (the parent chain or a
    sub-agent's own chain); a sub-agent's first request depends on the parent-chain request issued just
    before the sub-agent marker (session start if none). ``think_time_s`` is the recorded ``think_time``;
    negative values are clamped to 0 and missing ones read as 0 (counts in ``meta``). Session ids are
    0..N-1 in file order; request ids go session by session in release order (recorded time, ties in
    file order). Prefix parents are searched within the session only (hash ids are session-local).
    """
    requests: list[Request] = []
    clamped = missing = 0
    session_id = -1
    for line_no, obj in _json_lines(path):
        session_id += 1
        flat = _weka_session(obj, path, line_no)
        order = sorted(range(len(flat)), key=lambda i: (flat[i][0], i))
        new_id = {flat_i: len(requests) + turn for turn, flat_i in enumerate(order)}
        index = _PrefixIndex()
        base = len(requests)
        inputs: list[int] = []  # indexed by (request id - base)
        for turn, flat_i in enumerate(order):
            _, dep, arrival_s, inp, out, ids, think, think_missing = flat[flat_i]
            rid = base + turn
            local_parent, shared = _prefix_fields(index, ids, inp, inputs, WEKA_BLOCK_TOKENS)
            missing += think_missing
            clamped += (not think_missing) and think < 0
            requests.append(
                Request(
                    request_id=rid,
                    session_id=session_id,
                    turn=turn,
                    arrival_s=arrival_s,
                    input_tokens=inp,
                    output_tokens=out,
                    parent_id=base + local_parent if local_parent >= 0 else -1,
                    shared_prefix_tokens=shared,
                    depends_on=new_id[dep] if dep >= 0 else -1,
                    think_time_s=0.0 if think_missing else max(think, 0.0),
                )
            )
            index.add(ids, turn)
            inputs.append(inp)
    return Trace(
        name=Path(path).name.split(".")[0],
        requests=requests,
        closed_loop=True,
        source=f"WEKA Claude Code sessions {Path(path).name} (callanjfox/kv-cache-tester, Apache-2.0)",
        block_size_tokens=WEKA_BLOCK_TOKENS,
        meta={"clamped_negative_think_times": clamped, "missing_think_times": missing},
    )


# ---------------------------------------------------------------------------------------------------
# Bundle format: gzip CSV, one row per request, with a commented header line.


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


def load_trace(name_or_path: str | Path) -> Trace:
    """Load a bundled trace by name, a bundle file, or an original Mooncake / Azure / WEKA file.

    Files are recognised by content: a bundle header line, an Azure CSV header, or the keys of the
    first JSON line (``requests`` -> WEKA sessions, ``hash_ids`` + ``timestamp`` -> Mooncake).
    """
    if isinstance(name_or_path, str) and name_or_path in BUNDLED_TRACES:
        trace = load_bundle(bundled_path(name_or_path))
        trace.name = name_or_path
        return trace
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a bundled trace name ({', '.join(BUNDLED_TRACES)}) nor a file")
    with _open_text(path) as f:
        first_no, first = next(((n, line) for n, line in enumerate(f, start=1) if line.strip()), (1, ""))
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

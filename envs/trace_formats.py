"""Loaders for the original public trace formats: Mooncake JSONL, Azure LLM 2023 CSV, WEKA Claude Code
session JSONL(.gz).

Every loader returns a :class:`~envs.request.Trace` whose requests are in ``request_id`` order
(0, 1, 2, ...). Prefix identity is derived from the original block hashes: a request's ``parent_id`` is
the most recent earlier request sharing the longest leading run of block hashes with it, and
``shared_prefix_tokens`` is that run times the block size, capped at both input lengths. All public
traces we load use *chained* block ids (a block id implies its whole prefix), which makes the search a
dictionary lookup plus a binary search per request.

Malformed input raises :class:`TraceFormatError` naming the file, the 1-based line and the field.
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import math
import zlib
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from envs.request import Request, Trace

MOONCAKE_BLOCK_TOKENS = 512
WEKA_BLOCK_TOKENS = 64


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


class _Lines:
    """A text file read line by line that turns decoding failures into ``TraceFormatError``s naming the
    file and the line: bytes that are not UTF-8, a ``.gz`` that is not gzip, a gzip stream cut short."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.line = 0
        gz = self.path.name.endswith(".gz")
        self._file: gzip.GzipFile | io.BufferedReader = gzip.open(path, "rb") if gz else open(path, "rb")

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            raw = next(self._file)
            text = raw.decode("utf-8")
        except StopIteration:
            raise
        except UnicodeDecodeError as exc:
            raise self._error(f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x})") from None
        except gzip.BadGzipFile:
            raise self._error("not a gzip file, though its name ends in .gz") from None
        except (EOFError, zlib.error) as exc:
            raise self._error(f"the gzip stream is damaged or cut short ({exc})") from None
        self.line += 1
        return text

    def readline(self) -> str:
        """The next line, or ``""`` at the end (as ``TextIO.readline``)."""
        return next(self, "")

    def _error(self, problem: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path.name}:{self.line + 1}: {problem}")


def _open_text(path: str | Path) -> _Lines:
    """Open a text file, transparently gunzipping ``*.gz``; decoding errors name the file and line."""
    return _Lines(path)


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

"""The real profiler: measure interference profiles on a live SGLang worker over its HTTP API.

For each node state (decode batch size x context length) it

1. starts ``batch`` streaming ``/generate`` requests with ``context`` random input ids and
   ``ignore_eos``, and waits until every one of them is decoding;
2. measures the decode-only step as the median gap between consecutive streamed tokens;
3. for each prefill chunk size and repeat, sends one ``/generate`` of ``chunk`` input ids and
   ``max_new_tokens=1`` and reads the iteration that carried it as the longest token gap the decode
   streams saw while it ran (SGLang mixes a chunk of at most ``chunked_prefill_size`` tokens into one
   iteration); the decode-only step of that repeat is the median gap just before it;
4. aborts the decode requests by closing their streams.

Rows follow the profile schema (``interference_model.schema``) with ``source="sglang"``, so
``crossflow fit-interference`` takes them like simulated profiles. Token gaps are measured on the
client, so they include network jitter: run the profiler next to the worker.

Hardware validation: this runs against ``serving.emulated_worker`` in the tests; it has **not yet
been run against SGLang on a GPU** (the ``gpu``-marked test does that when one is available).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from interference_model.schema import PROFILE_SCHEMA_VERSION, validate_profiles


@dataclass(frozen=True)
class RealProfileConfig:
    """What to sweep on the live worker."""

    url: str
    """Base URL of one SGLang worker, e.g. ``http://127.0.0.1:30000``."""
    hardware: str
    model: str
    tp: int = 1
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    context_tokens: tuple[int, ...] = (1024, 8192)
    chunk_tokens: tuple[int, ...] = (256, 1024, 4096)
    repeats: int = 3
    warmup_tokens: int = 4
    """Tokens every decode stream must have produced before measuring."""
    decode_window_tokens: int = 8
    """Token gaps used for the decode-only step."""
    max_new_tokens: int = 4096
    """Length of the decode requests (they are aborted when the state is done)."""
    seed: int = 0
    timeout_s: float = 120.0
    vocab_size: int = 32_000
    """Random input ids are drawn from [1000, vocab_size) so no prefix is shared between requests."""

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup_tokens < 1 or self.decode_window_tokens < 2:
            raise ValueError("RealProfileConfig: repeats, warmup_tokens >= 1 and decode_window_tokens >= 2")
        if min(self.batch_sizes + self.context_tokens + self.chunk_tokens) < 1:
            raise ValueError("RealProfileConfig: batch sizes, contexts and chunks must be >= 1")


@dataclass
class _Stream:
    times_s: list[float] = field(default_factory=list)


async def _get_json(client: Any, url: str) -> dict[str, Any]:
    response = await client.get(url)
    response.raise_for_status()
    return dict(response.json())


async def _decode_stream(client: Any, url: str, ids: list[int], cfg: RealProfileConfig, out: _Stream) -> None:
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "ignore_eos": True, "temperature": 0.0},
        "stream": True,
    }
    async with client.stream("POST", f"{url}/generate", json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                out.times_s.append(time.perf_counter())


async def _wait_tokens(streams: Sequence[_Stream], n: int, deadline_s: float) -> None:
    while min(len(s.times_s) for s in streams) < n:
        if time.perf_counter() > deadline_s:
            raise TimeoutError(f"decode streams did not reach {n} tokens in time")
        await asyncio.sleep(0.001)


def _gaps(times_s: Sequence[float], start_s: float, end_s: float) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times_s) if start_s <= b <= end_s]


async def profile_state(
    client: Any,
    cfg: RealProfileConfig,
    server: dict[str, Any],
    batch: int,
    context: int,
    state_id: int,
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    """All rows of one node state (see the module docstring)."""
    url = cfg.url.rstrip("/")
    streams = [_Stream() for _ in range(batch)]
    tasks = [
        asyncio.create_task(
            _decode_stream(client, url, rng.integers(1000, cfg.vocab_size, context).tolist(), cfg, s)
        )
        for s in streams
    ]
    rows: list[dict[str, Any]] = []
    try:
        deadline = time.perf_counter() + cfg.timeout_s
        await _wait_tokens(streams, cfg.warmup_tokens + cfg.decode_window_tokens, deadline)
        for chunk in cfg.chunk_tokens:
            for repeat in range(cfg.repeats):
                before = time.perf_counter()
                quiet = [g for s in streams for g in _gaps(s.times_s, before - 1.0, before)]
                decode_only = statistics.median(quiet[-cfg.decode_window_tokens * batch :])
                ids = rng.integers(1000, cfg.vocab_size, chunk).tolist()
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
                response = await client.post(f"{url}/generate", json=body)
                response.raise_for_status()
                done = time.perf_counter()
                # the carrying iteration ends at most one decode step after the prefill returns
                await asyncio.sleep(2 * decode_only)
                window = [g for s in streams for g in _gaps(s.times_s, before, done + 2 * decode_only)]
                generated = float(np.mean([len(s.times_s) for s in streams]))
                rows.append(
                    {
                        "schema_version": PROFILE_SCHEMA_VERSION,
                        "source": "sglang",
                        "hardware": cfg.hardware,
                        "model": cfg.model,
                        "tp": cfg.tp,
                        "state_id": state_id,
                        "state_group": state_id,
                        "repeat": repeat,
                        "decode_batch_size": batch,
                        "context_tokens_mean": float(context),
                        "context_tokens_std": 0.0,
                        "remaining_output_tokens_mean": float(cfg.max_new_tokens),
                        "kv_occupancy": min(
                            1.0, batch * (context + generated) / server["max_total_num_tokens"]
                        ),
                        "kv_capacity_tokens": int(server["max_total_num_tokens"]),
                        "chunk_tokens": chunk,
                        "cached_prefix_tokens": 0,
                        "iteration_time_s": max(window) if window else decode_only,
                        "decode_only_time_s": decode_only,
                    }
                )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # Remaining output is constant by design (requests are aborted, never finish); context and KV
    # occupancy of a state are fixed at its start so every row of the state shares them.
    first = rows[0] if rows else {}
    for row in rows:
        row["kv_occupancy"] = first["kv_occupancy"]
    return rows


async def profile_worker(cfg: RealProfileConfig) -> pd.DataFrame:
    """Sweep every (batch, context) state on the worker at ``cfg.url``; returns a validated profile."""
    import httpx

    rng = np.random.default_rng(cfg.seed)
    limits = httpx.Limits(max_connections=max(cfg.batch_sizes) + 8)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        server = await _get_json(client, f"{cfg.url.rstrip('/')}/get_server_info")
        if "max_total_num_tokens" not in server:
            raise ValueError(f"{cfg.url}/get_server_info: field 'max_total_num_tokens' missing")
        rows: list[dict[str, Any]] = []
        for state_id, (batch, context) in enumerate(
            (b, c) for b in cfg.batch_sizes for c in cfg.context_tokens
        ):
            if batch * (context + cfg.max_new_tokens) > server["max_total_num_tokens"]:
                continue  # would not fit the worker's KV: SGLang would queue or retract
            rows.extend(await profile_state(client, cfg, server, batch, context, state_id, rng))
    if not rows:
        raise ValueError(
            f"{cfg.url}: no state fits the worker's KV cache ({server['max_total_num_tokens']} tokens)"
        )
    return validate_profiles(pd.DataFrame(rows), source=cfg.url)


def run_profile(cfg: RealProfileConfig) -> pd.DataFrame:
    """Blocking wrapper of :func:`profile_worker`."""
    return asyncio.run(profile_worker(cfg))


def summary(df: pd.DataFrame) -> dict[str, Any]:
    """Small JSON-able summary of a measured profile."""
    return json.loads(
        json.dumps(
            {
                "rows": len(df),
                "states": int(df["state_id"].nunique()),
                "decode_only_time_s_median": float(df["decode_only_time_s"].median()),
                "iteration_time_s_median": float(df["iteration_time_s"].median()),
            }
        )
    )

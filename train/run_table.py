"""The table ``crossflow simulate`` and ``crossflow replay`` print for one run (one home for its rows)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def metric_rows(m: Mapping[str, Any], *, measured: bool = False) -> list[tuple[str, str]]:
    """The label / value rows of a run's table (``crossflow simulate``'s rows); ``n/a`` for a figure
    that is None (not observable) or NaN. ``measured``: the run was a replay against a server, so the
    duration is not simulated and a rejection is whatever the server refused."""

    def known(*keys: str) -> bool:
        return all(m.get(k) is not None and not (isinstance(m[k], float) and math.isnan(m[k])) for k in keys)

    def fmt(keys: tuple[str, ...], render: Any) -> str:
        return render(*(m[k] for k in keys)) if known(*keys) else "n/a"

    return [
        ("requests finished", f"{m['n_finished']} / {m['n_requests']}"),
        (
            "rejected (refused by the server)" if measured else "rejected (beyond context or KV)",
            fmt(("n_rejected",), lambda n: f"{n}"),
        ),
        ("duration" if measured else "simulated duration", fmt(("duration_s",), lambda d: f"{d:,.1f} s")),
        ("input throughput", fmt(("input_tokens_per_s",), lambda x: f"{x:,.0f} tok/s")),
        ("output throughput", fmt(("output_tokens_per_s",), lambda x: f"{x:,.0f} tok/s")),
        (
            "TTFT mean / p50 / p99",
            fmt(
                ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s"), lambda a, b, c: f"{a:.3f} / {b:.3f} / {c:.3f} s"
            ),
        ),
        (
            "ITL mean / p50 / p99",
            fmt(
                ("itl_mean_s", "itl_p50_s", "itl_p99_s"),
                lambda a, b, c: f"{1e3 * a:.1f} / {1e3 * b:.1f} / {1e3 * c:.1f} ms",
            ),
        ),
        ("E2E mean / p99", fmt(("e2e_mean_s", "e2e_p99_s"), lambda a, b: f"{a:.2f} / {b:.2f} s")),
        ("SLO attainment", fmt(("slo_attainment",), lambda x: f"{100 * x:.1f} %")),
        ("prefix-cache hit share", fmt(("prefix_hit_share",), lambda x: f"{100 * x:.1f} %")),
        (
            "borrowed / fallback",
            fmt(("borrowed_share", "fallback_share"), lambda a, b: f"{100 * a:.1f} % / {100 * b:.1f} %"),
        ),
        (
            "utilisation prefill / decode",
            fmt(
                ("prefill_utilisation", "decode_utilisation"),
                lambda a, b: f"{100 * a:.0f} % / {100 * b:.0f} %",
            ),
        ),
        ("retractions", fmt(("retractions",), lambda n: f"{n}")),
        (
            "rejected: past context / larger than KV",
            fmt(("n_rejected_context", "n_rejected"), lambda c, n: f"{c} / {n - c}"),
        ),
        ("compacted to the context window", fmt(("n_compacted",), lambda n: f"{n}")),
        ("dropped at load (0 input or output)", fmt(("n_dropped_empty",), lambda n: f"{n}")),
        ("largest prompt served", fmt(("max_input_tokens_served",), lambda n: f"{n:,} tokens")),
        (
            "lease utilisation (spent / granted)",
            fmt(
                ("lease_utilisation", "lease_granted_prefill_tokens"),
                lambda u, g: f"{100 * u:.1f} % of {g:,.0f} granted prefill tokens",
            ),
        ),
    ]


def node_rows(nodes: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """``busy share prefill`` / ``busy share decode`` rows: each worker's share of the run it was busy."""
    by_role: dict[str, list[str]] = {}
    for node in nodes:
        role = str(node["role"])
        tag = "P" if role == "prefill" else "D"
        share = 100 * float(node["busy_fraction"])
        by_role.setdefault(role, []).append(f"{tag}{node['index']} {share:.0f} %")
    return [(f"busy share {role}", ", ".join(cells)) for role, cells in by_role.items()]

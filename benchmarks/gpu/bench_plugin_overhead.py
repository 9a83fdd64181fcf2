"""What the SGLang plugin's hooks cost per scheduler iteration, on CPU (no SGLang, no GPU).

Times the plugin's own work in the hooks that run every iteration (batch selection and the KV budget)
on the look-alike decode scheduler (``serving.sglang_plugin.lookalike``) with a running batch of
``--running`` requests, SGLang's own step replaced by a constant, in three states: nothing borrowed
(the fast path every stock request pays), borrowed requests queued but held back (decode first: the
plan is made and SGLang's step runs), and the KV budget hook with work queued. Medians of
``--repeats`` runs of ``--calls`` calls each.

    python benchmarks/gpu/bench_plugin_overhead.py [--running 64] [--calls 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from policies.lease import LeaseBudgets
from serving.sglang_plugin import lookalike as sg
from serving.sglang_plugin.config import PluginConfig
from serving.sglang_plugin.local_prefill import LocalPrefill, SGLangApi
from serving.sglang_plugin.wire import mark_routing_key


def _node(running: int, borrowed: int) -> tuple[LocalPrefill, sg.Scheduler]:
    scheduler = sg.Scheduler(kv_tokens=10_000_000, max_running_requests=running)  # full: decode first
    api = SGLangApi(
        prepare_abort=sg.prepare_abort, finish_abort=sg.FINISH_ABORT, agree_min_ns=lambda _s, ns: ns
    )
    node = LocalPrefill(scheduler, PluginConfig(), api)
    for i in range(running):
        req = sg.Req(f"r{i}", list(range(2_000)), sg.SamplingParams(max_new_tokens=500))
        req.output_ids = [7] * 100
        scheduler.running_batch.reqs.append(req)
    lease = LeaseBudgets(
        prefill_tokens=10**9, kv_tokens=10**9, transfer_tokens=0, decode_tokens=10**9, tasks=64
    )
    node.install_lease(lease, 3600.0)
    for i in range(borrowed):
        req = sg.Req(f"b{i}", list(range(1_000)), sg.SamplingParams(max_new_tokens=100))
        req.routing_key = mark_routing_key(None)
        node.intake(lambda *a: None, req, False)
    return node, scheduler


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    plan = sg.NextBatchPlan(None, sg.ScheduleBatch())

    def sglang_step(_scheduler: object, _running: object) -> sg.NextBatchPlan:
        return plan

    idle, s_idle = _node(args.running, 0)
    held, s_held = _node(args.running, 4)
    assert held.queue, "the borrowed requests stay queued (the batch is full)"
    rows = [
        ("select, nothing borrowed", lambda: idle.select(sglang_step, s_idle.running_batch)),
        ("select, 4 borrowed held back", lambda: held.select(sglang_step, s_held.running_batch)),
        ("KV budget, 4 borrowed queued", held.held_out_kv_tokens),
    ]
    print(f"plugin work per call, running batch of {args.running} (median of {args.repeats} x {args.calls})")
    for name, fn in rows:
        print(f"  {name:32s} {_per_call_us(fn, args.calls, args.repeats):8.2f} us")


if __name__ == "__main__":
    main()

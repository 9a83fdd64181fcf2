"""The SGLang worker plugin without a GPU: its hooks against the committed 0.5.23 snapshot, and each
hook's effect on the look-alike scheduler (``serving.sglang_plugin.lookalike``) built to the
snapshot's names. None of this runs SGLang; ``benchmarks/gpu/sglang_plugin_check.py`` does."""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Iterator
from dataclasses import replace
from importlib.metadata import entry_points

import pytest

from policies.chunk_limits import ChunkLimits
from policies.lease import LeaseBudgets
from policies.node_policies import DecodePressureRule
from serving.sglang_plugin import hooks, local_prefill, wire
from serving.sglang_plugin import lookalike as sg
from serving.sglang_plugin.config import PluginConfig
from serving.sglang_plugin.contract import RELIED, glue_sources, glue_uses, missing_from_contract
from serving.sglang_plugin.local_prefill import NODE_ATTRIBUTE, SGLangApi
from serving.sglang_plugin.snapshot import check_hook_points, load_snapshot

LEASE = LeaseBudgets(
    prefill_tokens=20_000, kv_tokens=50_000, transfer_tokens=0, decode_tokens=10_000, tasks=4
)


# ---------------------------------------------------------------- set-up
def _registry(*, without: tuple[str, ...] = ()) -> sg.HookRegistry:
    registry = sg.HookRegistry()
    hooks.register(registry, sg.HookType)
    registry.hooks = [h for h in registry.hooks if not h[0].endswith(without)] if without else registry.hooks
    return registry


@pytest.fixture
def installed() -> Iterator[sg.HookRegistry]:
    registry = _registry()
    with registry.installed():
        yield registry


def _worker(**kwargs: object) -> tuple[sg.Scheduler, sg.Cluster]:
    scheduler = sg.Scheduler(**kwargs)  # type: ignore[arg-type]
    cluster = sg.Cluster(scheduler)
    api = SGLangApi(
        prepare_abort=sg.prepare_abort,
        finish_abort=sg.FINISH_ABORT,
        agree_min_ns=lambda _scheduler, ns: ns,
        monotonic_ns=cluster.monotonic_ns,
    )
    hooks.configure(api, PluginConfig(node_id=3, burst_s=0.5), sg.SetInternalStateReqOutput)
    return scheduler, cluster


def _lease(
    scheduler: sg.Scheduler,
    budgets: LeaseBudgets | None = None,
    ttl_s: float = 1.0,
    chunk_limits: ChunkLimits | None = None,
    pressure_rule: DecodePressureRule | None = None,
) -> bool:
    """Install a lease through ``/set_internal_state``'s hook (default: ``LEASE``, its prefill budget
    scaled to 20_000 tokens/s over ``ttl_s``)."""
    if budgets is None:
        budgets = replace(LEASE, prefill_tokens=int(20_000 * ttl_s))
    body = wire.lease_update_body(budgets, ttl_s, chunk_limits, pressure_rule)
    return scheduler.set_internal_state(sg.SetInternalStateReq(**body)).updated


def _req(rid: str, prompt: int, output: int, *, borrowed: bool) -> sg.Req:
    key = wire.mark_routing_key(None) if borrowed else None
    return sg.Req(
        rid, list(range(100, 100 + prompt)), sg.SamplingParams(max_new_tokens=output), routing_key=key
    )


def _node(scheduler: sg.Scheduler) -> local_prefill.LocalPrefill:
    return scheduler.__dict__[NODE_ATTRIBUTE]


# ---------------------------------------------------------------- against the snapshot
def test_the_entry_point_is_installed() -> None:
    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "crossflow"]
    assert ep.value == "serving.sglang_plugin.hooks:load"
    assert ep.load() is hooks.load
    assert load_snapshot()["plugin_framework"]["entry_point_group"] == ep.group


def test_every_hook_targets_a_recorded_function_with_its_parameters() -> None:
    snap = load_snapshot()
    assert check_hook_points(snap) == []
    registry = _registry()
    kinds = set(snap["plugin_framework"]["hook_types"])
    for target, hook, hook_type in registry.hooks:
        assert target in snap["functions"], target
        assert hook_type.name in kinds
        sglang_params = [p["name"] for p in snap["functions"][target]["params"]]
        hook_params = list(inspect.signature(hook).parameters)[1:]
        assert hook_params[1:] == sglang_params[1:], target
    # the look-alike's hooked methods take the same parameters as 0.5.23's
    for target, _, _ in registry.hooks:
        owner, _, name = target.rpartition(".")
        method = getattr(sg.HookRegistry.TARGET_CLASSES[owner], name)
        assert list(inspect.signature(method).parameters) == [
            p["name"] for p in snap["functions"][target]["params"]
        ], target


def test_the_glue_uses_only_what_the_contract_lists_and_the_lookalike_has_it() -> None:
    uses = glue_uses(glue_sources())
    assert missing_from_contract(uses) == []
    listed = {(c, n) for c, names in RELIED.items() for n in names}
    used = {(c, n) for role, n in uses for c in role.split("|")}
    assert listed - used == set(), "contract entries the glue no longer uses"
    scheduler, _ = _worker(kv_tokens=1000)
    req, batch = _req("r", 4, 2, borrowed=False), sg.ScheduleBatch()
    objects = {
        "Scheduler": scheduler,
        "DecodePreallocQueue": scheduler.disagg_decode_prealloc_queue,
        "DecodeRequest": sg.DecodeRequest(req),
        "Req": req,
        "ScheduleBatch": batch,
        "NextBatchPlan": sg.NextBatchPlan(None, batch),
        "SamplingParams": req.sampling_params,
    }
    for cls, obj in objects.items():
        for name in RELIED[cls]:
            assert name in dir(obj), f"the look-alike {cls} lacks {name}"


# ---------------------------------------------------------------- the marker
def test_the_tokenizer_hook_carries_the_marker_and_nothing_else(installed: sg.HookRegistry) -> None:
    async def send(body: bytes, obj: sg.GenerateReqInput) -> list[object]:
        return [out async for out in sg.TokenizerManager().generate_request(obj, sg.Request(body))]

    obj = sg.GenerateReqInput(input_ids=[1, 2], routing_key="tenant-a")
    asyncio.run(send(b'{"input_ids": [1, 2], "do_local_prefill": true, "routing_key": "tenant-a"}', obj))
    assert wire.unmark_routing_key(obj.routing_key) == (True, "tenant-a")
    plain = sg.GenerateReqInput(input_ids=[1, 2])
    assert asyncio.run(send(b'{"input_ids": [1, 2]}', plain)) == [{"routing_key": None}]
    off = sg.GenerateReqInput(input_ids=[1, 2])
    asyncio.run(send(b'{"input_ids": [1, 2], "do_local_prefill": false}', off))
    assert off.routing_key is None
    with pytest.raises(ValueError, match="batch of prompts"):
        asyncio.run(send(b'{"text": ["a", "b"], "do_local_prefill": true}', sg.GenerateReqInput()))
    with pytest.raises(ValueError, match="must be true or false"):
        asyncio.run(send(b'{"input_ids": [1], "do_local_prefill": "yes"}', sg.GenerateReqInput()))


# ---------------------------------------------------------------- intake
def test_without_a_lease_a_borrowed_request_gets_503_before_any_token(installed: sg.HookRegistry) -> None:
    scheduler, _ = _worker(kv_tokens=10_000)
    req = _req("b1", 800, 20, borrowed=True)
    scheduler._add_request_to_queue(req)
    assert req.finished() and req.finished_reason.status_code == 503 and req.output_ids == []
    assert "no live lease" in scheduler.output_streamer.finished["b1"]["message"]
    assert req.routing_key is None, "the marker is taken off"
    assert not scheduler.disagg_decode_prealloc_queue.queue, "it never waits for a KV transfer"
    assert scheduler.released == ["b1"]


def test_intake_queues_under_a_lease_and_leaves_everything_else_to_sglang(installed: sg.HookRegistry) -> None:
    scheduler, _ = _worker(kv_tokens=10_000)
    assert _lease(scheduler)
    borrowed, normal = _req("b1", 800, 20, borrowed=True), _req("p1", 800, 20, borrowed=False)
    scheduler._add_request_to_queue(borrowed)
    scheduler._add_request_to_queue(normal)
    node = _node(scheduler)
    assert node.queue == [borrowed] and not borrowed.finished()
    assert [d.req for d in scheduler.disagg_decode_prealloc_queue.queue] == [normal]
    retracted = _req("b2", 100, 5, borrowed=True)
    scheduler._add_request_to_queue(retracted, is_retracted=True)  # a re-queue, not an arrival
    assert scheduler.disagg_decode_prealloc_queue.retracted_queue == [retracted]
    tight = LeaseBudgets(
        prefill_tokens=500, kv_tokens=50_000, transfer_tokens=0, decode_tokens=10_000, tasks=4
    )
    assert _lease(scheduler, tight)  # the queued request no longer fits: revoked, 503, no token
    assert borrowed.finished_reason.status_code == 503 and "revoked" in borrowed.finished_reason.message
    late = _req("b3", 2_000, 20, borrowed=True)
    scheduler._add_request_to_queue(late)
    assert "prefill_tokens 2000 > 500 left" in late.finished_reason.message


def test_a_worker_the_plugin_does_not_support_refuses_with_the_reason(installed: sg.HookRegistry) -> None:
    scheduler, _ = _worker(kv_tokens=10_000, enable_overlap=True)
    _lease(scheduler)
    req = _req("b1", 100, 5, borrowed=True)
    scheduler._add_request_to_queue(req)
    assert (
        req.finished_reason.status_code == 503 and "--disable-overlap-schedule" in req.finished_reason.message
    )


def test_bad_lease_updates_are_refused_and_other_settings_left_to_sglang(installed: sg.HookRegistry) -> None:
    scheduler, _ = _worker(kv_tokens=10_000)
    args = wire.lease_update_body(LEASE, 1.0)["server_args"]
    assert not scheduler.set_internal_state(
        sg.SetInternalStateReq({**args, "crossflow_lease_tasks": -1})
    ).updated
    assert not scheduler.set_internal_state(
        sg.SetInternalStateReq({**args, "pp_max_micro_batch_size": 8})
    ).updated
    bad_table = {"batch_sizes": [2, 1], "context_tokens": [0], "chunk_tokens": [[1], [1]]}
    assert not scheduler.set_internal_state(
        sg.SetInternalStateReq({**args, wire.LEASE_CHUNK_LIMITS_KEY: bad_table})
    ).updated
    missing = {k: v for k, v in args.items() if k != wire.LEASE_TTL_KEY}
    assert not scheduler.set_internal_state(sg.SetInternalStateReq(missing)).updated
    node = scheduler.__dict__.get(NODE_ATTRIBUTE)
    assert node is None or node.admission.lease() is None
    assert not scheduler.set_internal_state(sg.SetInternalStateReq({"pp_max_micro_batch_size": 8})).updated


# ---------------------------------------------------------------- KV accounting
def test_the_prealloc_budget_leaves_out_what_borrowed_work_holds(installed: sg.HookRegistry) -> None:
    scheduler, cluster = _worker(kv_tokens=10_000, reserved_decode_tokens=64, chunked_prefill_size=512)
    prealloc = scheduler.disagg_decode_prealloc_queue
    assert prealloc._allocatable_token_budgets() == 10_000, "nothing borrowed: SGLang's budget"
    _lease(scheduler)
    scheduler._add_request_to_queue(_req("b1", 3_000, 200, borrowed=True))
    assert prealloc._allocatable_token_budgets() == 10_000 - 3_200, "the queued prompt and its output"
    assert prealloc._swa_tail_allocatable_token_budget() == 10_000 - 3_200
    assert prealloc._allocatable_token_budgets(count_retracted=False) == 10_000, (
        "retracted decodes resume first"
    )
    while not cluster.extend_tokens:
        cluster.step()  # until the lease's credit pays for a first chunk
    assert 0 < cluster.extend_tokens[0] < 3_000, "a chunked prompt"
    # allocated: the first chunk; held out: the rest of the prompt and the request's reserved decode
    # tokens (it is in no SGLang queue yet)
    assert prealloc._allocatable_token_budgets() == 10_000 - 3_000 - 64
    assert _node(scheduler).held_out_kv_tokens() == 3_000 - cluster.extend_tokens[0] + 64


# ---------------------------------------------------------------- batch selection, end to end
def _mixed_run(**kwargs: object) -> tuple[sg.Scheduler, sg.Cluster, list[sg.Req]]:
    scheduler, cluster = _worker(**kwargs)
    _lease(scheduler, ttl_s=100.0)
    reqs = [
        _req("p1", 400, 30, borrowed=False),
        _req("b1", 1_500, 25, borrowed=True),
        _req("p2", 300, 40, borrowed=False),
        _req("b2", 200, 10, borrowed=True),
        _req("p3", 500, 20, borrowed=False),
    ]
    cluster.run(200, [(i * 3, r) for i, r in enumerate(reqs)])
    return scheduler, cluster, reqs


@pytest.mark.parametrize("mixed", [False, True], ids=["extend-steps", "mixed-chunk"])
def test_borrowed_and_pd_requests_complete_with_their_output_length(
    installed: sg.HookRegistry, mixed: bool
) -> None:
    scheduler, cluster, reqs = _mixed_run(kv_tokens=20_000, chunked_prefill_size=512, is_mixed_chunk=mixed)
    for req in reqs:
        assert req.finished() and req.finished_reason.to_json()["type"] == "length", req.rid
        assert len(req.output_ids) == req.sampling_params.max_new_tokens, req.rid
    assert scheduler.retracted == 0
    assert sum(cluster.extend_tokens) == 1_500 + 200, "each borrowed prompt computed once, locally"
    assert max(cluster.extend_tokens) <= 512
    node = _node(scheduler)
    assert node.counters["started"] == 2 and node.counters["finished"] == 2
    assert node.admission.held().is_zero(), "every budget returned"
    assert scheduler.allocator.used == 0, "no KV left behind"
    assert scheduler.stashed == 2, "the 1_500-token prompt ran in three chunks, stashed twice"


def test_the_token_bucket_bounds_local_prefill_per_step(installed: sg.HookRegistry) -> None:
    scheduler, cluster = _worker(kv_tokens=20_000, chunked_prefill_size=4_096)
    slow = LeaseBudgets(
        prefill_tokens=6_000, kv_tokens=50_000, transfer_tokens=0, decode_tokens=10_000, tasks=4
    )
    _lease(scheduler, slow, ttl_s=2.0)  # 3_000 tokens/s; the bucket holds at most 0.5 s of it
    node = _node(scheduler)
    prompts = [_req("b1", 3_000, 5, borrowed=True), _req("b2", 700, 5, borrowed=True)]
    for r in (_req("p1", 200, 150, borrowed=False), *prompts):
        scheduler._add_request_to_queue(r)
    for step in range(300):
        cluster.step()
        granted = node.admission.ledger.granted_prefill_tokens(3, cluster.now_s)
        assert sum(cluster.extend_tokens) <= granted + 1e-6, f"step {step}: spent more than granted"
    assert max(cluster.extend_tokens) <= 1_500, "never more than the bucket holds"
    assert sum(cluster.extend_tokens) == 3_700 and len(cluster.extend_tokens) >= 3, "paid in chunks"
    assert all(len(r.output_ids) == 5 for r in prompts)
    assert scheduler.allocator.used == 0 and scheduler.retracted == 0


@pytest.mark.parametrize("with_limits", [False, True], ids=["bucket-only", "lease-chunk-limits"])
def test_the_lease_caps_each_local_prefill_step_by_the_running_batch(
    installed: sg.HookRegistry, with_limits: bool
) -> None:
    """The node policy's cap travels with the lease (``wire.LEASE_CHUNK_LIMITS_KEY``) and sizes every
    EXTEND step for the running batch at that step, as the simulator sizes its borrowed chunks."""
    scheduler, cluster = _worker(kv_tokens=40_000, chunked_prefill_size=4_096)
    limits = ChunkLimits((1, 2, 8), (0, 10**6), ((1_024, 1_024), (384, 384), (128, 128)))
    assert _lease(scheduler, ttl_s=4.0, chunk_limits=limits if with_limits else None)
    node = _node(scheduler)
    assert node.admission.chunk_limits == (limits if with_limits else None)
    arrivals = [(0, _req("p1", 200, 400, borrowed=False)), (0, _req("p2", 300, 400, borrowed=False))]
    prompt = _req("b1", 3_000, 5, borrowed=True)
    cluster.run(20, arrivals)
    assert len(scheduler.running_batch.reqs) == 2
    scheduler._add_request_to_queue(prompt)
    batches: list[int] = []
    while not prompt.finished() and len(batches) < 400:
        running = len(scheduler.running_batch.reqs)
        before = len(cluster.extend_tokens)
        cluster.step()
        if len(cluster.extend_tokens) > before:
            batches.append(running)
    steps = cluster.extend_tokens[-len(batches) :]
    assert prompt.finished() and len(prompt.output_ids) == 5
    assert sum(steps) == 3_000 and set(batches) == {2}
    if with_limits:
        assert max(steps) == 384 and len(steps) == 8, "the row of a batch of two"
        plugin = scheduler.get_internal_state(sg.GetInternalStateReq()).internal_state[
            wire.INTERNAL_STATE_KEY
        ]
        assert plugin["chunk_limited"] and plugin["largest_step_beside_decode_tokens"] == 384
    else:
        assert max(steps) > 384, "the token bucket alone takes bigger steps"
    assert scheduler.retracted == 0


def test_a_borrowed_request_waits_while_the_leases_pressure_rule_holds(installed: sg.HookRegistry) -> None:
    """The node policy's decode-pressure test travels with the lease (``wire.LEASE_PRESSURE_RULE_KEY``):
    while it holds on the node's state (here an ITL target no step can keep), a queued borrowed
    request does not start, as the simulator's node pauses it; a lease whose rule no longer holds lets
    it start and finish."""
    scheduler, cluster = _worker(kv_tokens=40_000, chunked_prefill_size=4_096)
    strict = DecodePressureRule(itl_target_s=1e-9, kv_high_watermark=0.9, batch_high_fraction=0.9)
    assert _lease(scheduler, ttl_s=4.0, pressure_rule=strict)
    node = _node(scheduler)
    assert node.admission.pressure_rule == strict
    cluster.run(20, [(0, _req("p1", 200, 400, borrowed=False))])
    prompt = _req("b1", 1_000, 5, borrowed=True)
    scheduler._add_request_to_queue(prompt)
    before = len(cluster.extend_tokens)
    for _ in range(30):
        cluster.step()
    assert len(cluster.extend_tokens) == before and not prompt.output_ids, "held: decode pressure"
    assert [req.rid for req in node.queue] == ["b1"], "still queued, not refused"
    assert _lease(scheduler, ttl_s=4.0, pressure_rule=replace(strict, itl_target_s=10.0))
    for _ in range(60):
        if prompt.finished():
            break
        cluster.step()
    assert prompt.finished() and len(prompt.output_ids) == 5
    assert sum(cluster.extend_tokens[before:]) == 1_000


def test_the_pressure_rule_round_trips_on_the_wire_and_a_bad_one_names_the_field() -> None:
    rule = DecodePressureRule(0.05, 0.9, 0.85, discount_prealloc_kv=True)
    body = wire.lease_update_body(LEASE, 2.0, None, rule)
    assert wire.parse_lease_update(body["server_args"]).pressure_rule == rule
    assert wire.parse_lease_update(wire.lease_update_body(LEASE, 2.0)["server_args"]).pressure_rule is None
    for bad, field in (
        ({**rule.to_dict(), "itl_target_s": "0.05"}, "itl_target_s"),
        ({**rule.to_dict(), "kv_high_watermark": 1.5}, "kv_high_watermark"),
        ({**rule.to_dict(), "discount_prealloc_kv": 1}, "discount_prealloc_kv"),
        ({"itl_target_s": 0.05}, "missing"),
        ({**rule.to_dict(), "extra": 1}, "extra"),
        ([0.05], "object"),
    ):
        args = {**body["server_args"], wire.LEASE_PRESSURE_RULE_KEY: bad}
        with pytest.raises(ValueError, match=field) as err:
            wire.parse_lease_update(args)
        assert wire.LEASE_PRESSURE_RULE_KEY in str(err.value)


def _shape(batch: sg.ScheduleBatch | None) -> tuple[bool, int] | None:
    """``(a decode step, its requests)`` when it ran (the running batch object changes later)."""
    return None if batch is None else (batch.forward_mode.is_decode(), len(batch.reqs))


def test_the_node_reports_the_decode_tokens_that_waited_for_local_prefill(installed: sg.HookRegistry) -> None:
    """``NodeState.decode_tokens_total`` / ``mixed_decode_tokens_total`` (what the lease path's
    mixed-share budget reads, as differences): every token the running batch got, and those whose
    step came right after a local EXTEND step (they waited it out)."""
    scheduler, cluster = _worker(kv_tokens=40_000, chunked_prefill_size=512)
    assert _lease(scheduler, ttl_s=4.0)
    cluster.run(20, [(0, _req("p1", 200, 400, borrowed=False)), (0, _req("p2", 300, 400, borrowed=False))])
    node = _node(scheduler)
    start = node.node_state()  # the plugin records an iteration when the next one is selected,
    ran = [_shape(scheduler.last_batch)]  # so the window holds this last one, then the 40 below
    scheduler._add_request_to_queue(_req("b1", 3_000, 5, borrowed=True))
    ran += [_shape(cluster.step()) for _ in range(40)]
    cluster.step()  # records the 40th
    decode_tokens = mixed_tokens = 0
    after_extend = False
    for shape in ran:
        if shape is None:
            continue
        decoding, tokens = shape
        if decoding:
            decode_tokens += tokens
            mixed_tokens += tokens if after_extend else 0
            after_extend = False
        else:
            after_extend = True
    state = node.node_state()
    assert mixed_tokens > 0 and decode_tokens > mixed_tokens, "the prompt ran in several EXTEND steps"
    assert (
        state.decode_tokens_total - start.decode_tokens_total,
        state.mixed_decode_tokens_total - start.mixed_decode_tokens_total,
    ) == (decode_tokens, mixed_tokens)
    assert node.node_state().decode_tokens_total == state.decode_tokens_total, "reading resets nothing"


def test_decoding_requests_get_a_token_between_any_two_local_prefill_steps(
    installed: sg.HookRegistry,
) -> None:
    """Decode wins: without ``--enable-mixed-chunk`` a running batch waits out at most one local
    EXTEND step per token (the plugin alternates them), as with a mixed iteration in the simulator."""
    scheduler, cluster = _worker(kv_tokens=40_000, chunked_prefill_size=512)
    assert _lease(scheduler, ttl_s=4.0)
    cluster.run(20, [(0, _req("p1", 200, 400, borrowed=False)), (0, _req("p2", 300, 400, borrowed=False))])
    prompt = _req("b1", 3_000, 5, borrowed=True)
    scheduler._add_request_to_queue(prompt)
    steps = []
    while not prompt.finished() and len(steps) < 100:
        before = len(cluster.extend_tokens)
        batch = cluster.step()
        steps.append("extend" if len(cluster.extend_tokens) > before else "decode" if batch else "idle")
    assert prompt.finished() and steps.count("extend") == 6, steps
    assert all(a != "extend" or b != "extend" for a, b in itertools.pairwise(steps)), steps
    assert scheduler.retracted == 0


def test_a_started_prompt_whose_lease_lapses_is_aborted_with_503(installed: sg.HookRegistry) -> None:
    scheduler, cluster = _worker(kv_tokens=20_000, chunked_prefill_size=256)
    slow = LeaseBudgets(
        prefill_tokens=4_000, kv_tokens=50_000, transfer_tokens=0, decode_tokens=10_000, tasks=4
    )
    _lease(scheduler, slow, ttl_s=1.0)  # 4_000 tokens/s: about 80 per 20 ms step
    prompt = _req("b1", 3_000, 5, borrowed=True)
    cluster.run(10, [(0, _req("p1", 200, 200, borrowed=False)), (0, prompt)])
    assert scheduler.chunked_req is prompt and cluster.extend_tokens
    assert _lease(scheduler, LeaseBudgets.zero())  # revoked under decode pressure: the prompt waits
    done = sum(cluster.extend_tokens)
    cluster.run(5)
    assert sum(cluster.extend_tokens) == done and not prompt.finished(), "waiting for a new lease"
    cluster.run(60)  # past the lease's expiry (1 s after it was issued)
    assert prompt.finished_reason.status_code == 503 and prompt.output_ids == []
    assert "expired" in prompt.finished_reason.message and scheduler.chunked_req is None
    assert prompt.kv_tokens == 0 and _node(scheduler).admission.held().is_zero()


def _tight_run(registry: sg.HookRegistry) -> tuple[sg.Scheduler, list[sg.Req]]:
    """KV for little more than the borrowed prompt beside three PD requests; every request's output
    fits its reserved decode tokens, so a retraction means someone over-committed."""
    with registry.installed():
        scheduler, cluster = _worker(kv_tokens=3_000, reserved_decode_tokens=100, chunked_prefill_size=512)
        _lease(scheduler, ttl_s=100.0)
        reqs = [_req("b1", 1_600, 50, borrowed=True)] + [
            _req(f"p{i}", 500, 100, borrowed=False) for i in range(1, 5)
        ]
        cluster.run(400, [(0, reqs[0]), *((i, r) for i, r in enumerate(reqs[1:], start=1))])
    return scheduler, reqs


def test_no_decode_is_retracted_for_borrowed_work() -> None:
    scheduler, reqs = _tight_run(_registry())
    assert scheduler.retracted == 0
    assert all(len(r.output_ids) == r.sampling_params.max_new_tokens for r in reqs)
    # the same run without the plugin's KV accounting: PD admissions take the room the chunked
    # borrowed prompt still needs, and decodes are retracted
    unguarded, _ = _tight_run(
        _registry(without=("_allocatable_token_budgets", "_swa_tail_allocatable_token_budget"))
    )
    assert unguarded.retracted > 0


def test_no_borrowed_prompt_starts_without_the_pre_allocation_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler, cluster = _worker(kv_tokens=3_000, reserved_decode_tokens=100, chunked_prefill_size=4_096)
    with _registry().installed():
        _lease(scheduler, ttl_s=100.0)
        pd = [_req(f"p{i}", 500, 100, borrowed=False) for i in range(4)]
        cluster.run(4, [(0, r) for r in pd])  # 4 x 500 allocated, 4 x 100 promised to their decodes
        borrowed = _req("b1", 700, 100, borrowed=True)
        scheduler._add_request_to_queue(borrowed)
        cluster.run(1)
        assert cluster.extend_tokens == [], "700 + 100 does not fit beside 4 x 100 reserved"
        cluster.run(400)
        assert len(borrowed.output_ids) == 100 and scheduler.retracted == 0
    scheduler, cluster = _worker(kv_tokens=3_000, reserved_decode_tokens=100, chunked_prefill_size=4_096)
    monkeypatch.setattr(local_prefill, "prealloc_fits", lambda **_: True)
    with _registry().installed():
        _lease(scheduler, ttl_s=100.0)
        cluster.run(4, [(0, _req(f"p{i}", 500, 100, borrowed=False)) for i in range(4)])
        scheduler._add_request_to_queue(_req("b1", 700, 100, borrowed=True))
        cluster.run(400)
    assert scheduler.retracted > 0, "the rule is what keeps the decodes' reserved tokens"


def test_decode_first_leaves_borrowed_work_queued(installed: sg.HookRegistry) -> None:
    scheduler, cluster = _worker(kv_tokens=20_000, max_running_requests=2)
    _lease(scheduler, ttl_s=100.0)
    cluster.run(6, [(0, _req("p1", 100, 50, borrowed=False)), (0, _req("p2", 100, 50, borrowed=False))])
    borrowed = _req("b1", 300, 5, borrowed=True)
    scheduler._add_request_to_queue(borrowed)
    cluster.run(20)
    assert _node(scheduler).queue == [borrowed] and not borrowed.finished(), "the batch is full: it waits"
    cluster.run(200)
    assert len(borrowed.output_ids) == 5


def test_a_client_abort_takes_a_queued_borrowed_request_off(installed: sg.HookRegistry) -> None:
    scheduler, cluster = _worker(kv_tokens=20_000, max_running_requests=1)
    _lease(scheduler, ttl_s=100.0)
    cluster.run(3, [(0, _req("p1", 100, 50, borrowed=False))])
    borrowed = _req("b1", 300, 5, borrowed=True)
    scheduler._add_request_to_queue(borrowed)
    scheduler.abort_request(sg.AbortReq(rid="b1"))
    assert borrowed.finished() and _node(scheduler).queue == []
    assert _node(scheduler).admission.held().is_zero()


def test_queued_borrowed_work_keeps_the_worker_busy(installed: sg.HookRegistry) -> None:
    scheduler, _ = _worker(kv_tokens=20_000)
    _lease(scheduler)
    assert scheduler.is_fully_idle()
    scheduler._add_request_to_queue(_req("b1", 300, 5, borrowed=True))
    assert not scheduler.is_fully_idle()
    assert scheduler.is_fully_idle(for_health_check=True), "the health check keeps SGLang's answer"


# ---------------------------------------------------------------- state for the lease agent
def test_node_state_reaches_the_lease_agent_through_server_info(installed: sg.HookRegistry) -> None:
    scheduler, cluster = _worker(kv_tokens=20_000, reserved_decode_tokens=64)
    _lease(scheduler, ttl_s=100.0)
    cluster.run(30, [(0, _req("p1", 400, 100, borrowed=False)), (0, _req("p2", 600, 160, borrowed=False))])
    scheduler._add_request_to_queue(_req("b1", 300, 5, borrowed=True))
    state = scheduler.get_internal_state(sg.GetInternalStateReq()).internal_state
    assert state["max_running_requests"] == 8, "SGLang's own state stays"
    (ns,) = wire.node_states_from_server_info({"internal_states": [state]})
    assert ns.node_id == 3 and ns.decode_batch_size == 2
    assert ns.context_tokens_mean == pytest.approx(
        (400 + 600) / 2 + len(scheduler.running_batch.reqs[0].output_ids)
    )
    # How the batch drains: the longest remaining output, and the context-weighted one.
    reqs = scheduler.running_batch.reqs
    ctx = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
    rem = [r.sampling_params.max_new_tokens - len(r.output_ids) for r in reqs]
    assert ns.remaining_output_tokens_max == max(rem)
    assert ns.remaining_output_tokens_context_weighted == pytest.approx(
        sum(c * r for c, r in zip(ctx, rem, strict=True)) / sum(ctx)
    )
    assert ns.borrowed_tasks == 1 and ns.borrowed_prefill_tokens_queued == 300
    assert ns.kv_capacity_tokens == 20_000 and ns.kv_used_tokens == scheduler.allocator.used
    assert ns.recent_step_time_s == pytest.approx(cluster.decode_step_s)
    assert state[wire.INTERNAL_STATE_KEY]["lease"]["budgets"]["kv_tokens"] == LEASE.kv_tokens
    with pytest.raises(ValueError, match="is the Crossflow plugin loaded"):
        wire.node_states_from_server_info({"internal_states": [{"max_running_requests": 8}]})
    # the borrowed requests whose prefill has begun (the router commits their reservations then)
    assert wire.started_borrowed_from_server_info({"internal_states": [state]}) == [], "b1 is queued"
    for _ in range(200):
        if _node(scheduler).started:
            break
        cluster.step()
    state = scheduler.get_internal_state(sg.GetInternalStateReq()).internal_state
    assert wire.started_borrowed_from_server_info({"internal_states": [state, state]}) == ["b1"]
    assert wire.started_borrowed_from_server_info({"internal_states": [{}]}) == [], "an older plugin"
    bad = {"internal_states": [{wire.INTERNAL_STATE_KEY: {wire.STARTED_BORROWED_KEY: [1]}}]}
    with pytest.raises(ValueError, match=r"internal_states\[0\]\.crossflow\.started_borrowed"):
        wire.started_borrowed_from_server_info(bad)


def test_lease_metrics_on_the_workers_registry(installed: sg.HookRegistry) -> None:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    class Metric:
        def __init__(self, name: str, doc: str, labelnames: list[str], **_: object) -> None:
            self.name = name

        def labels(self, **labels: str) -> Metric:
            child = Metric(self.name, "", [])
            child.key = (self.name, tuple(sorted(labels.items())))  # type: ignore[attr-defined]
            return child

        def set(self, value: float) -> None:
            samples[self.key] = value  # type: ignore[attr-defined]

        def inc(self, n: float = 1) -> None:
            samples[self.key] = samples.get(self.key, 0) + n  # type: ignore[attr-defined]

    from serving.sglang_plugin.metrics import PluginMetrics

    scheduler, cluster = _worker(kv_tokens=20_000)
    scheduler.__dict__[NODE_ATTRIBUTE] = local_prefill.LocalPrefill(
        scheduler, PluginConfig(node_id=3), hooks._api(), PluginMetrics(3, Metric, Metric)
    )
    _lease(scheduler, ttl_s=100.0)
    scheduler._add_request_to_queue(_req("b1", 300, 5, borrowed=True))
    cluster.run(20)
    node = (("node_id", "3"),)
    assert samples[("crossflow:lease_budget", (("budget", "prefill_tokens"), *node))] == 2_000_000
    assert samples[("crossflow:lease_rate_tokens_per_s", node)] == pytest.approx(20_000.0)
    assert samples[("crossflow:local_prefill_events", (("event", "admitted"), *node))] == 1
    assert samples[("crossflow:local_prefill_tokens", (("kind", "computed"), *node))] == 300
    assert samples[("crossflow:local_prefill_events", (("event", "finished"), *node))] == 1
    assert samples[("crossflow:local_prefill_started_requests", node)] == 0, "refreshed after it finished"


def test_a_client_abort_of_a_chunked_borrowed_prompt_frees_everything(installed: sg.HookRegistry) -> None:
    scheduler, cluster = _worker(kv_tokens=20_000, chunked_prefill_size=256)
    _lease(scheduler, ttl_s=100.0)
    prompt = _req("b1", 3_000, 5, borrowed=True)
    cluster.run(3, [(0, _req("p1", 200, 100, borrowed=False)), (0, prompt)])
    assert scheduler.chunked_req is prompt
    scheduler.abort_request(sg.AbortReq(rid="b1"))  # SGLang marks it; the next selection aborts it
    cluster.run(2)
    assert prompt.finished() and prompt.output_ids == [] and prompt.kv_tokens == 0
    assert scheduler.chunked_req is None and _node(scheduler).admission.held().is_zero()
    cluster.run(200)
    assert scheduler.allocator.used == 0, "the PD request finished and nothing leaked"


def test_tensor_parallel_ranks_decide_alike_whatever_their_local_clocks() -> None:
    """Every decision reads the clock agreed over the attention TP group (``agree_min_ns``); two ranks
    whose own clocks disagree by seconds build the same batches."""
    runs = []
    for skew_ns in (0, 7_000_000_000):
        with _registry().installed():
            scheduler, cluster = _worker(kv_tokens=20_000, chunked_prefill_size=512)
            api = SGLangApi(
                prepare_abort=sg.prepare_abort,
                finish_abort=sg.FINISH_ABORT,
                agree_min_ns=lambda _scheduler, ns, skew=skew_ns: ns - skew,  # the group's minimum
                monotonic_ns=lambda c=cluster, skew=skew_ns: c.monotonic_ns() + skew,
            )
            hooks.configure(api, PluginConfig(node_id=3), sg.SetInternalStateReqOutput)
            _lease(scheduler, ttl_s=2.0)
            reqs = [_req("b1", 1_500, 20, borrowed=True), _req("p1", 300, 30, borrowed=False)]
            cluster.run(100, [(0, reqs[0]), (2, reqs[1])])
            runs.append((cluster.extend_tokens, [len(r.output_ids) for r in reqs]))
    assert runs[0] == runs[1] and runs[0][0]


def test_recent_step_times_are_over_the_trailing_window_whenever_they_are_read() -> None:
    """``NodeState.recent_step_time_s`` is the mean time between the running batch's tokens over the
    steps that ended in the last ``CROSSFLOW_STEP_WINDOW_S`` (what a simulator tick averages over
    the interval ending at it): reading it resets nothing, a local EXTEND step's time counts in the
    next token's step, and the decode-only mean takes pure decode steps alone."""
    ms = 1_000_000
    stats = local_prefill._StepStats(window_ns=500 * ms)
    stats.record(0, None)
    t = 0
    for _ in range(10):  # ten 20 ms decode steps, ending at 20 .. 200 ms
        t += 20 * ms
        stats.record(t, "decode", 4)
    assert stats.recent(t) == pytest.approx((0.02, 0.02))
    assert stats.recent(t) == pytest.approx((0.02, 0.02)), "reading resets nothing"
    t += 60 * ms
    stats.record(t, "extend", local=True)  # a 60 ms local EXTEND step: no token
    t += 20 * ms
    stats.record(t, "decode", 4)  # its token waited 80 ms
    assert stats.recent(t) == pytest.approx(((200 + 80) * 1e-3 / 11, (200 + 20) * 1e-3 / 11))
    # 400 ms later the window (500 ms) holds the steps that ended after 280 - 100 = 180 ms
    assert stats.recent(t + 400 * ms) == pytest.approx(((20 + 80) * 1e-3 / 2, 0.02))
    assert stats.recent(t + 10**9) == (0.0, 0.0), "no step in the window"
    assert PluginConfig.from_env({"CROSSFLOW_STEP_WINDOW_S": "0.25"}).step_window_s == 0.25
    with pytest.raises(ValueError, match="CROSSFLOW_STEP_WINDOW_S"):
        PluginConfig(step_window_s=0.0)

"""Each peer's decisions on hand-built requests and node states, checked against its stated rule."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from envs.cluster_config import ClusterConfig
from envs.estimator import ClusterEstimator
from policies.catalog import make_scheduler, policy_spec
from policies.context import PolicyContext
from policies.ledger import LeaseLedger
from policies.node_state import NodeState
from policies.path import PathDecision, PathPolicy, PathQuery, PathReason, normal_path_estimate_s
from policies.peers.deflect import Deflect
from tests.fakes import LinearCostModel

CFG = ClusterConfig(n_prefill=1, n_decode=2, prefill_chunk_tokens=4096, slo_tpot_s=0.05)
COST = ClusterEstimator(
    CFG, LinearCostModel(base_s=0.01, per_prefill_token_s=1e-5, per_decode_request_s=1e-4)
)
LEDGER = LeaseLedger()


def path_policy(name: str, **params: Any) -> PathPolicy:
    sched = make_scheduler(name, PolicyContext(COST, CFG), {f"path.{k}": v for k, v in params.items()})
    assert sched is not None
    return sched.path


def query(
    input_tokens: int = 1000,
    *,
    decode_cached: int = 0,
    queued_tokens: int = 0,
    kv_load: int | None = 0,
    kv_capacity: int = 100_000,
    request_id: int = 0,
    wait_s: float = 0.0,
) -> PathQuery:
    return PathQuery(
        request_id=request_id,
        session_id=0,
        input_tokens=input_tokens,
        expected_output_tokens=100,
        normal_uncached_tokens=input_tokens,
        normal_queue_wait_s=wait_s,
        normal_prefill_worker=0,
        decode_cached_tokens={1: decode_cached},
        normal_decode_worker=1,
        normal_queued_tokens=queued_tokens,
        decode_kv_load_tokens={} if kv_load is None else {1: kv_load},
        decode_kv_capacity_tokens=kv_capacity,
    )


def decide(policy: PathPolicy, q: PathQuery) -> PathDecision:
    return policy.choose(q, 0.0, LEDGER)


# ---- Dynamo ----------------------------------------------------------------------------------------
def test_dynamo_isl_bounding_is_strict_in_tokens_and_share() -> None:
    isl = path_policy("dynamo-isl", decode_busy_threshold=None)
    # Dynamo's own example: 1000-token prompt, 896 cached -> eff_isl 104, share 0.104: local
    d = decide(isl, query(1000, decode_cached=896))
    assert (d.path, d.node_id, d.code, d.reservation_id) == ("local", 1, PathReason.RULE_LOCAL, None)
    assert decide(isl, query(200)).path == "normal"  # nothing cached: share 1.0 >= 0.7
    assert decide(isl, query(10_000, decode_cached=7_952)).path == "normal"  # eff_isl 2048 is not < 2048
    assert decide(isl, query(10_000, decode_cached=7_953)).path == "local"  # 2047, share 0.2047
    assert decide(isl, query(1000, decode_cached=300)).path == "normal"  # eff 700, share 0.7 is not < 0.7
    assert decide(isl, query(1000, decode_cached=301, queued_tokens=10**9)).path == "local"  # load ignored
    assert isl.local_chunk_tokens(1) == 1024 and isl.uses_gateway_decode_pick and not isl.uses_leases


def test_dynamo_prefill_load_uses_the_busy_line_in_batched_tokens() -> None:
    load = path_policy("dynamo-load", prefill_busy_threshold=4.0, decode_busy_threshold=None)
    busy = 4 * CFG.prefill_chunk_tokens
    assert decide(load, query(queued_tokens=busy)).path == "normal"  # not strictly over the line
    assert decide(load, query(queued_tokens=busy + 1)).path == "local"
    assert decide(load, query(1000, decode_cached=999)).path == "normal"  # the ISL rule is not consulted


def test_dynamo_isl_or_load_takes_either() -> None:
    either = path_policy("dynamo-isl-or-load", prefill_busy_threshold=4.0, decode_busy_threshold=None)
    assert decide(either, query(1000, decode_cached=896)).path == "local"
    assert decide(either, query(queued_tokens=4 * 4096 + 1)).path == "local"
    assert decide(either, query(queued_tokens=10)).path == "normal"


def test_dynamo_decode_busy_guard_vetoes_and_falls_back_when_load_is_unknown() -> None:
    guarded = path_policy("dynamo-load", prefill_busy_threshold=0.0, decode_busy_threshold=0.5)
    # projected = router-side load + this request's uncached tokens, against 0.5 x capacity
    assert decide(guarded, query(1000, queued_tokens=1, kv_load=49_000)).path == "local"  # 50_000
    d = decide(guarded, query(1000, queued_tokens=1, kv_load=49_001))
    assert d.path == "normal" and d.code == PathReason.DECODE_BUSY and "projected KV 50001" in d.reason
    unknown = decide(guarded, query(1000, queued_tokens=1, kv_load=None))
    assert unknown.path == "normal" and unknown.code == PathReason.DECODE_UNKNOWN
    no_capacity = decide(guarded, query(1000, queued_tokens=1, kv_capacity=0))
    assert no_capacity.code == PathReason.DECODE_UNKNOWN
    # the guard is consulted only once the rule says local
    assert decide(guarded, query(queued_tokens=0, kv_load=None)).code == PathReason.RULE_NORMAL


def test_dynamo_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="eff_isl_ratio_threshold"):
        path_policy("dynamo-isl", eff_isl_ratio_threshold=1.5)
    with pytest.raises(ValueError, match="local_chunk_tokens"):
        path_policy("dynamo-isl", local_chunk_tokens=0)
    with pytest.raises(ValueError, match="prefill_busy_threshold"):
        path_policy("dynamo-load", prefill_busy_threshold=-1.0)


# ---- llm-d and TensorRT-LLM -----------------------------------------------------------------------
def test_llmd_prefix_decider_threshold_on_non_cached_tokens() -> None:
    llmd = path_policy("llmd-prefix", non_cached_tokens=1024, local_chunk_tokens=512)
    assert decide(llmd, query(1023)).path == "local"  # short prompt, nothing cached
    assert decide(llmd, query(1024)).path == "normal"  # 1024 is not under 1024
    assert decide(llmd, query(20_000, decode_cached=19_000)).path == "local"  # 1000 non-cached
    assert llmd.local_chunk_tokens(0) == 512
    off = path_policy("llmd-prefix", non_cached_tokens=0)
    assert decide(off, query(10)).path == "normal"  # 0 disables the decider: static PD


def test_trtllm_needs_a_cache_match_and_a_short_residual() -> None:
    trt = path_policy("trtllm-local", max_local_prefill_length=1000)
    assert decide(trt, query(500)).path == "normal"  # no match at all: the context server runs it
    assert decide(trt, query(2000, decode_cached=1000)).path == "local"  # residual 1000 <= 1000
    assert decide(trt, query(2001, decode_cached=1000)).path == "normal"  # residual 1001
    assert policy_spec("trtllm-local").source.startswith("NVIDIA/TensorRT-LLM@")


# ---- deflect ---------------------------------------------------------------------------------------
def state(node_id: int, batch: int, **kw: Any) -> NodeState:
    base = NodeState(
        node_id=node_id,
        time_s=0.0,
        decode_batch_size=batch,
        context_tokens_mean=1000.0,
        context_tokens_std=0.0,
        remaining_output_tokens_mean=50.0,
        kv_capacity_tokens=100_000,
        kv_used_tokens=batch * 1000,
        kv_reserved_tokens=0,
        queued_decode_requests=0,
        borrowed_tasks=0,
        borrowed_prefill_tokens_queued=0,
        recent_step_time_s=0.01,
        decode_only_step_time_s=0.01,
        max_running_requests=256,
    )
    return replace(base, **kw)


def test_deflect_sizes_the_largest_chunk_within_the_itl_slo_by_hand() -> None:
    d = Deflect(COST, CFG, itl_slack=1.0, max_chunk_tokens=8192)
    # step(c) = 0.01 + 1e-5 c + 1e-4 x batch: batch 10 -> c <= (0.05 - 0.011) / 1e-5 = 3900, in 64s: 3840
    chunk, step_s = d.largest_chunk(state(0, 10))
    assert chunk == 3840 and step_s == pytest.approx(0.011 + 0.0384)
    assert d.largest_chunk(state(0, 0)) == (8192, pytest.approx(0.01 + 0.08192))  # idle: the cap
    assert d.largest_chunk(state(0, 400))[0] == 0  # 0.05 s of decode alone: no room for any chunk
    half = Deflect(COST, CFG, itl_slack=0.5)
    assert half.largest_chunk(state(0, 10))[0] == 1344  # (0.025 - 0.011) / 1e-5 = 1400 -> 1344


def test_deflect_keeps_each_batch_s_chunk_and_never_reads_a_state_s_clock() -> None:
    from policies.node_policies import largest_chunk_within
    from policies.path import observes_only_states

    d = Deflect(COST, CFG, itl_slack=1.0, max_chunk_tokens=8192)
    assert observes_only_states(d)  # the simulator may hand an idle node's last state object again
    for batch, context in ((10, 1000.0), (10, 1000.0), (30, 1000.0), (10, 2500.5), (0, 0.0), (400, 1000.0)):
        s = state(0, batch, context_tokens_mean=context)
        want = largest_chunk_within(COST, batch, int(context * batch), d.step_target_s, d.max_chunk_tokens)
        assert d.largest_chunk(s) == want
    d.max_chunk_tokens = 1024  # a kept answer is keyed by the cap and the target too
    assert d.largest_chunk(state(0, 10)) == largest_chunk_within(COST, 10, 10_000, d.step_target_s, 1024)
    d.max_chunk_tokens = 8192
    d.observe(0.0, [state(1, 10), state(0, 30)])
    d.observe(5.0, [replace(state(1, 10), time_s=99.0), state(0, 30)])  # only the clock moved
    assert (d.local_chunk_tokens(0), d.local_chunk_tokens(1)) == (3648, 3840)


def test_deflect_sends_to_the_fastest_node_when_it_beats_the_prefill_path() -> None:
    d = Deflect(COST, CFG, itl_slack=1.0, max_chunk_tokens=8192)
    d.observe(0.0, [state(0, 10), state(1, 30, local_prefill_tokens_queued=2000)])
    step0, step1 = 0.011 + 0.0384, 0.013 + 0.03648  # batch 30: c <= 3700 -> 3648
    assert (d.local_chunk_tokens(0), d.local_chunk_tokens(1)) == (3840, 3648)
    q = query(3840, wait_s=2.0)
    # node 0: 3840 tokens in one iteration; node 1: (2000 + 3840) / 3648 iterations
    dec = decide(d, q)
    assert dec.path == "local" and dec.node_id == 0 and dec.code == PathReason.LOCAL_FASTER
    assert dec.est_borrow_s == pytest.approx(step0)
    assert dec.est_normal_s == pytest.approx(normal_path_estimate_s(COST, q))
    # its own dispatch now queues on node 0 (2 iterations for the next), so the same request goes to
    # node 1: its queue at its rate, then a full 3648-token chunk and a 192-token one
    again = decide(d, q)
    tail_s = 0.01 + 192 * 1e-5 + 30 * 1e-4
    assert again.node_id == 1 and again.est_borrow_s == pytest.approx(2000 / 3648 * step1 + step1 + tail_s)
    # with no queue on the prefill path (0.0484 + 0.005 s) no node is faster (node 0: 2 iterations)
    late = decide(d, query(3840, wait_s=0.0))
    assert late.path == "normal" and late.code == PathReason.LOCAL_NOT_FASTER and late.est_borrow_s is None
    assert d.reconsider(query(3840, wait_s=0.0), 0.0) is None
    assert d.reconsider(query(3840, wait_s=5.0), 0.0) is not None


def test_deflect_skips_nodes_that_cannot_hold_the_request_and_waits_for_state() -> None:
    d = Deflect(COST, CFG)
    assert decide(d, query(wait_s=9.0)).code == PathReason.NO_NODE_STATE
    d.observe(0.0, [state(0, 10, kv_used_tokens=99_500), state(1, 400)])
    # node 0 lacks KV for 1000 + 100 tokens; node 1 has no room in its iterations
    dec = decide(d, query(1000, wait_s=9.0, kv_load=None))
    assert dec.path == "normal" and "no decode node beats" in dec.reason
    q = query(3840, wait_s=0.05)  # local 0.0494 s vs normal 0.05 + 0.0484 + 0.005 s: faster by 52 %
    assert normal_path_estimate_s(COST, q) == pytest.approx(0.1034)
    for margin, path in ((0.5, "local"), (0.6, "normal")):
        d = Deflect(COST, CFG, margin=margin)
        d.observe(0.0, [state(0, 10)])
        assert decide(d, q).path == path


def test_local_prefill_estimate_counts_each_chunks_attention_over_the_prefix() -> None:
    from envs.cost_model import CostModel

    cfg = ClusterConfig()
    cm = CostModel(cfg.gpu, cfg.model, cfg.tp)
    est = ClusterEstimator(cfg, cm)
    tokens, cached, chunk, batch, context = 50_000, 2_000, 2048, 16, 128_000
    by_hand = sum(
        cm.iteration_time_s([(min(chunk, tokens - s), cached + s)], batch, context)
        for s in range(0, tokens, chunk)
    )
    assert est.local_prefill_time_s(tokens, cached, chunk, batch, context) == pytest.approx(by_hand)
    first_chunk_rate = -(-tokens // chunk) * est.mixed_step_time_s(chunk, batch, context)
    assert by_hand > 1.2 * first_chunk_rate  # long prompts: later chunks attend over ever more prefix

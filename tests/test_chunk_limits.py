"""A node policy's per-iteration cap on borrowed prefill, tabulated for nodes that hold no policy."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.admission import LocalPrefillAdmission
from policies.chunk_limits import ChunkLimits, capped_chunk_tokens
from policies.lease import LeaseBudgets


def _policy_chunk(decode_batch: int, decode_context_tokens: int) -> int:
    """A chunk that shrinks with batch and context, like ``largest_chunk_within`` (64-token steps)."""
    step_s = 0.004 + 0.0002 * decode_batch + 2e-8 * decode_context_tokens
    return max(0, int((0.040 - step_s) / 1.5e-5) // 64 * 64)


TABLE = ChunkLimits.build(_policy_chunk, max_batch=256, max_context_tokens=1_000_000)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 256), st.integers(0, 1_000_000))
def test_the_table_never_allows_more_than_the_policy(batch: int, context: int) -> None:
    assert TABLE is not None
    limit = TABLE.limit(batch, context)
    assert limit is not None and 0 <= limit <= _policy_chunk(batch, context)


def test_the_table_is_exact_on_its_grid_and_small_batches_have_their_own_rows() -> None:
    assert TABLE is not None
    assert TABLE.batch_sizes[:16] == tuple(range(1, 17)) and TABLE.batch_sizes[-1] == 256
    assert TABLE.context_tokens[0] == 0 and TABLE.context_tokens[-1] == 1_000_000
    for b in (1, 7, 16, TABLE.batch_sizes[20], 256):
        for ctx in TABLE.context_tokens[::5]:
            assert TABLE.limit(b, ctx) == _policy_chunk(b, ctx)
    # Between grid points it rounds up (the smaller chunk), within one grid step of the exact answer.
    b, ctx = TABLE.batch_sizes[20] + 1, TABLE.context_tokens[10] + 1
    assert TABLE.limit(b, ctx) == _policy_chunk(TABLE.batch_sizes[21], TABLE.context_tokens[11])
    assert TABLE.limit(0, 50_000) is None, "an empty batch has no decode to protect"
    assert TABLE.limit(257, 0) == 0 and TABLE.limit(1, 1_000_001) == 0, "past the range: the smallest"
    assert len(json.dumps(TABLE.to_dict())) < 12_000, "small enough to travel with every lease"


def test_a_policy_without_a_limit_has_no_table() -> None:
    assert ChunkLimits.build(lambda b, c: None, 8, 1000) is None
    with pytest.raises(ValueError, match="max_batch"):
        ChunkLimits.build(_policy_chunk, 0, 1000)


def test_the_wire_form_round_trips_and_bad_tables_name_the_field() -> None:
    assert TABLE is not None
    assert ChunkLimits.from_dict(json.loads(json.dumps(TABLE.to_dict()))) == TABLE
    good = {"batch_sizes": [1, 4], "context_tokens": [0, 100], "chunk_tokens": [[512, 256], [128, 64]]}
    assert ChunkLimits.from_dict(good).limit(3, 50) == 64
    cases = {
        "batch_sizes must be a list of integers": {**good, "batch_sizes": [1, "4"]},
        "strictly increasing": {**good, "batch_sizes": [4, 1]},
        r"chunk_tokens\[1\]: 1 entries for 2": {**good, "chunk_tokens": [[512, 256], [128]]},
        r"chunk_tokens\[0\]\[1\] must be an integer >= 0": {**good, "chunk_tokens": [[512, -1], [1, 1]]},
        "keys must be exactly": {**good, "extra": 1},
        "must be an object": [1, 2],
    }
    for message, data in cases.items():
        with pytest.raises(ValueError, match=f"my lease: .*{message}"):
            ChunkLimits.from_dict(data, source="my lease")


def test_started_work_keeps_its_smallest_chunk_and_no_limit_means_the_cluster_chunk() -> None:
    assert capped_chunk_tokens(None, 8192, 256) == 8192
    assert capped_chunk_tokens(1024, 8192, 256) == 1024
    assert capped_chunk_tokens(0, 8192, 256) == 256
    assert capped_chunk_tokens(20_000, 8192, 256) == 8192


def test_a_node_caps_each_iteration_by_the_table_its_lease_brought() -> None:
    node = LocalPrefillAdmission(node_id=0, burst_s=2.0)
    lease = LeaseBudgets(
        prefill_tokens=80_000, kv_tokens=100_000, transfer_tokens=0, decode_tokens=0, tasks=4
    )
    table = ChunkLimits((1, 8), (0, 100_000), ((4096, 2048), (512, 256)))
    node.install_lease(lease, ttl_s=8.0, now_s=0.0, chunk_limits=table)  # 10_000 tokens/s
    now = 1.0  # 10_000 tokens of credit
    assert node.chunk_tokens(9_000, 8192, 64, now) == 8192, "an empty batch: the cluster's chunk"
    assert node.chunk_tokens(9_000, 8192, 64, now, decode_batch=1, decode_context_tokens=0) == 4096
    assert node.chunk_tokens(9_000, 8192, 64, now, decode_batch=5, decode_context_tokens=50_000) == 256
    assert node.chunk_tokens(9_000, 8192, 64, now, decode_batch=9, decode_context_tokens=0) == 64
    node.revoke(now)
    assert node.chunk_limits is table, "a revocation keeps the cap for started work"
    node.install_lease(lease, ttl_s=8.0, now_s=now)
    assert node.chunk_limits is None
    assert node.chunk_tokens(9_000, 8192, 64, now + 1.0, decode_batch=9, decode_context_tokens=0) == 8192

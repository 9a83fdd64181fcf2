"""A lending node's own admission (``policies.admission.LocalPrefillAdmission``), worked by hand."""

from __future__ import annotations

import pytest

from policies.admission import (
    AdmitResult,
    LocalPrefillAdmission,
    borrowed_demand,
    borrowed_start_blocked,
    min_borrowed_chunk_tokens,
)
from policies.lease import LeaseBudgets

LEASE = LeaseBudgets(prefill_tokens=4_000, kv_tokens=10_000, transfer_tokens=0, decode_tokens=2_000, tasks=2)


def test_demand_counts_the_uncached_prompt_but_always_one_token() -> None:
    d = borrowed_demand(1_000, 200, cached_tokens=300)
    assert d == LeaseBudgets(
        prefill_tokens=700, kv_tokens=1_200, transfer_tokens=0, decode_tokens=200, tasks=1
    )
    assert borrowed_demand(1_000, 10, cached_tokens=600, pull_tokens=400).prefill_tokens == 1
    with pytest.raises(ValueError, match="exceed the prompt"):
        borrowed_demand(100, 10, cached_tokens=80, pull_tokens=30)
    with pytest.raises(ValueError, match=">= 0"):
        borrowed_demand(100, -1)


def test_no_lease_then_admit_until_a_budget_falls_short() -> None:
    a = LocalPrefillAdmission(node_id=3, burst_s=0.5)
    assert a.try_admit(100, 10, 0.0).result is AdmitResult.NO_LEASE
    a.install_lease(LEASE, ttl_s=2.0, now_s=0.0)
    first = a.try_admit(3_000, 500, 0.1)
    assert first.admitted and first.reservation_id is not None
    # 3_000 + 500 of 10_000 KV and 3_000 of 4_000 compute are held: 1_500 prompt tokens need 1_500
    second = a.try_admit(1_500, 100, 0.1)
    assert second.result is AdmitResult.NO_ROOM and second.short == ("prefill_tokens",)
    assert "prefill_tokens 1500 > 1000 left" in second.reason()
    third = a.try_admit(900, 100, 0.1)
    assert third.admitted
    fourth = a.try_admit(10, 10, 0.1)
    assert fourth.short == ("tasks",)  # two task slots, both taken
    assert a.unstarted_kv_tokens() == 3_500 + 1_000
    assert a.unstarted_kv_tokens(exclude=first.reservation_id) == 1_000
    assert a.try_admit(10, 10, 2.0).result is AdmitResult.NO_LEASE  # expired at 0 + 2 s


def test_life_cycle_returns_budgets_as_the_cluster_scheduler_does() -> None:
    a = LocalPrefillAdmission()
    a.install_lease(LEASE, ttl_s=2.0, now_s=0.0)
    rid = a.try_admit(1_000, 200, 0.0).reservation_id
    assert rid is not None and a.is_pending(rid, 0.1)
    assert a.start(rid, 0.1) and not a.is_pending(rid, 0.1)
    assert a.unstarted_kv_tokens() == 0  # started work holds real KV, not lease-reserved KV
    a.prefill_done(rid)
    assert a.held() == LeaseBudgets(kv_tokens=1_200, decode_tokens=200)
    a.finish(rid)
    assert a.held().is_zero()
    a.finish(rid)  # idempotent once released
    other = a.try_admit(100, 0, 0.2).reservation_id
    assert other is not None
    a.cancel(other)
    assert a.held().is_zero()


def test_a_new_lease_revokes_what_no_longer_fits_and_keeps_started_work() -> None:
    a = LocalPrefillAdmission()
    a.install_lease(LEASE, ttl_s=2.0, now_s=0.0)
    started = a.try_admit(2_000, 100, 0.0).reservation_id
    waiting = a.try_admit(1_000, 100, 0.0).reservation_id
    assert started is not None and waiting is not None and a.start(started, 0.0)
    smaller = LeaseBudgets(
        prefill_tokens=2_500, kv_tokens=10_000, transfer_tokens=0, decode_tokens=2_000, tasks=2
    )
    assert a.install_lease(smaller, ttl_s=2.0, now_s=0.5) == [waiting]
    assert not a.is_pending(waiting, 0.5) and a.ledger.status(started) == "committed"
    assert a.revoke(0.6) == []
    assert a.try_admit(10, 10, 0.7).result is AdmitResult.NO_LEASE  # a zero lease is no lease
    assert a.chunk_tokens(1_000, 8_192, 256, 5.0) == 0  # and earns nothing


def test_the_bucket_paces_chunks_at_the_lease_rate() -> None:
    a = LocalPrefillAdmission(burst_s=0.5)
    a.install_lease(LEASE, ttl_s=2.0, now_s=0.0)  # 4_000 tokens over 2 s: 2_000 tokens/s, burst 1_000
    assert min_borrowed_chunk_tokens(a.bucket, 256) == 256
    assert a.chunk_tokens(5_000, 8_192, 256, 0.1) == 0  # 200 tokens of credit: below a page
    assert a.chunk_tokens(5_000, 8_192, 256, 0.2) == 400
    assert a.chunk_tokens(150, 8_192, 256, 0.2) == 150  # a short remainder goes at once
    assert a.chunk_tokens(5_000, 300, 256, 0.2) == 300  # capped by the iteration's chunk size
    a.spend(400, 0.2)
    assert a.chunk_tokens(5_000, 8_192, 256, 0.2) == 0
    assert a.chunk_tokens(5_000, 8_192, 256, 5.0) == 1_000  # never more than the burst
    with pytest.raises(ValueError, match="spending"):
        a.spend(1_001, 5.0)


def test_decode_first_blocks_unstarted_borrowed_work() -> None:
    free = dict(waiting_to_join=0, waiting_for_kv=0, retracted=0, running=3, max_running=4)
    assert borrowed_start_blocked(**free) is None
    assert "retracted" in (borrowed_start_blocked(**{**free, "retracted": 1}) or "")
    assert "join" in (borrowed_start_blocked(**{**free, "waiting_to_join": 2}) or "")
    assert "pre-allocation" in (borrowed_start_blocked(**{**free, "waiting_for_kv": 1}) or "")
    assert "full" in (borrowed_start_blocked(**{**free, "running": 4}) or "")

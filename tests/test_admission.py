"""Node-side admission by hand: the lease's token bucket, the ledger's grant record, decode pre-allocation."""

from __future__ import annotations

import math

import pytest

from policies.admission import LeaseTokenBucket, borrowed_chunk_tokens, prealloc_fits
from policies.lease import LeaseBudgets
from policies.ledger import LeaseLedger


def test_bucket_earns_at_the_lease_rate_carries_fractions_and_caps_at_the_burst() -> None:
    b = LeaseTokenBucket(burst_s=0.5)
    b.set_lease(0.0, rate_tokens_per_s=1000.0, expires_s=10.0)
    assert b.available_tokens(0.0) == 0  # nothing is granted ahead of time
    assert b.available_tokens(0.0105) == 10  # 10.5 tokens: the half carries over
    b.spend(10, 0.0105)
    assert b.credit_tokens == pytest.approx(0.5)
    assert b.available_tokens(0.011) == 1
    assert b.available_tokens(3.0) == 500  # capped at 0.5 s of the rate
    with pytest.raises(ValueError, match="spending 501"):
        b.spend(501, 3.0)


def test_zero_or_expired_lease_earns_nothing_and_drops_saved_credit() -> None:
    b = LeaseTokenBucket(burst_s=1.0)
    b.set_lease(0.0, 100.0, expires_s=2.0)
    assert b.available_tokens(5.0) == 100  # earned 0..1 s up to the cap, nothing after the expiry
    b.set_lease(5.0, 0.0, expires_s=5.0)  # revoked to zero: zero lease, zero borrowed work
    assert b.available_tokens(50.0) == 0
    assert b.seconds_until(1, 50.0) == math.inf


def test_seconds_until_credit() -> None:
    b = LeaseTokenBucket(burst_s=0.5)
    b.set_lease(0.0, 1000.0, expires_s=1.0)
    assert b.seconds_until(256, 0.0) == pytest.approx(0.256)
    assert b.seconds_until(600, 0.0) == math.inf  # more than the bucket can ever hold
    assert b.seconds_until(256, 0.9) == 0.0  # 0.5 s of credit saved by then
    slow = LeaseTokenBucket(burst_s=0.5)
    slow.set_lease(0.7, 100.0, expires_s=1.0)
    assert slow.seconds_until(40, 0.7) == math.inf  # would need until 1.1 s, after the expiry


def test_borrowed_chunk_waits_for_a_useful_chunk_but_takes_a_short_remainder() -> None:
    assert borrowed_chunk_tokens(100, 5000, 256) == 0
    assert borrowed_chunk_tokens(300, 5000, 256) == 300
    assert borrowed_chunk_tokens(300, 120, 256) == 120
    assert borrowed_chunk_tokens(0, 120, 256) == 0


def test_prealloc_reserves_decode_tokens_for_every_active_request_and_lease_kv() -> None:
    # free 10_000; 4 active keep 4 x 512; the new one needs 5_000 + its own 512
    assert prealloc_fits(free_tokens=10_000, active_requests=4, need_tokens=5_000, reserved_decode_tokens=512)
    assert not prealloc_fits(
        free_tokens=10_000, active_requests=4, need_tokens=5_000, reserved_decode_tokens=512,
        lease_reserved_kv_tokens=3_000,
    )  # fmt: skip
    assert not prealloc_fits(
        free_tokens=10_000, active_requests=4, need_tokens=5_000, reserved_decode_tokens=512,
        retracted_tokens=2_500,
    )  # fmt: skip


def test_ledger_records_what_each_lease_granted_until_superseded_or_expired() -> None:
    ledger = LeaseLedger()
    assert ledger.granted_prefill_tokens(0, 5.0) == 0.0
    ledger.publish(0, LeaseBudgets(prefill_tokens=800, tasks=1), now_s=0.0, ttl_s=8.0)  # 100 tok/s
    assert ledger.granted_prefill_tokens(0, 0.5) == pytest.approx(50.0)
    ledger.publish(0, LeaseBudgets(prefill_tokens=1600, tasks=1), now_s=1.0, ttl_s=8.0)  # 200 tok/s
    assert ledger.granted_prefill_tokens(0, 2.0) == pytest.approx(100.0 + 200.0)
    ledger.revoke(0, now_s=3.0)  # zero from 3 s
    assert ledger.granted_prefill_tokens(0, 6.0) == pytest.approx(100.0 + 400.0)
    ledger.publish(0, LeaseBudgets(prefill_tokens=80, tasks=1), now_s=10.0, ttl_s=2.0)  # 40 tok/s to 12 s
    assert ledger.granted_prefill_tokens(0, 20.0) == pytest.approx(500.0 + 80.0)

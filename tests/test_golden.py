"""Speed work must not change results: a fixed set of simulations against their recorded results."""

from __future__ import annotations

import json
import math

import pytest

from tests.golden_runs import GOLDEN_PATH, run_all


@pytest.mark.slow
def test_fixed_runs_reproduce_their_recorded_results() -> None:
    golden = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))
    now = run_all()
    assert sorted(now) == sorted(golden)
    for name, want in golden.items():
        got = now[name]
        for key, value in want["metrics"].items():
            have = got["metrics"][key]
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(have), (name, key)
            else:
                assert have == pytest.approx(value, rel=1e-12, abs=1e-12), (name, key, have, value)
        for key in ("first_token_s_sum", "finish_s_sum", "decode_worker_sum", "prefill_worker_sum"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), (name, key)

"""``serving.replay`` and ``crossflow replay``: prompts keep the trace's prefix sharing, metrics follow
the simulator's definitions, and a replay against the emulated worker on loopback measures what the
cost model says (in emulated time when the server reports its time scale)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from array import array
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")

from envs.arrivals import poisson_session_starts  # noqa: E402
from envs.cost_model import CostModel  # noqa: E402
from envs.metrics import RunMetrics  # noqa: E402
from envs.request import Request, Trace  # noqa: E402
from envs.traces import load_trace, save_bundle  # noqa: E402
from serving.emulated_worker import BackgroundWorker, EmulatedWorker  # noqa: E402
from serving.replay import (  # noqa: E402
    TIME_SCALE_KEY,
    UNOBSERVED_METRICS,
    PromptTokens,
    ReplayConfig,
    Replayer,
    RequestRecord,
    find_time_scale,
    replay,
    replay_metrics,
)

MODEL = ("H200", "gpt-oss-120b", 1)


class ScaledWorker(EmulatedWorker):
    """The emulated worker as the coming PD workers will answer ``/server_info``: with its time scale."""

    def server_info(self) -> dict[str, Any]:
        return {**super().server_info(), TIME_SCALE_KEY: self.time_scale}


def _strict_json(text: str) -> Any:
    def no_constant(name: str) -> Any:
        raise AssertionError(f"JSON holds {name}")

    return json.loads(text, parse_constant=no_constant)


# ---------------------------------------------------------------------------------------------------
# prompts


def test_prompt_tokens_share_exactly_the_trace_prefix() -> None:
    reqs = [
        Request(0, 0, 0, 0.0, 300, 1),
        Request(1, 0, 1, 0.0, 400, 1, parent_id=0, shared_prefix_tokens=250),
        Request(2, 0, 2, 0.0, 500, 1, parent_id=1, shared_prefix_tokens=380),
        Request(3, 1, 0, 0.0, 300, 1),
        Request(4, 1, 1, 0.0, 100, 1, parent_id=2, shared_prefix_tokens=100),  # wholly inside
    ]
    prompts = PromptTokens(reqs, seed=7)
    ids = [prompts.ids(r.request_id) for r in reqs]
    assert [len(x) for x in ids] == [r.input_tokens for r in reqs]
    for r in reqs[1:]:
        if r.parent_id < 0:
            continue
        parent = ids[r.parent_id]
        k = r.shared_prefix_tokens
        assert np.array_equal(ids[r.request_id][:k], parent[:k])
        if k < min(len(parent), r.input_tokens):
            assert ids[r.request_id][k] != parent[k], "sharing must stop where the trace says"
    # transitively: request 2 shares 250 tokens with request 0 through request 1
    assert np.array_equal(ids[2][:250], ids[0][:250])
    # unrelated requests share nothing at the first position (fixed seed: deterministic)
    assert ids[3][0] != ids[0][0]
    assert all(((x >= 100) & (x < 32000)).all() for x in ids)


def test_prompt_tokens_are_deterministic_and_independent_of_the_memo() -> None:
    trace = load_trace("mooncake")
    reqs = trace.requests[:200]
    full = PromptTokens(reqs, seed=3, memo_size=1000)
    tiny = PromptTokens(reqs, seed=3, memo_size=1)
    reverse = [tiny.ids(i) for i in reversed(range(len(reqs)))][::-1]
    for i, r in enumerate(reqs):
        a = full.ids(i)
        assert np.array_equal(a, reverse[i])
        if r.parent_id >= 0:
            assert np.array_equal(
                a[: r.shared_prefix_tokens], full.ids(r.parent_id)[: r.shared_prefix_tokens]
            )
    other_seed = PromptTokens(reqs, seed=4)
    assert not np.array_equal(other_seed.ids(0), full.ids(0))
    assert any(r.parent_id >= 0 and r.shared_prefix_tokens > 0 for r in reqs), "fixture needs sharing"


def test_request_body_asks_for_exactly_the_trace_output() -> None:
    reqs = [Request(0, -1, 0, 0.0, 50, 17)]
    replayer = Replayer(Trace("t", reqs), ReplayConfig(url="http://127.0.0.1:1", seed=5))
    body = json.loads(replayer._body(reqs[0]))
    assert body["input_ids"] == PromptTokens(reqs, seed=5).ids(0).tolist()
    assert body["sampling_params"]["max_new_tokens"] == 17
    assert body["sampling_params"]["ignore_eos"] is True
    assert body["stream"] is True


# ---------------------------------------------------------------------------------------------------
# metrics


def _record(rid: int, send: float, first: float, itl: list[float], inp: int = 100) -> RequestRecord:
    out = len(itl) + 1
    finish = first + sum(itl)
    return RequestRecord(
        rid, -1, inp, out, send, first, finish, completion_tokens=out, itl_s=array("d", itl), status=200
    )


def test_replay_metrics_by_hand() -> None:
    records = [
        _record(0, 0.0, 0.5, [0.01, 0.03]),  # ttft 0.5, e2e 0.54
        _record(1, 1.0, 1.2, [0.02]),  # ttft 0.2, e2e 0.22, ends at 1.22
        RequestRecord(2, -1, 100, 5, 1.1, None, None, status=400, rejected=True, error="HTTP 400"),
        RequestRecord(3, -1, 100, 5),  # never sent
    ]
    m = replay_metrics(records, 4, slo_ttft_s=0.3, slo_tpot_s=0.05)
    assert list(m) == [f.name for f in fields(RunMetrics)]
    assert (m["n_requests"], m["n_finished"], m["n_rejected"]) == (4, 2, 1)
    assert m["duration_s"] == pytest.approx(1.22)
    assert m["input_tokens_per_s"] == pytest.approx(200 / 1.22)
    assert m["output_tokens_per_s"] == pytest.approx(5 / 1.22)
    assert m["ttft_mean_s"] == pytest.approx(0.35)
    assert m["itl_mean_s"] == pytest.approx(0.02)
    assert m["itl_p50_s"] == pytest.approx(0.02) and m["itl_p99_s"] == pytest.approx(0.03)
    assert m["e2e_mean_s"] == pytest.approx(0.38)
    assert m["slo_attainment"] == pytest.approx(1 / 3)  # request 1 only; the refused one is a miss
    assert m["prefix_hit_share"] is None  # the server reported no cached tokens
    for key in UNOBSERVED_METRICS:
        assert m[key] is None
    scaled = replay_metrics(records, 4, time_scale=2.0, slo_ttft_s=0.3, slo_tpot_s=0.05)
    assert scaled["ttft_mean_s"] == pytest.approx(0.175)
    assert scaled["input_tokens_per_s"] == pytest.approx(2 * 200 / 1.22)
    assert scaled["slo_attainment"] == pytest.approx(2 / 3)  # in emulated time request 0 meets 0.3 s


def test_replay_metrics_without_a_finished_request_are_null_not_nan() -> None:
    records = [RequestRecord(0, -1, 10, 5, 0.0, error="ConnectError: refused")]
    m = replay_metrics(records, 1)
    assert m["n_finished"] == 0
    text = json.dumps(m)
    _strict_json(text)
    assert m["ttft_mean_s"] is None and m["duration_s"] is None
    assert m["slo_attainment"] == 0.0  # the one request did not finish: a miss


def test_find_time_scale() -> None:
    assert find_time_scale({"model_path": "m"}) is None
    assert find_time_scale({TIME_SCALE_KEY: 4}) == 4.0
    nested = {"workers": [{"server_info": {TIME_SCALE_KEY: 2.5}}, {"server_info": None}]}
    assert find_time_scale(nested) == 2.5
    with pytest.raises(ValueError, match="different"):
        find_time_scale({"workers": [{TIME_SCALE_KEY: 1.0}, {TIME_SCALE_KEY: 2.0}]})
    with pytest.raises(ValueError, match="positive"):
        find_time_scale({TIME_SCALE_KEY: 0})


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="load"):
        ReplayConfig(url="http://127.0.0.1:1", load=0)
    with pytest.raises(ValueError, match="url"):
        ReplayConfig(url="127.0.0.1:1")
    with pytest.raises(ValueError, match="closed-loop"):
        Replayer(Trace("s", [Request(0, 0, 0, 0.0, 5, 5)], closed_loop=True), ReplayConfig(url="http://x"))


# ---------------------------------------------------------------------------------------------------
# stream parsing (a scripted server)


def _sse(*events: dict[str, Any] | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def test_stream_parsing_counts_tokens_from_meta_info_and_reads_aborts_and_cached_tokens() -> None:
    def meta(n: int, finish: Any = None, cached: int = 30) -> dict[str, Any]:
        return {"completion_tokens": n, "finish_reason": finish, "cached_tokens": cached}

    ok_events = [
        {"text": "", "meta_info": meta(1)},  # a token whose text is empty still counts
        {"text": "a b c", "meta_info": meta(4)},  # three tokens in one event: three ITL entries
        {"text": "a b c", "meta_info": meta(4)},  # no new token: no interval
        {"text": "d", "meta_info": meta(5, {"type": "length", "length": 5})},
        "[DONE]",
    ]

    async def ok() -> Any:
        for i, event in enumerate(ok_events):
            if 0 < i < 4:
                await asyncio.sleep(0.3)
            yield _sse(event)

    aborted = _sse(
        {"text": "", "meta_info": meta(0, {"type": "abort", "status_code": 503, "message": "no lease"})},
        "[DONE]",
    )
    error_event = _sse(
        {"error": {"message": "bad input", "type": "invalid_request_error", "code": 400}}, "[DONE]"
    )
    by_input_tokens = {
        100: (200, None),
        101: (200, aborted),
        102: (503, b'{"error": "busy"}'),
        103: (200, error_event),
    }

    def handler(request: Any) -> Any:
        if request.url.path != "/generate":
            return httpx.Response(404)
        status, body = by_input_tokens[len(json.loads(request.content)["input_ids"])]
        return httpx.Response(status, content=ok() if body is None else body)

    reqs = [Request(i, -1, 0, 0.0, 100 + i, 5) for i in range(4)]
    replayer = Replayer(
        Trace("t", reqs), ReplayConfig(url="http://127.0.0.1:1"), transport=httpx.MockTransport(handler)
    )
    result = asyncio.run(replayer.run())
    first, second, third, fourth = result.records
    assert first.finished and first.completion_tokens == 5 and len(first.itl_s) == 4
    # one gap split three ways (exactly equal), of about the 0.3 s slept (more on a loaded machine)
    assert first.itl_s[0] == first.itl_s[1] == first.itl_s[2] and 0.29 <= 3 * first.itl_s[0] < 1.0
    # the event without a new token does not cut the next interval short (bench_serving's rule)
    assert 0.59 <= first.itl_s[3] < 1.5 and first.itl_s[3] > 1.5 * (3 * first.itl_s[0])
    assert first.cached_tokens == 30
    assert second.rejected and second.status == 503 and "no lease" in second.error
    assert third.rejected and third.status == 503
    assert fourth.rejected and fourth.status == 400 and "bad input" in fourth.error
    assert result.metrics["n_rejected"] == 3 and result.metrics["n_finished"] == 1
    assert result.metrics["prefix_hit_share"] == pytest.approx(30 / 100)
    assert result.time_scale_source == "default"


# ---------------------------------------------------------------------------------------------------
# against the emulated worker on loopback


def test_single_request_times_match_the_cost_model_in_emulated_time() -> None:
    cm = CostModel(*MODEL)
    # a slow emulation (8x) keeps the event loop's own latency small against each emulated step
    n_in, n_out, scale = 2000, 40, 8.0
    prefill_s = cm.iteration_time_s([(n_in, 0)], 0, 0)
    decode_s = cm.iteration_time_s([], 1, n_in + n_out // 2)
    trace = Trace("one", [Request(0, -1, 0, 0.0, n_in, n_out)])
    with BackgroundWorker(ScaledWorker(cm, time_scale=scale)) as worker:
        result = replay(trace, ReplayConfig(url=worker.url, timeout_s=30))
        assert worker.stats.finished == 1
    assert result.time_scale == scale and result.time_scale_source == "server_info"
    m = result.metrics
    assert m["n_finished"] == 1
    assert result.records[0].completion_tokens == n_out
    assert m["ttft_mean_s"] == pytest.approx(prefill_s, rel=0.3, abs=0.003)
    assert m["itl_mean_s"] == pytest.approx(decode_s, rel=0.3, abs=0.001)
    assert m["e2e_mean_s"] == pytest.approx(prefill_s + (n_out - 1) * decode_s, rel=0.3)
    assert m["output_tokens_per_s"] == pytest.approx(n_out / m["e2e_mean_s"], rel=0.05)


def test_without_a_reported_scale_times_stay_wall_times() -> None:
    cm = CostModel(*MODEL)
    decode_s = cm.iteration_time_s([], 1, 1020)
    trace = Trace("one", [Request(0, -1, 0, 0.0, 1000, 40)])
    with BackgroundWorker(EmulatedWorker(cm, time_scale=8.0)) as worker:  # reports no crossflow scale
        result = replay(trace, ReplayConfig(url=worker.url, timeout_s=30))
        forced = replay(trace, ReplayConfig(url=worker.url, timeout_s=30, time_scale=8.0))
    assert result.time_scale_source == "default"
    assert result.metrics["itl_mean_s"] == pytest.approx(8 * decode_s, rel=0.3)
    assert forced.time_scale_source == "argument"
    assert forced.metrics["itl_mean_s"] == pytest.approx(decode_s, rel=0.3)


def test_open_loop_keeps_timestamps_scaled_by_load() -> None:
    arrivals = [0.0, 0.3, 0.6, 0.9]
    trace = Trace("open", [Request(i, -1, 0, 5.0 + t, 200, 4) for i, t in enumerate(arrivals)])
    cm = CostModel(*MODEL)
    with BackgroundWorker(EmulatedWorker(cm)) as worker:
        at_1 = replay(trace, ReplayConfig(url=worker.url, timeout_s=30))
        at_2 = replay(trace, ReplayConfig(url=worker.url, load=2.0, timeout_s=30))
    for result, load in ((at_1, 1.0), (at_2, 2.0)):
        sends = np.array([r.send_s for r in result.records])
        assert np.allclose(sends - sends[0], np.array(arrivals) / load, atol=0.05)
        assert result.metrics["n_finished"] == 4
        assert all(r.completion_tokens == 4 for r in result.records)


def _session_trace() -> Trace:
    reqs = [
        Request(0, 0, 0, 0.0, 300, 3, think_time_s=0.0),
        Request(1, 0, 1, 0.0, 400, 3, parent_id=0, shared_prefix_tokens=300, depends_on=0, think_time_s=0.2),
        Request(2, 0, 2, 0.0, 500, 3, parent_id=1, shared_prefix_tokens=400, depends_on=1, think_time_s=0.1),
        Request(3, 1, 0, 0.0, 300, 3),
        Request(4, 1, 1, 0.0, 300, 3, depends_on=3, think_time_s=0.1),
        Request(5, 1, 2, 0.0, 300, 3, depends_on=3, think_time_s=0.3),  # a sub-agent: same parent
    ]
    return Trace("sessions", reqs, closed_loop=True)


def test_closed_loop_releases_after_the_dependency_and_its_think_time() -> None:
    trace = _session_trace()
    with BackgroundWorker(EmulatedWorker(CostModel(*MODEL))) as worker:
        result = replay(trace, ReplayConfig(url=worker.url, session_rate_per_s=20.0, seed=1, timeout_s=30))
    rec = result.records
    assert result.metrics["n_finished"] == 6
    for r in trace.requests:
        if r.depends_on >= 0:
            parent = rec[r.depends_on]
            assert parent.finish_s is not None and rec[r.request_id].send_s is not None
            gap = rec[r.request_id].send_s - parent.finish_s
            assert r.think_time_s - 0.005 <= gap <= r.think_time_s + 0.1
    starts = poisson_session_starts(2, 20.0, np.random.default_rng(1))  # the simulator's draw
    assert rec[3].send_s - rec[0].send_s == pytest.approx(starts[1] - starts[0], abs=0.05)


def test_closed_loop_request_budget_and_time_limit_bound_the_replay() -> None:
    trace = _session_trace()
    cm = CostModel(*MODEL)
    with BackgroundWorker(EmulatedWorker(cm)) as worker:
        capped = replay(trace, ReplayConfig(url=worker.url, session_rate_per_s=20.0, max_requests=3))
        assert sum(r.send_s is not None for r in capped.records) == 3
        assert capped.metrics["n_requests"] == 3 and capped.metrics["n_finished"] == 3
        long = Trace("long", [Request(0, -1, 0, 0.0, 100, 100_000), Request(1, -1, 0, 0.0, 100, 3)])
        t0 = time.perf_counter()
        cut = replay(long, ReplayConfig(url=worker.url, timeout_s=0.5))
        assert time.perf_counter() - t0 < 3.0
        assert cut.timed_out and cut.metrics["n_finished"] == 1
        assert "time limit" in cut.records[0].error
        deadline = time.monotonic() + 5
        while worker.stats.aborted < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.stats.aborted == 1, "the cancelled stream is closed, so the worker aborts it"


def test_a_refused_request_counts_as_rejected() -> None:
    cm = CostModel(*MODEL)
    too_big = cm.kv_capacity_tokens + 1
    trace = Trace("big", [Request(0, -1, 0, 0.0, too_big, 2), Request(1, -1, 0, 0.0, 10, 2)])
    with BackgroundWorker(EmulatedWorker(cm)) as worker:
        result = replay(trace, ReplayConfig(url=worker.url, timeout_s=60))
    assert result.records[0].rejected and result.records[0].status == 400
    assert result.metrics["n_rejected"] == 1 and result.metrics["n_finished"] == 1


# ---------------------------------------------------------------------------------------------------
# the command


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "train.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _labels(stdout: str) -> list[str]:
    return [line.strip().split("  ")[0] for line in stdout.splitlines()[1:] if line.startswith("  ")]


@pytest.mark.slow
def test_replay_command_prints_simulates_table_and_writes_json(tmp_path: Path) -> None:
    bundle = tmp_path / "tiny.csv.gz"
    save_bundle(Trace("tiny", [Request(i, -1, 0, 0.1 * i, 500, 6) for i in range(4)], source="test"), bundle)
    out = tmp_path / "replay.json"
    with BackgroundWorker(ScaledWorker(CostModel(*MODEL), time_scale=1.5)) as worker:
        run = _cli("replay", "--url", worker.url, "--trace", str(bundle), "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "emulated time (x1.5)" in run.stdout
    sim = _cli("simulate", "--trace", str(bundle), "--no-progress")
    assert sim.returncode == 0, sim.stderr
    replay_labels, sim_labels = _labels(run.stdout), _labels(sim.stdout)
    renamed = {
        "rejected (refused by the server)": "rejected (beyond context or KV)",
        "duration": "simulated duration",
    }
    node_labels = ["busy share prefill", "busy share decode"]  # only the simulator knows its workers
    assert [renamed.get(label, label) for label in replay_labels] + node_labels == sim_labels
    assert "requests finished" in run.stdout and "4 / 4" in run.stdout
    payload = _strict_json(out.read_text())
    assert list(payload["metrics"]) == [f.name for f in fields(RunMetrics)]
    assert payload["time_scale"] == 1.5 and payload["time_scale_source"] == "server_info"
    assert payload["metrics"]["borrowed_share"] is None
    assert payload["metrics"]["n_finished"] == 4
    assert len(payload["requests"]) == 4 and all(r["completion_tokens"] == 6 for r in payload["requests"])
    assert not math.isnan(payload["metrics"]["ttft_mean_s"])


def test_replay_command_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from train.cli import main

    def error(*args: str) -> str:
        assert main(["replay", "--url", "http://127.0.0.1:9", *args]) == 2
        return capsys.readouterr().err

    assert "cannot reach http://127.0.0.1:9/server_info" in error(
        "--trace", "mooncake", "--max-requests", "1"
    )
    assert "--max-sessions applies to closed-loop traces" in error(
        "--trace", "mooncake", "--max-sessions", "2"
    )
    assert "missing.jsonl" in error("--trace", str(tmp_path / "missing.jsonl"))
    assert "--max-requests must be >= 1" in error("--trace", "mooncake", "--max-requests", "0")

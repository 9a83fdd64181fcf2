"""The emulated PD workers speak SGLang's protocol (``serving.pd_cluster``): the bootstrap server's routes,
both legs of a dual dispatch paired by room, the prefill-only role, refusals SGLang makes, the
decode worker's local prefill on a lease, and the status, load and metrics endpoints. A test plays
the router here (the real gateways are in ``test_serving_gateways_pd.py``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from envs.cluster_config import ClusterConfig  # noqa: E402
from envs.cost_model import CostModel  # noqa: E402
from envs.live import LiveCluster  # noqa: E402
from serving.http import HttpServer  # noqa: E402
from serving.pd_cluster import (  # noqa: E402
    BackgroundCluster,
    BootstrapServer,
    EmulatedCluster,
    parse_generation,
    text_token_ids,
)
from serving.replay import LAG_KEY, LAG_SINCE_PARAM, TIME_SCALE_KEY  # noqa: E402
from train.experiment import build_scheduler  # noqa: E402

MODEL = ("H200", "gpt-oss-120b", 1)
SCALE = 4.0


def _live(config: ClusterConfig, **kwargs: Any) -> LiveCluster:
    return LiveCluster(config, cost_model=CostModel(*MODEL), time_scale=SCALE, **kwargs)


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    config = ClusterConfig(n_prefill=2, n_decode=1)
    with BackgroundCluster(EmulatedCluster(_live(config))) as c:
        yield c


def _client() -> Any:
    return httpx.Client(trust_env=False, timeout=30.0)


def _events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_streamed(events: list[Any], n_out: int) -> None:
    """A stream carries cumulative counts that rise to ``n_out``. An event holds every token made since
    the last one was written, so a busy event loop may merge some."""
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts[-1] == n_out and all(b > a for a, b in itertools.pairwise(counts)), counts
    assert len(counts) >= max(2, n_out // 4), f"tokens streamed, not sent at the end: {counts}"


def _legs(cluster: EmulatedCluster, room: int, prefill: int = 0, **body: Any) -> tuple[dict[str, Any], ...]:
    """The two bodies a PD router sends for one request: the client's, plus the bootstrap fields."""
    bootstrap = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.prefill[prefill].bootstrap_port,
        "bootstrap_room": room,
    }
    return {**body, **bootstrap}, {**body, **bootstrap}


async def _dual_dispatch(
    p_url: str, d_url: str, p_body: dict[str, Any], d_body: dict[str, Any], path: str = "/generate"
) -> tuple[tuple[int, str, float], tuple[int, str, float, float]]:
    """Post both legs at once, as smg does; returns (status, body, answer time) of the prefill leg and
    (status, body, first byte time, answer time) of the decode leg, times from sending."""
    async with httpx.AsyncClient(trust_env=False, timeout=60.0) as client:
        t0 = time.perf_counter()

        async def prefill() -> tuple[int, str, float]:
            resp = await client.post(f"{p_url}{path}", json=p_body)
            return resp.status_code, resp.text, time.perf_counter() - t0

        async def decode() -> tuple[int, str, float, float]:
            first = 0.0
            chunks: list[str] = []
            async with client.stream("POST", f"{d_url}{path}", json=d_body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and not first:
                        first = time.perf_counter() - t0
                    chunks.append(line)
            return resp.status_code, "\n".join(chunks), first, time.perf_counter() - t0

        p, d = await asyncio.gather(prefill(), decode())
    return p, d


# ---------------------------------------------------------------------------------------------------
# the bootstrap server


def test_bootstrap_server_routes_follow_sglang() -> None:
    async def run() -> list[tuple[int, str]]:
        server = BootstrapServer()
        await server.http.start()
        base = server.http.url
        ranks = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
        one = {"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}
        register = {
            "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
            "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": "127.0.0.1", "rank_port": 4242, "page_size": 64, "kv_cache_dtype": "bf16",
            "prefill_http_port": 30001,
        }  # fmt: skip
        out = []
        async with httpx.AsyncClient(trust_env=False) as c:
            for call in (
                c.get(f"{base}/health"),
                c.get(f"{base}/route", params=ranks),  # nothing registered yet
                c.get(f"{base}/route", params={"prefill_dp_rank": -1}),
                c.put(f"{base}/route", json={"rank_ip": "127.0.0.1"}),
                c.put(f"{base}/route", json=register),
                c.get(f"{base}/route", params=ranks),
                c.get(f"{base}/route", params=one),
                c.get(f"{base}/route", params={**one, "target_tp_rank": 3}),
                c.post(f"{base}/route"),
                c.post(f"{base}/register_dp_rank", json={"bootstrap_room": 77, "dp_rank": 0}),
                c.post(f"{base}/query_dp_ranks", json={"bootstrap_rooms": [77, 78]}),
            ):
                resp = await call
                out.append((resp.status_code, resp.text))
        await server.http.stop()
        return out

    answers = asyncio.run(run())
    assert answers[0] == (200, "OK")
    assert answers[1][0] == 503 and "not fully registered" in answers[1][1]
    assert answers[2] == (400, "Missing inputs for bootstrap server.")
    assert answers[3][0] == 400 and "attn_tp_size" in answers[3][1]
    assert answers[4] == (200, "OK")
    info = json.loads(answers[5][1])
    assert answers[5][0] == 200 and info["prefill_http_port"] == 30001 and info["page_size"] == 64
    assert info["follow_bootstrap_room"] is True and info["dp_size"] == info["attn_tp_size"] == 1
    assert json.loads(answers[6][1]) == {"rank_ip": "127.0.0.1", "rank_port": 4242}
    assert answers[7][0] == 404
    assert answers[8][0] == 405
    assert answers[9] == (200, "OK") and json.loads(answers[10][1]) == {"77": 0}


def test_prefill_workers_register_with_their_bootstrap_server(cluster: EmulatedCluster) -> None:
    with _client() as c:
        for w in cluster.prefill:
            info = c.get(
                f"http://127.0.0.1:{w.bootstrap_port}/route",
                params={
                    "prefill_dp_rank": -1,
                    "prefill_cp_rank": -1,
                    "target_tp_rank": -1,
                    "target_pp_rank": -1,
                },
            ).json()
            assert info["prefill_http_port"] == w.http.port
            server = c.get(f"{w.url}/server_info").json()
            assert server["disaggregation_mode"] == "prefill"
            assert server["disaggregation_bootstrap_port"] == w.bootstrap_port
        decode = c.get(f"{cluster.decode_urls[0]}/server_info").json()
        assert decode["disaggregation_mode"] == "decode" and "disaggregation_bootstrap_port" not in decode


# ---------------------------------------------------------------------------------------------------
# the PD protocol


def test_a_dual_dispatch_streams_the_first_token_after_prefill_and_transfer(cluster: EmulatedCluster) -> None:
    n_in, n_out = 6000, 40
    body = {"input_ids": list(range(100, 100 + n_in)), "sampling_params": {"max_new_tokens": n_out}}
    p_body, d_body = _legs(cluster, room=11, stream=True, **body)
    (p_status, p_text, p_done_s), (d_status, d_text, first_s, d_done_s) = asyncio.run(
        _dual_dispatch(cluster.prefill_urls[0], cluster.decode_urls[0], p_body, d_body)
    )
    assert p_status == d_status == 200
    p_events = _events(p_text)
    assert p_events[-1] == "[DONE]" and len(p_events) == 2, "the prefill leg answers once"
    p_meta = p_events[0]["meta_info"]
    assert p_meta["finish_reason"] == {"type": "length", "length": 0} and p_meta["completion_tokens"] == 1
    d_events = [e for e in _events(d_text) if e != "[DONE]"]
    _assert_streamed(d_events, n_out)
    assert d_events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": n_out}
    assert d_events[-1]["text"] == " tok" * n_out, "SGLang's /generate stream is cumulative"
    cm = CostModel(*MODEL)
    prefill_s = cm.iteration_time_s([(n_in, 0)], 0, 0)
    decode_s = cm.iteration_time_s([], 1, n_in + n_out // 2)
    # in emulated time: the first byte comes after the prefill (and the KV transfer), not after the
    # whole generation; the prefill leg is answered when the KV has landed, before that first token
    assert prefill_s <= first_s / SCALE < prefill_s + 10 * decode_s
    assert p_done_s <= first_s + 0.05 * SCALE
    assert d_done_s / SCALE == pytest.approx(first_s / SCALE + (n_out - 1) * decode_s, rel=0.25)


def test_non_streamed_legs_and_openai_routes(cluster: EmulatedCluster) -> None:
    p_url, d_url = cluster.prefill_urls[1], cluster.decode_urls[0]
    body = {"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 3}}
    (ps, pt, _), (ds, dt, _, _) = asyncio.run(
        _dual_dispatch(p_url, d_url, *_legs(cluster, 13, prefill=1, **body))
    )
    assert ps == ds == 200
    assert json.loads(pt)["meta_info"]["finish_reason"]["length"] == 0
    assert json.loads(dt)["meta_info"]["completion_tokens"] == 3
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
    legs = _legs(cluster, 14, prefill=1, **chat)
    _, (ds, dt, _, _) = asyncio.run(_dual_dispatch(p_url, d_url, *legs, path="/v1/chat/completions"))
    full = json.loads(dt)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["content"] == " tok" * 4
    assert full["usage"]["completion_tokens"] == 4 and full["usage"]["prompt_tokens"] > 0
    completion = {
        "prompt": "hello",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    legs = _legs(cluster, 15, prefill=1, **completion)
    _, (ds, dt, _, _) = asyncio.run(_dual_dispatch(p_url, d_url, *legs, path="/v1/completions"))
    events = _events(dt)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == " tok" * 3, "OpenAI streams deltas"
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_sglang_refusals(cluster: EmulatedCluster) -> None:
    d_url, p_url = cluster.decode_urls[0], cluster.prefill_urls[0]
    with _client() as c:
        no_room = c.post(f"{d_url}/generate", json={"input_ids": [1, 2, 3]})
        assert no_room.status_code == 400 and "without bootstrap room id" in no_room.text
        streamed = c.post(f"{p_url}/generate", json={"input_ids": [1, 2, 3], "stream": True})
        events = _events(streamed.text)
        assert streamed.status_code == 200 and "without bootstrap room id" in events[0]["error"]["message"]
        assert events[-1] == "[DONE]"
        window = cluster.live.config.context_window_tokens
        long = c.post(f"{d_url}/generate", json={"input_ids": [7] * window, "bootstrap_room": 1})
        assert long.status_code == 400 and "longer than the model's context length" in long.text
        local_on_prefill = c.post(
            f"{p_url}/generate", json={"input_ids": [1], "do_local_prefill": True, "bootstrap_room": 2}
        )
        assert local_on_prefill.status_code == 400
        assert c.post(f"{d_url}/generate", content=b"{not json").status_code == 400
        assert c.post(f"{d_url}/generate", json={"input_ids": [[1, 2], [3]]}).status_code == 400
        nowhere = c.post(
            f"{d_url}/generate",
            json={"input_ids": [1], "bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 3},
        )
        assert nowhere.status_code == 500 and "Failed to get prefill server info" in nowhere.text
        assert c.get(f"{d_url}/no_such_route").status_code == 404


def test_legs_that_never_meet_are_aborted_after_the_bootstrap_timeout() -> None:
    config = ClusterConfig(n_prefill=2, n_decode=1)
    emulated = EmulatedCluster(_live(config), bootstrap_timeout_s=0.1)
    with BackgroundCluster(emulated) as c:
        # the decode leg's bootstrap names prefill 0, but the prefill leg went to prefill 1: no meeting
        p_body, _ = _legs(c, room=21, prefill=1, input_ids=[3] * 100, stream=True)
        _, d_body = _legs(c, room=21, prefill=0, input_ids=[3] * 100, stream=True)
        (ps, pt, _), (ds, dt, _, _) = asyncio.run(
            _dual_dispatch(c.prefill_urls[1], c.decode_urls[0], p_body, d_body)
        )
        for text in (pt, dt):
            reason = _events(text)[0]["meta_info"]["finish_reason"]
            assert (
                reason["type"] == "abort"
                and reason["status_code"] == 500
                and "timed out" in reason["message"]
            )
        assert not c._rooms, "timed-out legs leave no room behind"
        # a room whose legs ask for different requests is refused on both
        p_body, d_body = _legs(c, room=22, input_ids=[3] * 100)
        d_body["input_ids"] = [3] * 101
        (ps, _, _), (ds, dt, _, _) = asyncio.run(
            _dual_dispatch(c.prefill_urls[0], c.decode_urls[0], p_body, d_body)
        )
        assert ps == ds == 400 and "different requests" in dt
        assert c.live.sim.reqs == [], "nothing reached the simulator"


def test_do_local_prefill_runs_on_the_nodes_lease_or_is_refused_with_503() -> None:
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1)
    body = {"input_ids": list(range(100, 1100)), "sampling_params": {"max_new_tokens": 8}, "stream": True}
    with (
        BackgroundCluster(EmulatedCluster(_live(config))) as static,
        _client() as c,
    ):
        refused = _events(
            c.post(f"{static.decode_urls[0]}/generate", json={**body, "do_local_prefill": True}).text
        )
        reason = refused[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 503, "no lease: refused before a token"
        assert refused[0]["meta_info"]["completion_tokens"] == 0
    config = config.with_(control_interval_s=0.1)  # leases within a fraction of a second
    scheduler = build_scheduler("utilisation", config, cm)
    leased = EmulatedCluster(_live(config, scheduler=scheduler))
    with BackgroundCluster(leased) as lender, _client() as c:
        # a normal request keeps the node busy, so control ticks publish its lease
        p_body, d_body = _legs(lender, room=31, input_ids=[9] * 500, sampling_params={"max_new_tokens": 150})

        async def run() -> str:
            async with httpx.AsyncClient(trust_env=False, timeout=60.0) as ac:
                warm = asyncio.gather(
                    ac.post(f"{lender.prefill_urls[0]}/generate", json=p_body),
                    ac.post(f"{lender.decode_urls[0]}/generate", json=d_body),
                )
                await asyncio.sleep(3 * config.control_interval_s * SCALE)
                local = await ac.post(
                    f"{lender.decode_urls[0]}/generate", json={**body, "do_local_prefill": True}
                )
                await warm
                return local.text

        events = _events(asyncio.run(run()))
        _assert_streamed(events[:-1], 8)
        sim = lender.live.sim
        borrowed = [r for r in sim.reqs if r.path == 1]
        assert len(borrowed) == 1 and sim.counters.borrowed_prefill_tokens == 1000
        load = c.get(f"{lender.decode_urls[0]}/v1/loads").json()["loads"][0]
        assert load["total_prefill_uncached_tokens"] == 1000, "the decode node computed the prefill"


# ---------------------------------------------------------------------------------------------------
# status, loads, metrics


def test_status_endpoints(cluster: EmulatedCluster) -> None:
    w = cluster.decode_urls[0]
    with _client() as c:
        assert c.get(f"{w}/health").status_code == 200 and c.get(f"{w}/health_generate").status_code == 200
        assert c.get(f"{w}/version").json() == {"version": "0.5.23"}
        models = c.get(f"{w}/v1/models").json()
        assert models["data"][0]["id"] == "gpt-oss-120b" and models["data"][0]["max_model_len"] > 0
        assert c.get(f"{w}/model_info").json()["is_generation"] is True
        info = c.get(f"{w}/get_server_info").json()
        assert (
            info[TIME_SCALE_KEY] == SCALE
            and info["max_total_num_tokens"] == CostModel(*MODEL).kv_capacity_tokens
        )
        assert set(info[LAG_KEY]) >= {"max_s", "mean_s", "iterations", "check"}
        since = c.get(f"{w}/server_info", params={LAG_SINCE_PARAM: time.time() + 3600}).json()[LAG_KEY]
        assert since["iterations"] == 0, "nothing ran after that time"
        assert c.get(f"{w}/server_info", params={LAG_SINCE_PARAM: "soon"}).status_code == 400


def test_loads_and_metrics_follow_sglangs_names(cluster: EmulatedCluster) -> None:
    with _client() as c:
        for w in cluster.workers:
            full = c.get(f"{w.url}/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
            load = full["loads"][0]
            assert full["num_accelerators"] == 1 and load["dp_rank"] == 0
            assert {"num_running_reqs", "num_waiting_reqs", "token_usage", "max_total_num_tokens"} <= set(
                load
            )
            assert load["disaggregation"]["mode"] == w.role and "queues" in load and "memory" in load
            core = c.get(f"{w.url}/v1/loads", params={"include": "core"}).json()["loads"][0]
            assert "disaggregation" not in core
            assert c.get(f"{w.url}/v1/loads", params={"include": "nope"}).status_code == 400
            prom = c.get(f"{w.url}/v1/loads", params={"format": "prometheus"}).text
            assert (
                'sglang_num_running_reqs{dp_rank="0"}' in prom
                and "sglang_disagg_decode_prealloc_queue_reqs" in prom
            )
            metrics = c.get(f"{w.url}/metrics").text
            for name in ("sglang:num_running_reqs", "sglang:token_usage", "sglang:num_requests_total",
                         "crossflow:lag_max_seconds", "crossflow:time_scale"):  # fmt: skip
                assert f"# TYPE {name} " in metrics
            assert f'engine_type="{w.role}"' in metrics


def test_loads_count_sglangs_queues_while_requests_wait() -> None:
    config = ClusterConfig(n_prefill=1, n_decode=1)
    with BackgroundCluster(EmulatedCluster(_live(config))) as c:
        p_body, d_body = _legs(c, room=41, input_ids=[4] * 24_000, sampling_params={"max_new_tokens": 2})

        async def run() -> tuple[dict[str, Any], dict[str, Any]]:
            async with httpx.AsyncClient(trust_env=False, timeout=60.0) as ac:
                decode_leg = asyncio.ensure_future(ac.post(f"{c.decode_urls[0]}/generate", json=d_body))
                await asyncio.sleep(0.2)  # the decode leg waits for its prefill leg
                alone = (await ac.get(f"{c.decode_urls[0]}/v1/loads")).json()["loads"][0]
                prefill_leg = asyncio.ensure_future(ac.post(f"{c.prefill_urls[0]}/generate", json=p_body))
                await asyncio.sleep(0.1 * SCALE)  # a 24k-token prefill takes longer than this
                mid = (await ac.get(f"{c.prefill_urls[0]}/v1/loads")).json()["loads"][0]
                await asyncio.gather(decode_leg, prefill_leg)
                return alone, mid

        alone, mid = asyncio.run(run())
    assert alone["num_waiting_reqs"] == 0 and alone["num_used_tokens"] == 0, "a lone leg is not a request yet"
    assert mid["num_running_reqs"] == 1 and mid["num_waiting_uncached_tokens"] > 8000


def test_flush_cache_and_text_prompts() -> None:
    assert list(text_token_ids("abcdefgh", 32000)) == list(text_token_ids("abcdefghij", 32000)[:2])
    gen = parse_generation("chat", {"messages": [{"role": "user", "content": "x" * 40}]}, "m", 32000)
    assert gen.max_new_tokens == 128 and len(gen.token_ids) > 10
    with pytest.raises(Exception, match="messages"):
        parse_generation("chat", {"messages": []}, "m", 32000)
    config = ClusterConfig(n_prefill=1, n_decode=1)
    with (
        BackgroundCluster(EmulatedCluster(_live(config))) as c,
        _client() as h,
    ):
        body = {"input_ids": list(range(100, 2148)), "sampling_params": {"max_new_tokens": 2}}
        for room in (51, 52):
            asyncio.run(_dual_dispatch(c.prefill_urls[0], c.decode_urls[0], *_legs(c, room, **body)))
        assert [r.cached for r in c.live.sim.reqs] == [0, 2047], "the same prompt hits the prefill cache"
        assert h.post(f"{c.prefill_urls[0]}/flush_cache").status_code == 200
        asyncio.run(_dual_dispatch(c.prefill_urls[0], c.decode_urls[0], *_legs(c, 53, **body)))
        assert c.live.sim.reqs[-1].cached == 0, "flushed"


def test_http_server_answers_malformed_requests() -> None:
    async def run() -> bytes:
        async def handler(request: Any, writer: Any) -> None:
            raise AssertionError("not reached")

        server = HttpServer(handler)
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"BROKEN\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        await server.stop()
        return answer

    assert asyncio.run(run()).startswith(b"HTTP/1.1 400 ")


def test_a_replay_client_that_falls_behind_fails_the_lag_check() -> None:
    """Against an emulation, a replay whose own event loop stalls (here: a blocking transport) reports
    it and fails its check; against a server in wall time it only reports it."""
    from envs.request import Request, Trace
    from serving.replay import ReplayConfig, Replayer

    def stream(tokens: int) -> bytes:
        events = [
            {"text": "x", "meta_info": {"completion_tokens": k, "finish_reason": None}}
            for k in range(1, tokens + 1)
        ]
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    def make_handler(scale: float | None) -> Any:
        def handler(request: Any) -> Any:
            if request.url.path in ("/server_info", "/get_server_info"):
                return httpx.Response(200, json={TIME_SCALE_KEY: scale} if scale else {})
            if request.url.path == "/generate":
                time.sleep(0.25)  # a sync handler blocks the client's loop
                return httpx.Response(200, content=stream(3))
            return httpx.Response(404)

        return handler

    trace = Trace("t", [Request(i, -1, 0, 0.05 * i, 10, 3) for i in range(4)])
    for scale in (2.0, None):
        replayer = Replayer(
            trace, ReplayConfig(url="http://127.0.0.1:1"), transport=httpx.MockTransport(make_handler(scale))
        )
        result = asyncio.run(replayer.run())
        assert result.metrics["n_finished"] == 4 and result.client_lag_s >= 0.2
        if scale is not None:
            assert result.lag_failure is not None and "the replay client lagged" in result.lag_failure
        else:
            assert result.lag_failure is None

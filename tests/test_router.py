"""Crossflow's router (``serving.router``) over the emulated PD cluster: the three APIs on the normal
path, refusals that never reach a worker, the borrowed path and its fallback, leases over the wire
(the control plane's token, expiry when an agent stops), the faults (a decode worker or a prefill
worker killed mid-request), and its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from envs.cluster_config import ClusterConfig  # noqa: E402
from envs.cost_model import CostModel  # noqa: E402
from envs.estimator import ClusterEstimator  # noqa: E402
from envs.live import LiveCluster  # noqa: E402
from policies.lease import LeaseBudgets  # noqa: E402
from policies.ledger import LeaseLedger  # noqa: E402
from policies.node_state import NodeState  # noqa: E402
from policies.path import PathDecision, PathQuery, PathReason  # noqa: E402
from serving.pd_cluster import BackgroundCluster, EmulatedCluster  # noqa: E402
from serving.router import NODE_STATE_PATH, PageTrees, PrefillQueue  # noqa: E402
from serving.stack import CrossflowStack  # noqa: E402
from serving.upstream import UpstreamClient  # noqa: E402
from tests.test_serving_pd import _events  # noqa: E402
from train.experiment import build_scheduler  # noqa: E402

MODEL = ("H200", "gpt-oss-120b", 1)
BORROW_TOKENS = 1000
"""Requests of exactly this many input tokens are borrowed by ``BorrowMarked``."""


class BorrowMarked:
    """A router-side scheduler for tests: a standing lease on decode node 0, and every request of
    ``BORROW_TOKENS`` input tokens borrowed on it (the rest take the normal path)."""

    control_interval_s = 0.5
    uses_gateway_decode_pick = False
    borrow_tokens = BORROW_TOKENS

    def __init__(self) -> None:
        self.ledger = LeaseLedger()
        self.ledger.publish(0, LeaseBudgets(10**9, 10**9, 10**9, 10**9, 1000), 0.0, 1e9)
        self.calls: list[str] = []

    def on_control_interval(self, now_s: float, states: Any) -> list[int]:
        return []

    def choose_path(self, q: PathQuery, now_s: float) -> PathDecision:
        if q.input_tokens != self.borrow_tokens:
            return PathDecision("normal", None, None, 0.0, None, "test", PathReason.NOT_CONGESTED)
        demand = LeaseBudgets(q.input_tokens, q.input_tokens + q.expected_output_tokens, 0, 1, 1)
        res = self.ledger.reserve(0, demand, now_s)
        assert res is not None
        return PathDecision("borrow", 0, res.reservation_id, 1.0, 0.5, "test", PathReason.BORROWED)

    def on_task_arrival(self, reservation_id: int, state: Any, now_s: float) -> str:
        return "run"

    def on_task_started(self, reservation_id: int, now_s: float) -> bool:
        self.calls.append("started")
        return self.ledger.commit(reservation_id, now_s)

    def on_prefill_done(self, reservation_id: int) -> None:
        self.calls.append("prefill_done")

    def on_request_finished(self, reservation_id: int) -> None:
        self.calls.append("finished")
        self.ledger.release(reservation_id)

    def on_fallback(self, reservation_id: int) -> None:
        self.calls.append("fallback")
        self.ledger.release(reservation_id)


@contextlib.contextmanager
def _stack(
    config: ClusterConfig, *, scale: float = 4.0, worker_scheduler: Any = None, **fields: Any
) -> Iterator[tuple[BackgroundCluster, EmulatedCluster, CrossflowStack]]:
    live = LiveCluster(config, cost_model=CostModel(*MODEL), time_scale=scale, scheduler=worker_scheduler)
    background = BackgroundCluster(EmulatedCluster(live))
    with background as cluster:
        stack = CrossflowStack(cluster, **fields)
        _on(background, stack.start())
        try:
            yield background, cluster, stack
        finally:
            _on(background, stack.stop())


def _on(background: BackgroundCluster, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, background.loop).result(timeout=60)


def _client() -> Any:
    return httpx.Client(trust_env=False, timeout=60.0)


def _requests(cluster: EmulatedCluster) -> list[int]:
    return [w.requests_total for w in cluster.workers]


# ---------------------------------------------------------------------------------------------------
def test_page_trees_and_prefill_queue() -> None:
    trees = PageTrees(2, page_tokens=4, max_pages=3)
    trees.insert(0, [1, 2, 3])
    assert trees.match_tokens(0, [1, 2, 9], 12) == 8 and trees.match_tokens(1, [1], 4) == 0
    trees.insert(0, [7])  # least recently used page dropped
    assert trees.match_tokens(0, [1, 2], 8) == 0 and trees.matches([2, 3], 8, [0, 1]) == {0: 8}
    queue = PrefillQueue()  # no timing: a prompt is done as soon as it is queued
    first = queue.add(100, 0, 0.0)
    assert queue.tokens(0.0) == 0
    queue.remove(first, 0.0)  # gone already: no error


def test_the_prefill_queue_replays_the_workers_packed_and_chunked_iterations() -> None:
    """A chunked-prefill worker packs small prompts into one iteration and runs a long one in
    chunks; its count of uncomputed tokens (what the simulator's path query reads) drops when an
    iteration ends. The router's estimate replays that schedule with the estimator's iteration time
    (timing each prompt alone read high behind many small prompts: a fixed cost per iteration)."""
    from serving.stack import router_config_for

    seen: list[list[tuple[int, int]]] = []

    def iteration_s(chunks: Sequence[tuple[int, int]]) -> float:
        seen.append(list(chunks))
        return 0.1 + 0.001 * sum(t for t, _ in chunks)

    e = 1e-9
    queue = PrefillQueue(chunk_tokens=100, iteration_time_s=iteration_s)
    queue.add(40, 0, 0.0)  # an idle worker starts it alone: done at 0.14
    queue.add(50, 8, 0.0)  # these two arrive while it runs and share the next iteration
    queue.add(30, 0, 0.0)
    assert [queue.tokens(t) for t in (0.0, 0.14 - e, 0.14 + e, 0.32 - e, 0.32 + e)] == [120, 120, 80, 80, 0]
    assert seen == [[(40, 0)], [(50, 8), (30, 0)]]
    seen.clear()
    queue.add(250, 10, 1.0)  # chunks of 100: iterations end at 1.2 and 1.4
    queue.add(40, 0, 1.0)  # waits: its tokens count whole until the iteration computing them ends
    assert [queue.tokens(t) for t in (1.0, 1.2 - e, 1.2 + e, 1.4 - e, 1.4 + e)] == [290, 290, 190, 190, 90]
    assert queue.tokens(1.59 - e) == 90 and queue.tokens(1.59 + e) == 0  # 50 + 40 packed
    assert seen == [[(100, 10)], [(100, 110)], [(50, 210), (40, 0)]]  # each chunk after its prefix
    long = queue.add(300, 0, 2.0)
    queue.add(30, 0, 2.0)
    queue.remove(long, 2.0)  # the worker answered: its tokens leave at once
    assert queue.tokens(2.0) == 30 and queue.tokens(2.2 + e) == 30 and queue.tokens(2.33 + e) == 0
    # an answer comes in real time, the count is read later: the replay keeps the schedule it had
    late = PrefillQueue(chunk_tokens=100, iteration_time_s=iteration_s)
    late.add(100, 0, 0.0)  # alone: done at 0.2
    second = late.add(50, 0, 0.0)  # next: done at 0.35
    late.add(40, 0, 0.0)
    late.remove(second, 0.3)  # answered while its iteration ran: the one after it starts at 0.35
    assert late.tokens(0.3) == 40 and late.tokens(0.35 + e) == 40 and late.tokens(0.49 + e) == 0
    whole = PrefillQueue(chunk_tokens=0, iteration_time_s=iteration_s)  # a whole prompt per iteration
    whole.add(250, 0, 0.0)
    whole.add(40, 0, 0.0)
    assert [whole.tokens(t) for t in (0.35 - e, 0.35 + e, 0.49 + e)] == [290, 40, 0]
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefillQueue(chunk_tokens=-1)
    config = ClusterConfig(n_prefill=1, n_decode=1, prefill_chunk_tokens=4096)
    cm = CostModel(*MODEL)
    routed = router_config_for(config, cm, [("http://p", 1)], ["http://d"])
    assert routed.prefill_chunk_tokens == 4096
    estimator = ClusterEstimator(config, cm)
    chunks = [(512, 0), (256, 64)]
    assert estimator.prefill_iteration_time_s(chunks) == cm.iteration_time_s(chunks)


def test_a_legs_body_is_the_clients_encoded_once_plus_the_legs_fields() -> None:
    from serving.router import _leg_json

    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}
    leg = json.loads(_leg_json(json.dumps(body).encode(), {"rid": "r", "stream": False}))
    assert leg == {**body, "rid": "r", "stream": False}
    assert json.loads(_leg_json(b"{}", {"bootstrap_room": 7})) == {"bootstrap_room": 7}
    assert json.loads(_leg_json(b'{ "a": 1 } ', {"b": 2})) == {"a": 1, "b": 2}


def test_normal_path_serves_the_three_apis_by_dual_dispatch() -> None:
    config = ClusterConfig(n_prefill=2, n_decode=2)
    with _stack(config) as (_, cluster, stack), _client() as c:
        url = stack.router.url
        gen = c.post(
            f"{url}/generate",
            json={"text": "hello " * 40, "sampling_params": {"max_new_tokens": 5}, "stream": True},
        )
        events = _events(gen.text)
        assert gen.status_code == 200 and events[-1] == "[DONE]"
        assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 4, 5]
        comp = c.post(f"{url}/v1/completions", json={"prompt": "a b c " * 30, "max_tokens": 3}).json()
        assert comp["choices"][0]["text"] == " tok" * 3 and comp["usage"]["completion_tokens"] == 3
        chat = c.post(
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        chunks = _events(chat.text)
        assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 2
        # each request: one prefill leg and one decode leg, paired in the simulator
        n_p = sum(w.requests_total for w in cluster.prefill)
        n_d = sum(w.requests_total for w in cluster.decode)
        assert n_p == n_d == 3 and len(cluster.live.sim.reqs) == 3
        assert all(r.prefill_worker >= 0 for r in cluster.live.sim.reqs)
        info = c.get(f"{url}/server_info").json()
        assert info["crossflow_router"]["policy"]["name"] == "static" and info["crossflow_time_scale"] == 4.0
        assert len(c.get(f"{url}/workers").json()["workers"]) == 4
        metrics = c.get(f"{url}/metrics").text
        assert 'crossflow:requests_completed_total{path="normal"} 3' in metrics
        assert 'crossflow:time_to_first_token_seconds_count{path="normal"} 3' in metrics


def test_bad_bodies_get_a_400_naming_the_field_and_never_reach_a_worker() -> None:
    config = ClusterConfig(n_prefill=1, n_decode=1)
    with _stack(config) as (_, cluster, stack), _client() as c:
        url = stack.router.url
        cases = [
            (c.post(f"{url}/generate", content=b"{not json"), "not JSON"),
            (c.post(f"{url}/generate", json=[1, 2]), "JSON object"),
            (c.post(f"{url}/generate", json={"sampling_params": {}}), "'input_ids' or 'text'"),
            (
                c.post(f"{url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": "9"}}),
                "'max_new_tokens' must be an integer",
            ),
            (c.post(f"{url}/v1/completions", json={"prompt": 7}), "'prompt'"),
            (c.post(f"{url}/v1/chat/completions", json={"messages": []}), "'messages'"),
            (
                c.post(
                    f"{url}/generate",
                    json={"input_ids": [5] * config.context_window_tokens, "sampling_params": {}},
                ),
                "context length",
            ),
        ]
        for resp, needle in cases:
            assert resp.status_code == 400, resp.text
            assert needle in resp.json()["error"]["message"], resp.text
        assert _requests(cluster) == [0, 0], "no worker saw any of them"


def test_borrowed_path_goes_to_the_decode_worker_alone() -> None:
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1, control_interval_s=0.1)
    worker_side = build_scheduler("utilisation", config, cm)  # the node's own lease
    scheduler = BorrowMarked()
    with (
        _stack(
            config, worker_scheduler=worker_side, scheduler=scheduler, estimator=ClusterEstimator(config, cm)
        ) as (_, cluster, stack),
        _client() as c,
    ):
        url = stack.router.url

        async def run() -> str:
            async with httpx.AsyncClient(trust_env=False, timeout=60.0) as ac:
                body = {"input_ids": [9] * 500, "sampling_params": {"max_new_tokens": 150}}
                warm = ac.post(f"{url}/generate", json=body)  # keeps the node busy: its leases tick
                warm_task = asyncio.ensure_future(warm)
                await asyncio.sleep(3 * config.control_interval_s * 4.0)
                ids = list(range(100, 100 + BORROW_TOKENS))
                local = await ac.post(
                    f"{url}/generate",
                    json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8}, "stream": True},
                )
                await warm_task
                return local.text

        events = _events(asyncio.run(run()))
        assert events[-1] == "[DONE]" and events[-2]["meta_info"]["completion_tokens"] == 8
        sim = cluster.live.sim
        assert [r.path for r in sim.reqs].count(1) == 1, "prefilled on the decode node"
        assert cluster.prefill[0].requests_total == 1, "the borrowed request never reached the prefill worker"
        assert scheduler.calls == ["started", "prefill_done", "finished"]
        metrics = c.get(f"{url}/metrics").text
        assert 'crossflow:requests_completed_total{path="borrow"} 1' in metrics
        assert 'crossflow:path_decisions_total{path="borrow",reason="borrowed"} 1' in metrics


def test_a_refused_borrow_falls_back_to_the_normal_path_and_completes() -> None:
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1)
    scheduler = BorrowMarked()  # the router believes in a lease the node does not hold (revoked there)
    with (
        _stack(config, scheduler=scheduler, estimator=ClusterEstimator(config, cm)) as (_, cluster, stack),
        _client() as c,
    ):
        ids = list(range(100, 100 + BORROW_TOKENS))
        resp = c.post(
            f"{stack.router.url}/generate",
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "stream": True},
        )
        events = _events(resp.text)
        assert resp.status_code == 200 and events[-2]["meta_info"]["completion_tokens"] == 4
        assert all("error" not in e for e in events[:-1]), "the refusal never reached the client"
        assert scheduler.calls == ["fallback"]
        assert cluster.decode[0].requests_total == 2 and cluster.prefill[0].requests_total == 1
        assert [r.prefill_worker for r in cluster.live.sim.reqs] == [0], "completed on the normal path"
        metrics = c.get(f"{stack.router.url}/metrics").text
        assert 'crossflow:fallbacks_total{node="0",cause="refused"} 1' in metrics
        assert 'crossflow:requests_completed_total{path="normal"} 1' in metrics


def test_lease_agents_publish_leases_and_a_stopped_agents_lease_expires() -> None:
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=2)
    scheduler = build_scheduler("utilisation", config, cm)
    ttl_s = scheduler.policy_for(0).ttl_s
    scale = 0.2  # emulated time runs 5x faster than wall time: a TTL passes quickly
    with (
        _stack(config, scale=scale, scheduler=scheduler, estimator=ClusterEstimator(config, cm)) as (
            background,
            _,
            stack,
        ),
        _client() as c,
    ):
        router = stack.router
        assert router.scheduler is not None
        ledger = router.scheduler.ledger
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            all(a.reports >= 2 and a.last_lease is not None for a in stack.agents)
            and ledger.node_ids() == [0, 1]
        ):
            time.sleep(0.05)  # the agents report, the router's control interval publishes, they hear
        assert all(a.reports >= 2 for a in stack.agents) and all(a.errors == 0 for a in stack.agents)
        assert ledger.node_ids() == [0, 1] and all(
            ledger.lease(j).is_live(router.now_s()) and not ledger.lease(j).budgets.is_zero() for j in (0, 1)
        )
        assert stack.agents[0].last_lease is not None and stack.agents[0].last_lease["prefill_tokens"] > 0
        # the control plane: a token, and bodies checked
        state = NodeState(0, 0.0, 0, 0.0, 0.0, 0.0, 1000, 0, 0, 0, 0, 0, 0.0, 0.0, 8).to_dict()
        route = router.control_url + NODE_STATE_PATH
        assert c.post(route, json={"node_id": 0, "node_state": state}).status_code == 401
        bad = c.post(route, json={"node_id": 7, "node_state": state}, headers={"authorization": "Bearer x"})
        assert bad.status_code == 401
        auth = {"authorization": f"Bearer {router.control_token}"}
        bad = c.post(route, json={"node_id": 7, "node_state": state}, headers=auth)
        assert bad.status_code == 400 and "node_id" in bad.json()["error"]["message"]
        bad = c.post(route, json={"node_id": 0, "node_state": {"nope": 1}}, headers=auth)
        assert bad.status_code == 400 and "node_state" in bad.json()["error"]["message"]
        assert router.control.host == "127.0.0.1"
        # agent 0 dies: its node's lease is not refreshed and lapses at its TTL; node 1 keeps lending
        _on(background, stack.agents[0].stop())
        stopped_s = router.now_s()
        time.sleep((ttl_s + 2 * config.control_interval_s) * scale + 0.3)
        now = router.now_s()
        assert now - stopped_s > ttl_s
        assert not ledger.lease(0).is_live(now), "the lease of a silent node expired"
        assert ledger.lease(1).is_live(now)
        assert ledger.reserve(0, LeaseBudgets(1, 1, 0, 1, 1), now) is None, "nothing more is borrowed there"
        metrics = c.get(f"{router.url}/metrics").text
        assert 'crossflow:lease_budget{node="0",budget="prefill_tokens"} 0' in metrics
        assert 'crossflow:lease_reports_total{node="1"}' in metrics


def test_a_decode_worker_killed_mid_stream_ends_its_clients_stream_with_an_error() -> None:
    config = ClusterConfig(n_prefill=1, n_decode=2)
    with _stack(config, scale=2.0) as (background, cluster, stack):
        url = stack.router.url

        async def run() -> tuple[list[Any], int]:
            async with httpx.AsyncClient(trust_env=False, timeout=60.0) as ac:
                body = {"input_ids": [7] * 200, "sampling_params": {"max_new_tokens": 2000}, "stream": True}
                events: list[Any] = []
                async with ac.stream("POST", f"{url}/generate", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                        if len(events) == 3:  # streaming: kill the decode worker serving it
                            victim = next(w for w in cluster.decode if w.requests_total)
                            asyncio.run_coroutine_threadsafe(victim.stop(), background.loop)
                # the other decode worker still serves
                other = await ac.post(
                    f"{url}/generate", json={**body, "sampling_params": {"max_new_tokens": 3}}
                )
                return events, other.status_code

        t0 = time.monotonic()
        events, other_status = asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert time.monotonic() - t0 < 30, "no hang"
        assert events[-1] == "[DONE]"
        reason = events[-2]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 502, events[-2]
        assert other_status == 200


def test_a_prefill_worker_killed_while_its_decode_leg_waits_aborts_that_leg_and_retries() -> None:
    config = ClusterConfig(n_prefill=2, n_decode=1)
    with _stack(config, scale=4.0) as (background, cluster, stack):
        url = stack.router.url

        async def run() -> tuple[int, list[Any]]:
            async with httpx.AsyncClient(trust_env=False, timeout=120.0) as ac:
                body = {"input_ids": [11] * 60_000, "sampling_params": {"max_new_tokens": 3}, "stream": True}
                task = asyncio.ensure_future(ac.post(f"{url}/generate", json=body))
                while not any(w.requests_total for w in cluster.prefill) or cluster.live.in_flight() == 0:
                    await asyncio.sleep(0.01)  # both legs met: the prefill is running
                victim = next(w for w in cluster.prefill if w.requests_total)
                asyncio.run_coroutine_threadsafe(victim.stop(), background.loop).result(10)
                resp = await task
                return resp.status_code, _events(resp.text)

        status, events = asyncio.run(asyncio.wait_for(run(), timeout=90))
        assert status == 200 and events[-2]["meta_info"]["completion_tokens"] == 3, "retried elsewhere"
        assert sorted(w.requests_total for w in cluster.prefill) == [1, 1], "on the other prefill worker"
        assert cluster.decode[0].requests_total == 2
        assert cluster._rooms == {} and cluster.decode[0]._tasks == {}, "the first decode leg was aborted"
        assert 'crossflow:retries_total{cause="transport"} 1' in stack.router.registry.exposition()


def test_the_router_serves_its_scheduler_without_prefix_pulls() -> None:
    """No served node can pull a prefill worker's cached prefix (the router, its workers and the
    plugin have no protocol for it), so the router's path policy never plans one
    (``without_prefix_pulls``, applied to the scheduler it starts with and to a reloaded one)."""
    from serving.router import Router, RouterConfig

    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1)
    served = build_scheduler("heuristic", config, cm)
    assert served.path.prefix_pull
    router_config = RouterConfig(prefill=(("http://127.0.0.1:1", None),), decode=("http://127.0.0.1:2",))
    router = Router(router_config, scheduler=served, estimator=ClusterEstimator(config, cm))
    assert router.scheduler is served and not served.path.prefix_pull


def test_the_prefill_queue_counts_a_shared_prefix_cached_only_once_its_prompt_was_computed() -> None:
    """The gateway's tree has a prompt's prefix from dispatch (it routes on that), but the worker
    caches it when the prompt's prefill ends: a second prompt sharing it while the first is still
    queued there is counted with the prefix to compute, as the simulator's worker counts it; once
    the first was answered, a third is counted with it cached."""
    import numpy as np

    from serving.pd_cluster import Generation
    from serving.router import Router, RouterConfig, _Flight

    router_config = RouterConfig(prefill=(("http://127.0.0.1:1", None),), decode=("http://127.0.0.1:2",))
    router = Router(router_config)
    router._prefill_queues = [PrefillQueue(0, lambda chunks: 1e9)]  # nothing computes until answered
    p, d = router.prefill[0], router.decode[0]
    shared = list(range(1, 4097))

    def flight(i: int, tail: int) -> _Flight:
        ids = np.array(shared + [50_000 + i] * tail, dtype=np.int64)
        gen = Generation("generate", ids, 4, False, f"r{i}", "m")
        return _Flight(i, gen, router._hasher.page_hashes(ids))

    queue = router._prefill_queues[0]
    first, second, third = flight(1, 100), flight(2, 200), flight(3, 300)
    router._enter(first, d, p)
    router._enter(second, d, p)
    assert queue.tokens(router.now_s()) == 4196 + 4296, "the shared prefix is not cached yet"
    assert router._prefill_trees.match_tokens(0, second.hashes, 4296) >= 4000, "the gateway routes on it"
    router._prefill_left(first, p, computed=True)
    router._enter(third, d, p)
    cached = router._computed_trees.match_tokens(0, third.hashes, 4396)
    assert cached >= 4000
    assert queue.tokens(router.now_s()) == 4296 + (4396 - cached)
    router._prefill_left(second, p)  # failed: its prompt is not cached on the worker
    assert router._computed_trees.match_tokens(0, second.hashes, 4296) == cached


def test_a_lease_revoked_while_borrowed_work_is_queued_falls_back_before_its_first_token() -> None:
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1, control_interval_s=0.1)
    worker_side = build_scheduler("utilisation", config, cm)
    scheduler = BorrowMarked()
    with (
        _stack(
            config, worker_scheduler=worker_side, scheduler=scheduler, estimator=ClusterEstimator(config, cm)
        ) as (_, cluster, stack),
    ):
        live = cluster.live
        submit = live.submit_borrowed

        def submit_then_revoke(*args: Any, **kwargs: Any) -> Any:
            """The node's lease is revoked right after the borrowed request queued there."""
            queued = submit(*args, **kwargs)
            assert worker_side.ledger.revoke(kwargs["decode_worker"], live.sim.now_s)
            return queued

        live.submit_borrowed = submit_then_revoke  # type: ignore[method-assign]
        url = stack.router.url

        async def run() -> str:
            async with httpx.AsyncClient(trust_env=False, timeout=60.0) as ac:
                warm = asyncio.ensure_future(
                    ac.post(
                        f"{url}/generate",
                        json={"input_ids": [9] * 500, "sampling_params": {"max_new_tokens": 150}},
                    )
                )
                await asyncio.sleep(3 * config.control_interval_s * 4.0)  # the node lends now
                ids = list(range(100, 100 + BORROW_TOKENS))
                resp = await ac.post(
                    f"{url}/generate",
                    json={"input_ids": ids, "sampling_params": {"max_new_tokens": 5}, "stream": True},
                )
                await warm
                return resp.text

        events = _events(asyncio.run(asyncio.wait_for(run(), timeout=60)))
        assert events[-2]["meta_info"]["completion_tokens"] == 5 and all(
            "error" not in e for e in events[:-1]
        )
        assert scheduler.calls == ["fallback"], "it fell back before its first token"
        sim = live.sim
        assert [r.path for r in sim.reqs].count(1) == 0, "nothing was prefilled on the revoked lease"
        assert cluster.prefill[0].requests_total == 2, "the fallback took the normal path"


def test_twice_the_clusters_capacity_for_a_bounded_time_loses_no_request() -> None:
    config = ClusterConfig(n_prefill=1, n_decode=1)
    n = 40
    with _stack(config, scale=1.0) as (_, cluster, stack):
        url = stack.router.url

        async def one(ac: Any, i: int) -> tuple[int, str]:
            body = {"input_ids": [100 + i] * 4000, "sampling_params": {"max_new_tokens": 20}}
            resp = await ac.post(f"{url}/generate", json=body)
            return resp.status_code, resp.text

        async def burst() -> list[tuple[int, str]]:
            async with httpx.AsyncClient(
                trust_env=False, timeout=120.0, limits=httpx.Limits(max_connections=None)
            ) as ac:
                return await asyncio.gather(*(one(ac, i) for i in range(n)))

        t0 = time.monotonic()
        answers = asyncio.run(asyncio.wait_for(burst(), timeout=120))
        elapsed = time.monotonic() - t0
        for status, text in answers:
            body = json.loads(text)
            if status == 200:
                assert body["meta_info"]["completion_tokens"] == 20
            else:
                assert status >= 400 and body["error"]["message"], "a clear error"
        done = sum(1 for s, _ in answers if s == 200)
        assert done == n, f"{n - done} refused"
        # the burst offered its work at once, far above what one prefill worker does per second
        work_s = sum(cluster.live.cm.prefill_time_s(4000, 0, config.prefill_chunk_tokens) for _ in range(n))
        assert elapsed > 0.5 * work_s, "the requests really queued"


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.parametrize("load", [1.25, 2.0])
def test_heuristic_through_the_router_agrees_with_simulate(load: float) -> None:
    """The heuristic policy on 2P4D at static saturation (1.25x the trace's load) and above it (2x:
    the prefill pool is congested and the policy borrows), 60 requests of the synthetic Mooncake
    trace: through the router and its lease agents on the emulated cluster whose nodes install the
    router's pushed leases (as ``crossflow serve --router crossflow`` runs them), and in the
    simulator at the router's own phase. The simulator's answer moves with the phase of its control
    grid against the arrivals by more than the aims (``docs/serving.md``); the router measures where
    its first request fell on its grid (``control_phase_s``), and the replay is held to the
    simulator there and at two steps of 5 ms either side (the run-to-run jitter of that phase), leases
    out before the first request as the router's are: each figure within that range widened by the
    aim (input throughput 10 %, mean TTFT 20 %, mean ITL 10 %, the borrowed share 5 points).
    ``benchmarks/bench_router.py agree`` prints the router's difference from the median there."""
    from policies.lease_path import without_prefix_pulls
    from serving.node_leases import WireLeases
    from serving.replay import ReplayConfig, replay
    from train.experiment import Point, phase_neighbourhood, prepare_trace, simulate_at_phase

    point = Point(
        policy="heuristic",
        trace="mooncake-synthetic",
        shape="2P4D",
        max_requests=60,
        load=load,
        cluster_overrides=(("context_policy", "reject"),),  # as the router refuses past the window
    )
    trace = prepare_trace(point)
    config, cm = point.cluster(), point.cost_model()
    with _stack(
        config,
        scale=6.0,
        worker_scheduler=WireLeases(config.n_decode, burst_s=config.control_interval_s),
        scheduler=build_scheduler("heuristic", config, cm),
        estimator=ClusterEstimator(config, cm),
    ) as (_, _, stack):
        result = replay(trace, ReplayConfig(url=stack.router.url, timeout_s=300, load=point.load))
        completed = {k[0]: v for k, v in stack.router.m_completed.values.items()}
        phase_s = stack.router.control_phase_s()
    assert phase_s is not None
    runs = [  # as the router serves it: no node pulls a prefill worker's cached prefix
        simulate_at_phase(
            point, trace, without_prefix_pulls(build_scheduler("heuristic", config, cm)), delay_s
        )
        for delay_s in phase_neighbourhood(phase_s, config.control_interval_s)
    ]
    names = ("input_tokens_per_s", "ttft_mean_s", "itl_mean_s", "borrowed_share")
    low, high = ({n: pick(getattr(r.metrics, n) for r in runs) for n in names} for pick in (min, max))
    assert low["borrowed_share"] > 0.1, "the point borrows"
    m = result.metrics
    assert result.lag_failure is None
    assert m["n_finished"] == 60 and all(r.metrics.n_finished == 60 for r in runs)
    borrowed_share = completed.get("borrow", 0.0) / sum(completed.values())
    router = {n: float(m[n]) for n in names[:3]} | {"borrowed_share": borrowed_share}
    for name, rel in (("input_tokens_per_s", 0.10), ("ttft_mean_s", 0.20), ("itl_mean_s", 0.10)):
        assert low[name] * (1 - rel) <= router[name] <= high[name] * (1 + rel), (name, router, low, high)
    share = router["borrowed_share"]
    assert low["borrowed_share"] - 0.05 - 1e-9 <= share <= high["borrowed_share"] + 0.05 + 1e-9


def test_the_prefill_queue_replay_matches_the_simulated_workers_count() -> None:
    """Fed the simulator's own normal dispatches (tokens and cached prefix as routed) and its prefill
    workers' answers, the router's ``PrefillQueue`` reads each worker's queued uncomputed tokens at
    every later dispatch: exactly, except where the worker's cache changed between routing and the
    prompt's start (a few pages). A replay that forgets the order of events (answers taken out
    before the count is read replayed the past without them) was as often exact but 2,466 tokens off
    on average."""
    from envs.simulator import Simulator
    from train.experiment import Point, prepare_trace, session_rate

    point = Point(policy="heuristic", trace="mooncake", shape="2P4D", max_requests=60, load=2.0)
    trace = prepare_trace(point)
    config, cm = point.cluster(), point.cost_model()
    sim = Simulator(
        trace,
        config,
        scheduler=build_scheduler("heuristic", config, cm),
        cost_model=cm,
        load_factor=point.load,
        session_rate_per_s=session_rate(point, trace),
        seed=point.seed,
    )
    estimator = ClusterEstimator(config, cm)
    queues = [
        PrefillQueue(config.prefill_chunk_tokens, estimator.prefill_iteration_time_s) for _ in sim.prefill
    ]
    keys: dict[int, tuple[int, int]] = {}
    errors: list[int] = []
    dispatch, prefill_done = sim._dispatch_normal, sim._on_prefill_done

    def dispatched(req: Any, pidx: int, didx: int | None = None) -> None:
        errors.append(queues[pidx].tokens(sim.now_s) - sim.prefill[pidx].queued_tokens)
        dispatch(req, pidx, didx)
        cached = req.input - req.queued_estimate
        keys[req.rid] = (pidx, queues[pidx].add(req.queued_estimate, cached, sim.now_s))

    def iteration_done(idx: int) -> None:
        batch = [req for req, _ in sim.prefill[idx].batch]
        prefill_done(idx)
        for req in batch:  # the worker answers once the prompt is done
            if req.done >= req.input and req.rid in keys:
                pidx, key = keys.pop(req.rid)
                queues[pidx].remove(key, sim.now_s)

    sim._dispatch_normal, sim._on_prefill_done = dispatched, iteration_done  # type: ignore[method-assign]
    sim.run()
    assert len(errors) >= 30
    exact = sum(e == 0 for e in errors)
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    assert exact >= 0.7 * len(errors) and mean_abs < 1_000, (exact, len(errors), mean_abs)


def test_serve_with_the_crossflow_router_and_the_standalone_router_command(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``crossflow serve --router crossflow --policy heuristic`` serves a replay and stops on Ctrl-C;
    ``crossflow router`` in front of running workers does too; bad worker flags are refused."""
    import os
    import re
    import signal
    import subprocess
    import sys

    from envs.request import Request, Trace
    from envs.traces import save_bundle
    from train.cli import main

    bundle = tmp_path / "tiny.csv.gz"
    # spread over 2 emulated seconds: the replay's lag check allows 5 % of the run's wall time
    save_bundle(Trace("t", [Request(i, -1, 0, 0.6 * i, 600 + 97 * i, 8) for i in range(4)]), bundle)

    def run_until_serving(command: list[str], ready: str) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "train.cli", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith(ready):
                break
        return proc, "".join(lines)

    def stop(proc: subprocess.Popen[str]) -> str:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        return rest

    serve = ["serve", "--emulate", "1P2D", "--port", "0", "--router", "crossflow", "--policy", "heuristic"]
    proc, text = run_until_serving([*serve, "--time-scale", "4"], "serving ")
    try:
        found = re.search(
            r"^\s+router\s+(http://127\.0\.0\.1:\d+)\s+\(crossflow, policy heuristic\)", text, re.M
        )
        assert found is not None and "(2 lease agents)" in text, text
        assert main(["replay", "--url", found[1], "--trace", str(bundle)]) == 0
        assert "4 / 4" in capsys.readouterr().out
        rest = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "served 4 requests" in rest and "router stopped (normal 4)" in rest
    config = ClusterConfig(n_prefill=1, n_decode=1)
    background = BackgroundCluster(
        EmulatedCluster(LiveCluster(config, cost_model=CostModel(*MODEL), time_scale=4.0))
    )
    with background as cluster:
        p = cluster.prefill[0]
        command = ["router", "--prefill", p.url, str(p.bootstrap_port), "--decode", cluster.decode_urls[0]]
        proc, text = run_until_serving([*command, "--port", "0"], "control ")
        try:
            found = re.search(
                r"^router (http://127\.0\.0\.1:\d+)\s+\(crossflow, policy static, time scale 4\)", text, re.M
            )
            assert found is not None, text
            assert main(["replay", "--url", found[1], "--trace", str(bundle)]) == 0
            assert "4 / 4" in capsys.readouterr().out
            assert "router stopped" in stop(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert main(["router", "--prefill", "http://x", "1", "2", "--decode", "http://y"]) == 2
    assert "URL [BOOTSTRAP_PORT]" in capsys.readouterr().err
    assert main(["router", "--prefill", "x:1", "--decode", "http://y"]) == 2
    assert "http://" in capsys.readouterr().err


def _wait(predicate: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_leases_are_pushed_to_workers_that_take_them_and_their_recheck_uses_them() -> None:
    """Decode workers that install pushed leases (as with the plugin; here ``WireLeases``): the router
    sends each lease it publishes over ``/set_internal_state``, the node admits a borrowed request only
    on it, and a lease the router revokes is revoked on the node too (the node then refuses)."""
    from serving.node_leases import WireLeases

    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=2, control_interval_s=0.1)
    nodes = WireLeases(config.n_decode, burst_s=config.control_interval_s)
    scheduler = BorrowMarked()  # the router's lease on node 0, none on node 1
    lease = LeaseBudgets(100_000, 10**6, 0, 10**5, 100)
    scheduler.ledger.publish(0, lease, 0.0, 10.0)  # 10 000 prefill tokens per emulated second
    with (
        _stack(
            config, worker_scheduler=nodes, scheduler=scheduler, estimator=ClusterEstimator(config, cm)
        ) as (background, cluster, stack),
        _client() as c,
    ):
        router = stack.router
        assert _wait(lambda: nodes.installs[0] >= 1), "the lease reached node 0"
        assert all(a.takes_leases for a in stack.agents)
        assert nodes.ledger.lease(0).budgets == lease
        assert nodes.ledger.lease(0).expires_s == pytest.approx(10.0, abs=1.0), "the time it had left"
        assert nodes.ledger.lease(1) is None, "no lease published for node 1: none sent"
        ids = list(range(100, 100 + BORROW_TOKENS))
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6}, "stream": True}
        events = _events(c.post(f"{router.url}/generate", json=body).text)
        assert events[-2]["meta_info"]["completion_tokens"] == 6
        assert [r.path for r in cluster.live.sim.reqs].count(1) == 1, "prefilled on node 0, on its lease"
        assert scheduler.calls == ["started", "prefill_done", "finished"]
        assert nodes.ledger.active_ids() == [], "the node's reservation ended with the request"
        # the router revokes node 0's lease: the zero lease is pushed and the node refuses borrowing
        background.loop.call_soon_threadsafe(scheduler.ledger.revoke, 0, router.now_s())
        assert _wait(lambda: nodes.ledger.lease(0).budgets.is_zero()), "the revocation reached the node"
        local = {**body, "do_local_prefill": True}
        refused = _events(c.post(cluster.decode_urls[0] + "/generate", json=local).text)
        assert refused[0]["meta_info"]["finish_reason"]["status_code"] == 503, refused
        # a new lease in the router's ledger is sent again
        background.loop.call_soon_threadsafe(scheduler.ledger.publish, 0, lease, router.now_s(), 10.0)
        assert _wait(lambda: not nodes.ledger.lease(0).budgets.is_zero()), "the new lease reached the node"
        metrics = c.get(f"{router.url}/metrics").text
        assert 'crossflow:lease_pushes_total{node="0",result="installed"} 3' in metrics
        assert 'crossflow:lease_pushes_total{node="1"' not in metrics
        # bad lease updates are refused naming the field
        bad = c.post(cluster.decode_urls[0] + "/set_internal_state", json={"server_args": {"x": 1}})
        assert bad.status_code == 400 and "crossflow_lease_" in bad.text
        bad = c.post(
            cluster.decode_urls[0] + "/set_internal_state",
            json={"server_args": {"crossflow_lease_ttl_s": 1.0}},
        )
        assert bad.status_code == 400 and "missing key" in bad.text
        bad = c.post(cluster.prefill_urls[0] + "/set_internal_state", json={"server_args": {}})
        assert bad.status_code == 400


def test_the_stack_is_ready_once_the_first_leases_are_out() -> None:
    """``CrossflowStack.start`` returns once the router's first control interval, run as soon as every
    agent reported, has published each node's lease and pushed it to the nodes that take them: the
    first requests find leases, as in the simulator, whose first control tick publishes them when its
    first request arrives (before, the router's first interval came a whole interval after it started
    and a replay started at once borrowed nothing for that long)."""
    from serving.node_leases import WireLeases

    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=2)  # the default 0.5 s interval: 2 s of wall time here
    nodes = WireLeases(config.n_decode, burst_s=config.control_interval_s)
    scheduler = build_scheduler("heuristic", config, cm)
    with _stack(
        config, worker_scheduler=nodes, scheduler=scheduler, estimator=ClusterEstimator(config, cm)
    ) as (_, _, stack):
        now = stack.router.now_s()
        assert now < config.control_interval_s, "the first interval did not wait a whole interval"
        for j in range(config.n_decode):
            lease = scheduler.ledger.lease(j)
            assert lease is not None and lease.is_live(now) and not lease.budgets.is_zero(), j
            assert nodes.installs[j] >= 1 and nodes.ledger.lease(j) is not None, f"pushed to node {j}"


def test_a_policy_reload_reaches_the_nodes_through_their_next_leases() -> None:
    """Nodes that install pushed leases hold no policy of their own, so a reload on the control plane
    reaches them with the new policy's leases: to a policy without leases, every node's lease is
    revoked at once; back to a lease policy, its leases are installed at its first intervals."""
    from serving.node_leases import WireLeases
    from serving.router import POLICY_PATH
    from train.serve_cli import served_policy

    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=2, control_interval_s=0.1)
    nodes = WireLeases(config.n_decode, burst_s=config.control_interval_s)

    def loader(ref: str) -> Any:
        other = served_policy(ref)
        return other.scheduler(config, cm), other.info

    with (
        _stack(
            config,
            scale=1.0,
            worker_scheduler=nodes,
            scheduler=build_scheduler("utilisation", config, cm),
            estimator=ClusterEstimator(config, cm),
            policy_loader=loader,
            control_token="tok",
        ) as (_, _, stack),
        _client() as c,
    ):
        router = stack.router

        def node_leases_live() -> bool:
            now = router.now_s() - 0.05  # the nodes' clock starts a moment before the router's
            leases = [nodes.ledger.lease(j) for j in (0, 1)]
            return all(x is not None and not x.budgets.is_zero() and x.is_live(now) for x in leases)

        assert _wait(node_leases_live), "the utilisation policy's leases reached both nodes"
        auth = {"authorization": "Bearer tok"}
        route = router.control_url + POLICY_PATH
        assert c.post(route, json={"policy": "static"}, headers=auth).status_code == 200
        assert router.scheduler is None
        assert _wait(lambda: all(nodes.ledger.lease(j).budgets.is_zero() for j in (0, 1))), "revoked"
        assert c.post(route, json={"policy": "utilisation"}, headers=auth).status_code == 200
        assert _wait(node_leases_live), "the reloaded policy's leases reached both nodes"
        assert router.scheduler is not None
        ledger = router.scheduler.ledger
        assert _wait(lambda: all(nodes.ledger.lease(j).budgets == ledger.lease(j).budgets for j in (0, 1)))
        assert all(node.chunk_limits is None for node in nodes.nodes), "utilisation sets no chunk cap"


def test_a_wire_lease_carries_the_node_policys_chunk_cap_and_the_node_sizes_chunks_by_it() -> None:
    """The heuristic caps each borrowed iteration from its ITL budget; a node holding no policy gets
    that cap with its lease (``ClusterScheduler.chunk_limits`` over the node's reported range) and
    sizes its chunks by it: never above what the policy answers in process for the same batch. Its
    decode-pressure test comes too (``ClusterScheduler.pressure_rule``): the node pauses a borrowed
    request that arrives under pressure, as the simulator's in-process node does."""
    from serving.node_leases import WireLeases

    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=2, control_interval_s=0.1)
    nodes = WireLeases(config.n_decode, burst_s=config.control_interval_s)
    scheduler = build_scheduler("heuristic", config, cm)
    with (
        _stack(
            config,
            scale=1.0,
            worker_scheduler=nodes,
            scheduler=scheduler,
            estimator=ClusterEstimator(config, cm),
        ) as (_, cluster, stack),
    ):
        assert _wait(lambda: all(node.chunk_limits is not None for node in nodes.nodes)), "caps pushed"
        state = cluster.live.node_state(0)
        table = scheduler.chunk_limits(0, state.max_running_requests, state.kv_capacity_tokens)
        assert table is not None and nodes.nodes[0].chunk_limits == table
        assert table.batch_sizes[-1] == config.max_running_requests
        policy = scheduler.policy_for(0)
        for batch, context in [(1, 3_000), (16, 200_000), (40, 150_000), (120, 900_000)]:
            wire_chunk = nodes.borrowed_chunk_tokens(0, batch, context)
            assert wire_chunk is not None and wire_chunk <= policy.borrowed_chunk_tokens(batch, context)
        assert nodes.borrowed_chunk_tokens(0, 16, 200_000) < config.prefill_chunk_tokens, "a real cap"
        assert stack.router.scheduler is scheduler
        # and its decode-pressure test: a borrowed request that arrives under pressure waits
        rule = scheduler.pressure_rule(0)
        assert rule is not None and all(node.pressure_rule == rule for node in nodes.nodes)
        calm = replace(state, recent_step_time_s=0.0, queued_decode_requests=0)
        busy = replace(calm, queued_decode_requests=1)
        assert rule.reason(busy) == policy.decode_pressure(busy) is not None
        assert rule.reason(calm) is policy.decode_pressure(calm) is None
        res = nodes.ledger.reserve(0, LeaseBudgets(64, 64, 0, 1, 1), cluster.live.sim.now_s)
        assert res is not None
        assert nodes.on_task_arrival(res.reservation_id, busy, cluster.live.sim.now_s) == "pause"
        assert nodes.on_task_arrival(res.reservation_id, calm, cluster.live.sim.now_s) == "run"


@pytest.mark.slow
def test_serve_run_s_stops_the_router_cleanly_with_streams_and_idle_connections_open() -> None:
    """``crossflow serve --router crossflow --run-s N`` ends while clients stream and keep idle
    connections: the streams end, the exit status is 0 and nothing is printed on stderr (no
    CancelledError traceback from the handlers it cancels)."""
    import re
    import subprocess
    import sys
    import threading

    serve = "serve --emulate 1P2D --port 0 --router crossflow --policy heuristic --time-scale 4 --run-s 5"
    command = [sys.executable, "-m", "train.cli", *serve.split()]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = None
        for line in iter(proc.stdout.readline, ""):
            found = re.search(r"router\s+(http://127\.0\.0\.1:\d+)", line)
            url = found[1] if found else url
            if line.startswith("serving "):
                break
        assert url is not None
        ended: list[str] = []

        def stream() -> None:
            body = {"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 5000}, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/generate", json=body, timeout=30, trust_env=False) as r:
                    for _ in r.iter_lines():
                        pass
                ended.append("ended")
            except httpx.HTTPError as exc:
                ended.append(type(exc).__name__)

        clients = [threading.Thread(target=stream) for _ in range(3)]
        for t in clients:
            t.start()
        with _client() as idle:  # an idle keep-alive connection to the router and one to a worker
            assert idle.get(f"{url}/health").status_code == 200
            assert idle.get(f"{url}/v1/models").status_code == 200
            _, err = proc.communicate(timeout=60)
        for t in clients:
            t.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert len(ended) == 3, "every stream ended"
    assert err == "", err


def test_an_agent_reads_again_so_that_its_state_lands_just_before_the_control_interval() -> None:
    """``next_read_in_s``: the report interval, unless the router's next control interval comes
    sooner than the read after that could land ahead of it; then the read starts two round trips
    (and a millisecond) before the interval, unless that is sooner than ``MIN_REPORT_INTERVAL_WALL_S``
    (10 ms; the read just made is then the interval's). Nonsense in the answer leaves the report
    interval."""
    from serving.lease_agent import TICK_LEAD_MIN_S, next_read_in_s

    assert next_read_in_s(0.125, {}, 0.01) == 0.125
    assert next_read_in_s(0.125, {"next_control_in_s": 0.3}, 0.01) == 0.125, "another read comes first"
    assert next_read_in_s(0.125, {"next_control_in_s": 0.1}, 0.01) == pytest.approx(
        0.1 - 0.02 - TICK_LEAD_MIN_S
    )
    assert next_read_in_s(0.125, {"next_control_in_s": 0.011}, 0.0005) == 0.125, "the read just made is it"
    assert next_read_in_s(0.125, {"next_control_in_s": 0.015}, 0.01) == 0.125, "too late for this one"
    for bad in (None, True, "0.1", float("nan"), float("inf")):
        assert next_read_in_s(0.125, {"next_control_in_s": bad}, 0.01) == 0.125


def test_control_intervals_run_on_states_read_just_before_them() -> None:
    """Each report's answer says how far ahead (wall seconds) the router's next control interval
    is, and the agents read once more so that their state lands just before it: an interval runs on
    states a few milliseconds old, as the simulator's ticks read each node at the tick, not on
    states up to a report interval old (a quarter of a control interval: a median age of about an
    eighth). The router also tells where its first request fell on its control grid."""
    from serving.stack import REPORTS_PER_INTERVAL

    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=2)
    scheduler = build_scheduler("utilisation", config, cm)
    with (
        _stack(config, scale=2.0, scheduler=scheduler, estimator=ClusterEstimator(config, cm)) as (
            _,
            _,
            stack,
        ),
        _client() as c,
    ):
        router = stack.router
        assert router.control_phase_s() is None, "no request yet"
        ages: list[float] = []
        original = scheduler.on_control_interval

        def noted(now_s: float, states: Sequence[NodeState]) -> list[int]:
            ages.extend(now_s - read_s for _, read_s in router._reports.values())
            return original(now_s, states)

        scheduler.on_control_interval = noted  # type: ignore[method-assign]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(ages) < 2 * 6:
            time.sleep(0.05)
        auth = {"authorization": f"Bearer {router.control_token}"}
        state = NodeState(0, 0.0, 0, 0.0, 0.0, 0.0, 1000, 0, 0, 0, 0, 0, 0.0, 0.0, 8).to_dict()
        answer = c.post(
            router.control_url + NODE_STATE_PATH, json={"node_id": 0, "node_state": state}, headers=auth
        )
        body = {"input_ids": list(range(100, 164)), "sampling_params": {"max_new_tokens": 2}}
        assert c.post(f"{router.url}/generate", json=body).status_code == 200
        phase = router.control_phase_s()
    assert len(ages) >= 2 * 6
    report_interval_s = config.control_interval_s / REPORTS_PER_INTERVAL  # emulated, as the ages
    assert sorted(ages[2:])[len(ages[2:]) // 2] < report_interval_s / 4, ages
    assert 0.0 < answer.json()["next_control_in_s"] <= 2.0 * config.control_interval_s  # wall seconds
    assert phase is not None and 0.0 <= phase < config.control_interval_s


def test_a_borrowed_request_counts_as_arrived_only_in_a_report_read_after_it_was_sent() -> None:
    """The node's next lease adds back what a borrowed request holds as work the node's state shows
    (``ClusterScheduler.on_task_arrival``); a lease agent's report read before the request reached
    the node cannot show it, so the router tells the scheduler only with the first report read after
    it was sent (``state_age_s``: how long before the post the agent began reading)."""
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1)
    arrivals: list[tuple[int, float]] = []

    class Noted(BorrowMarked):
        def on_task_arrival(self, reservation_id: int, state: Any, now_s: float) -> str:
            arrivals.append((reservation_id, now_s))
            return "run"

    scheduler = Noted()
    worker_side = build_scheduler("utilisation", config, cm)
    with (
        _stack(
            config, worker_scheduler=worker_side, scheduler=scheduler, estimator=ClusterEstimator(config, cm)
        ) as (background, _, stack),
        _client() as c,
    ):
        router = stack.router
        for agent in stack.agents:
            _on(background, agent.stop())  # the test posts the reports itself
        auth = {"authorization": f"Bearer {router.control_token}"}
        route = router.control_url + NODE_STATE_PATH
        state = NodeState(0, 0.0, 0, 0.0, 0.0, 0.0, 10**6, 0, 0, 0, 0, 0, 0.0, 0.0, 8).to_dict()

        def report(age_s: float | str | bool | None) -> Any:
            return c.post(route, json={"node_id": 0, "node_state": state, "state_age_s": age_s}, headers=auth)

        for bad in (-1.0, "0.1", True, None):
            answer = report(bad)
            assert answer.status_code == 400 and "state_age_s" in answer.json()["error"]["message"]
        body = {
            "input_ids": list(range(100, 100 + BORROW_TOKENS)),
            "sampling_params": {"max_new_tokens": 400},
        }
        with c.stream("POST", f"{router.url}/generate", json={**body, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # borrowed and streaming
            sent_s = router.now_s()
            assert arrivals == [] and scheduler.ledger.active_ids(0), "in flight, no report since"
            assert report(60.0).status_code == 200  # read a minute ago: before the request was sent
            assert arrivals == []
            assert report(0.0).status_code == 200  # read now: it shows the request
            assert [rid for rid, _ in arrivals] == scheduler.ledger.active_ids(0)
            assert arrivals[0][1] >= sent_s - 1.0
            assert report(0.0).status_code == 200
            assert len(arrivals) == 1, "told once"
            for _ in lines:
                pass
        assert report(0.0).status_code == 200 and len(arrivals) == 1, "a finished request is never told"


def test_a_borrowed_request_the_node_reports_started_commits_before_its_first_token() -> None:
    """The simulator commits a borrowed reservation the moment its node starts the prefill, so a
    revocation at a later control interval leaves it be. The router learns of the start from the
    node's report (``started_borrowed``: the request ids whose prefill has begun there, from the same
    ``/server_info`` read as the state) and commits then, not at the first token; a revocation in
    between would otherwise hand back, in its ledger, room the node goes on spending."""
    cm = CostModel(*MODEL)
    config = ClusterConfig(n_prefill=1, n_decode=1)
    scheduler = BorrowMarked()
    scheduler.borrow_tokens = 4000
    worker_side = build_scheduler("utilisation", config, cm)
    with (
        _stack(
            config,
            scale=8.0,
            worker_scheduler=worker_side,
            scheduler=scheduler,
            estimator=ClusterEstimator(config, cm),
        ) as (background, cluster, stack),
        _client() as c,
    ):
        router = stack.router
        for agent in stack.agents:
            _on(background, agent.stop())  # the test posts the reports itself
        auth = {"authorization": f"Bearer {router.control_token}"}
        route = router.control_url + NODE_STATE_PATH
        state = NodeState(0, 0.0, 0, 0.0, 0.0, 0.0, 10**6, 0, 0, 0, 0, 0, 0.0, 0.0, 8).to_dict()

        def report(started: Any) -> Any:
            body = {"node_id": 0, "node_state": state, "state_age_s": 0.0, "started_borrowed": started}
            return c.post(route, json=body, headers=auth)

        for bad in ("r1", [1], {"r": 1}):
            answer = report(bad)
            assert answer.status_code == 400 and "started_borrowed" in answer.json()["error"]["message"]
        first_token_s: list[float] = []
        body = {
            "input_ids": list(range(100, 4100)),
            "sampling_params": {"max_new_tokens": 40},
            "stream": True,
        }

        def client() -> None:
            with (
                httpx.Client(trust_env=False, timeout=60.0) as c2,
                c2.stream("POST", f"{router.url}/generate", json=body) as resp,
            ):
                for line in resp.iter_lines():
                    if line.startswith("data:") and not first_token_s:
                        first_token_s.append(time.perf_counter())

        thread = threading.Thread(target=client)
        thread.start()
        try:
            info_url = cluster.decode_urls[0] + "/server_info"
            deadline = time.perf_counter() + 30.0
            started: list[str] = []
            while not started and time.perf_counter() < deadline:
                started = c.get(info_url).json()["internal_states"][0]["crossflow"]["started_borrowed"]
                time.sleep(0.02)
            assert started, "the node never reported the borrowed prefill begun"

            async def agent_read() -> list[str]:  # what the lease agent would post
                upstream = UpstreamClient(timeout_s=5.0)
                try:
                    await stack.agents[0].read_state(upstream)
                finally:
                    await upstream.aclose()
                return stack.agents[0].started_borrowed

            assert _on(background, agent_read()) == started
            (res,) = scheduler.ledger.active_ids(0)
            assert scheduler.ledger.status(res) == "reserved" and scheduler.calls == []
            assert report([]).status_code == 200 and scheduler.ledger.status(res) == "reserved"
            assert report(started).status_code == 200
            assert not first_token_s, "the prefill ended before the test could report it begun"
            assert scheduler.ledger.status(res) == "committed" and scheduler.calls == ["started"]
            assert scheduler.ledger.revoke(0, router.now_s()) == [], "a started reservation is not revoked"
            assert report(started).status_code == 200 and scheduler.calls == ["started"], "committed once"
        finally:
            thread.join(timeout=60)
        assert first_token_s and scheduler.calls == ["started", "prefill_done", "finished"]
        assert scheduler.ledger.active_ids(0) == []

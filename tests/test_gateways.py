"""``serving.gateways``: command lines, and the real smg and sglang-router routing a replay to emulated
workers on loopback (skipped with a reason when a gateway is not installed)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

pytest.importorskip("httpx")

from envs.cost_model import CostModel
from envs.request import Request, Trace
from serving.emulated_worker import BackgroundWorker, EmulatedWorker
from serving.gateways import (
    Gateway,
    GatewaySpec,
    blocked_egress_env,
    gateway_command,
    missing_reason,
)
from serving.replay import PromptTokens, ReplayConfig, replay

MODEL = ("H200", "gpt-oss-120b", 1)


class RecordingWorker(EmulatedWorker):
    """An emulated worker that keeps every ``/generate`` body it was sent (a test's view of routing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bodies: list[dict[str, Any]] = []

    async def _generate(self, payload: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        self.bodies.append(payload)
        await super()._generate(payload, writer)


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_regular_and_pd_command_lines() -> None:
    spec = GatewaySpec("smg", workers=("http://127.0.0.1:1", "http://127.0.0.1:2"), policy="round_robin")
    cmd = gateway_command(spec, 4000, python="py", metrics_port=4100)
    assert cmd == [
        "py", "-m", "smg", "launch", "--host", "127.0.0.1", "--port", "4000",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "4100", "--policy", "round_robin",
        "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2",
    ]  # fmt: skip
    pd = GatewaySpec(
        "sglang-router",
        prefill=(("http://127.0.0.1:1", 8998), ("http://127.0.0.1:2", None)),
        decode=("http://127.0.0.1:3",),
        decode_policy="power_of_two",
        extra_args=("--cache-threshold", "0.5"),
    )
    assert gateway_command(pd, 4001, python="py", metrics_port=4101) == [
        "py", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "4001",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "4101",
        "--policy", "cache_aware", "--pd-disaggregation",
        "--prefill", "http://127.0.0.1:1", "8998", "--prefill", "http://127.0.0.1:2", "none",
        "--decode", "http://127.0.0.1:3", "--decode-policy", "power_of_two", "--cache-threshold", "0.5",
    ]  # fmt: skip


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="either workers"):
        GatewaySpec("smg")
    with pytest.raises(ValueError, match="either workers"):
        GatewaySpec("smg", workers=("u",), decode=("d",))
    with pytest.raises(ValueError, match="at least one prefill"):
        GatewaySpec("smg", decode=("d",))
    with pytest.raises(ValueError, match="unknown policy"):
        GatewaySpec("smg", workers=("u",), policy="fastest")
    assert GatewaySpec("smg", workers=("u",), policy="least_load").policy == "least_load"
    with pytest.raises(ValueError, match="unknown policy 'least_load'"):
        GatewaySpec("sglang-router", workers=("u",), policy="least_load")
    assert GatewaySpec("smg", prefill=(("p", None),), decode=("d",), prefill_policy="bucket").pd
    with pytest.raises(ValueError, match="unknown policy 'bucket'"):
        GatewaySpec("smg", prefill=(("p", None),), decode=("d",), decode_policy="bucket")
    with pytest.raises(ValueError, match="unknown gateway"):
        GatewaySpec("nginx", workers=("u",))  # type: ignore[arg-type]


def test_blocked_egress_env_keeps_loopback_direct() -> None:
    env = blocked_egress_env({"PATH": "/bin", "HTTPS_PROXY": "http://corp:3128"}, 9)
    assert env["PATH"] == "/bin"
    assert env["HTTPS_PROXY"] == env["https_proxy"] == env["HTTP_PROXY"] == "http://127.0.0.1:9"
    assert "127.0.0.1" in env["NO_PROXY"].split(",") and env["HF_HUB_OFFLINE"] == "1"


def _skip_if_missing(kind: str) -> None:
    reason = missing_reason(kind)  # type: ignore[arg-type]
    if reason is not None:
        pytest.skip(reason)


def _conversations(n: int, turns: int, input_tokens: int, gap_s: float) -> Trace:
    """``n`` conversations of ``turns`` turns, each turn extending the previous one's prompt."""
    reqs: list[Request] = []
    for turn in range(turns):
        for c in range(n):
            rid = len(reqs)
            parent = rid - n if turn else -1
            tokens = input_tokens + 50 * turn
            shared = input_tokens + 50 * (turn - 1) if turn else 0
            reqs.append(Request(rid, c, turn, rid * gap_s, tokens, 4, parent, shared))
    return Trace("conversations", reqs)


@pytest.mark.parametrize("kind", ["smg", "sglang-router"])
def test_real_gateway_routes_a_replay_to_emulated_workers(kind: str) -> None:
    _skip_if_missing(kind)
    cm = CostModel(*MODEL)
    trace = _conversations(3, 3, 600, gap_s=0.05)
    with (
        BackgroundWorker(RecordingWorker(cm)) as w1,
        BackgroundWorker(RecordingWorker(cm)) as w2,
    ):
        spec = GatewaySpec(kind, workers=(w1.url, w2.url), policy="cache_aware")  # type: ignore[arg-type]
        gateway = Gateway(spec, stop_grace_s=1.0)  # smg drains for 5 s on SIGTERM; no need here
        with gateway:
            assert gateway.pid is not None
            result = replay(trace, ReplayConfig(url=gateway.url, timeout_s=60))
            port = gateway.port
        assert gateway.process is not None and gateway.process.returncode is not None
        assert _port_closed(port), "the gateway is gone once stopped"
    assert result.metrics["n_finished"] == len(trace.requests)
    assert all(r.completion_tokens == 4 for r in result.records)
    assert len(w1.bodies) + len(w2.bodies) == len(trace.requests)
    sent = {tuple(b["input_ids"]) for b in w1.bodies + w2.bodies}
    assert len(sent) == len(trace.requests), "the gateway forwards each prompt's token ids untouched"
    if kind == "smg":
        # smg's cache_aware matches the prompt's text form (ids joined by spaces), so every turn of a
        # conversation follows its first turn to the same worker
        prompts = PromptTokens(trace.requests)
        conversation_of = {tuple(prompts.ids(r.request_id)[:8]): r.session_id for r in trace.requests}
        home: dict[int, set[int]] = {}
        for worker in (w1, w2):
            for body in worker.bodies:
                home.setdefault(conversation_of[tuple(body["input_ids"][:8])], set()).add(worker.port)
        assert len(home) == 3 and all(len(ports) == 1 for ports in home.values()), home


def test_smg_pd_mode_dispatches_both_legs_with_bootstrap_fields() -> None:
    _skip_if_missing("smg")
    cm = CostModel(*MODEL)
    trace = Trace("pd", [Request(i, -1, 0, 0.02 * i, 300, 5) for i in range(4)])
    with BackgroundWorker(RecordingWorker(cm)) as prefill, BackgroundWorker(RecordingWorker(cm)) as decode:
        spec = GatewaySpec("smg", prefill=((prefill.url, 8998),), decode=(decode.url,))
        with Gateway(spec, stop_grace_s=1.0) as gateway:
            result = replay(trace, ReplayConfig(url=gateway.url, timeout_s=60))
    assert result.metrics["n_finished"] == 4
    assert len(prefill.bodies) == len(decode.bodies) == 4
    rooms = set()
    for p_body, d_body in zip(prefill.bodies, decode.bodies, strict=True):
        for body in (p_body, d_body):
            assert body["bootstrap_host"] == "127.0.0.1" and body["bootstrap_port"] == 8998
            assert 0 <= body["bootstrap_room"] < 2**63
        rooms.add(p_body["bootstrap_room"])
    assert {b["bootstrap_room"] for b in decode.bodies} == rooms and len(rooms) == 4, "a fresh room each"


def test_a_gateway_that_cannot_start_reports_its_log() -> None:
    _skip_if_missing("smg")
    spec = GatewaySpec("smg", workers=("http://127.0.0.1:1",), extra_args=("--no-such-flag",))
    gateway = Gateway(spec)
    with pytest.raises(RuntimeError, match="exited with status"):
        gateway.start(timeout_s=30)
    assert gateway.process is not None and gateway.process.returncode is not None


def test_gateway_command_line_starts_and_stops_one(capsys: pytest.CaptureFixture[str]) -> None:
    from serving.gateways import main

    with pytest.raises(SystemExit) as exc:
        main(["smg"])  # neither workers nor PD workers
    assert exc.value.code == 2 and "either workers" in capsys.readouterr().err
    _skip_if_missing("sglang-router")
    with BackgroundWorker(EmulatedWorker(CostModel(*MODEL))) as worker:
        assert main(["sglang-router", "--worker-urls", worker.url, "--run-s", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "sglang-router ready at http://127.0.0.1:" in out and "exited with status 0" in out

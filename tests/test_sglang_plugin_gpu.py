"""The prepared GPU check of the SGLang plugin (benchmarks/gpu/sglang_plugin_check.py): its commands,
its checks and its borrow-all forwarder on CPU; the check itself on a GPU (``gpu``: ``--run-gpu`` and
``CROSSFLOW_SGLANG_MODEL``, a model on local disk)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

from serving.sglang_plugin import wire

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "sglang_plugin_check.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_plugin_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_plugin_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_commands_start_a_decode_worker_with_the_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    check = _script()
    assert check.main(["--model", "/models/m", "--print-commands", "--mixed-chunk"]) == 0
    printed = capsys.readouterr().out
    decode = next(line for line in printed.splitlines() if "--disaggregation-mode decode" in line)
    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "crossflow"]
    assert decode.startswith(f"SGLANG_PLUGINS={ep.name} CROSSFLOW_NODE_ID=0 python -m sglang.launch_server")
    for flag in ("--disable-overlap-schedule", "--enable-metrics", "--enable-mixed-chunk", "--port 31001"):
        assert flag in decode
    prefill = next(line for line in printed.splitlines() if "--disaggregation-mode prefill" in line)
    assert "--disaggregation-bootstrap-port 31998" in prefill and "SGLANG_PLUGINS" not in prefill
    assert printed.count("python -m train.cli replay") == 2


def _replay(requests: list[dict[str, Any]], timed_out: bool = False) -> dict[str, Any]:
    return {"timed_out": timed_out, "requests": requests, "metrics": {}}


def _request(rid: int, *, tokens: int = 5, output: int = 5, status: int = 200) -> dict[str, Any]:
    return {
        "request_id": rid,
        "send_s": 0.1 * rid,
        "finish_s": 1.0 if status == 200 else None,
        "output_tokens": output,
        "completion_tokens": tokens,
        "status": status,
        "rejected": status != 200,
        "error": None if status == 200 else "aborted: crossflow: no live lease",
    }


def test_the_checks_catch_what_must_not_happen() -> None:
    check = _script()
    good = _replay([_request(0), _request(1), {**_request(2), "send_s": None}])
    assert check.check_replay("borrowed", good, 2) == []
    bad = _replay([_request(0, tokens=4), _request(1, status=503)], timed_out=True)
    problems = check.check_replay("borrowed", bad, 3)
    assert any("2 requests sent, expected 3" in p for p in problems)
    assert any("request 0 gave 4 tokens, the trace has 5" in p for p in problems)
    assert any("request 1 refused (503" in p for p in problems)
    assert any("timed out" in p for p in problems)
    state = {
        "disabled": None,
        "counters": {"admitted": 2, "started": 2, "finished": 2, "local_prefill_tokens": 900, "leases": 1},
        "queued": 0,
        "started": 0,
        "held": {"kv_tokens": 0},
    }
    assert check.check_plugin(state, 2) == []
    capped = {**state, "chunk_limited": True, "largest_step_beside_decode_tokens": 256}
    assert check.check_plugin(capped, 2, 256) == []
    assert any(
        "over the 256 cap" in p
        for p in check.check_plugin({**capped, "largest_step_beside_decode_tokens": 300}, 2, 256)
    )
    assert any("carries no chunk limits" in p for p in check.check_plugin(state, 2, 256))
    limits = check.uniform_chunk_limits(256)
    assert limits.limit(1, 0) == limits.limit(4096, 10**9) == 256 and limits.limit(0, 0) is None
    worse = {**state, "counters": {**state["counters"], "finished": 1, "overspent_tokens": 3}}
    problems = check.check_plugin(worse, 2)
    assert any("finished 1 borrowed requests, expected 2" in p for p in problems)
    assert any("3 overspent_tokens" in p for p in problems)
    metrics = (
        "# TYPE sglang:num_retracted_requests_total counter\n"
        'sglang:num_retracted_requests_total{model_name="m",tp_rank="0"} 0.0\n'
        'sglang:num_retracted_requests_total{model_name="m",tp_rank="1"} 2.0\n'
    )
    assert check.retractions(metrics) == 2.0
    assert check.check_retractions(metrics) == ["the decode worker retracted 2 requests"]
    assert check.check_retractions("") == [
        "sglang:num_retracted_requests_total missing from the decode worker's /metrics"
    ]


class _Recorder(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict[str, Any]]] = []
    protocol_version = "HTTP/1.0"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in (1, 2, 3):
            self.wfile.write(f'data: {{"meta_info": {{"completion_tokens": {k}}}}}\n\n'.encode())
        self.wfile.write(b"data: [DONE]\n\n")


def test_the_forwarder_marks_every_request_and_streams_the_answer_back() -> None:
    import httpx

    check = _script()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        decode_url = f"http://127.0.0.1:{server.server_address[1]}"
        with check.BorrowForwarder(decode_url, "127.0.0.1", 31998) as forwarder:
            for _ in range(2):
                with httpx.stream(
                    "POST",
                    f"{forwarder.url}/generate",
                    json={"input_ids": [1, 2], "stream": True},
                    trust_env=False,
                ) as resp:
                    lines = [line for line in resp.iter_lines() if line]
                assert resp.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) == 4
    finally:
        server.shutdown()
        server.server_close()
    first, second = _Recorder.bodies[-2:]
    assert wire.requests_local_prefill(json.dumps(first))
    assert first["input_ids"] == [1, 2] and first["bootstrap_port"] == 31998
    assert first["bootstrap_host"] == "127.0.0.1" and 0 <= first["bootstrap_room"] < 2**63
    assert first["bootstrap_room"] != second["bootstrap_room"], "a fresh room per request"


@pytest.mark.gpu
def test_the_plugin_on_real_sglang(tmp_path: Path) -> None:
    model = os.environ.get("CROSSFLOW_SGLANG_MODEL")
    if not model:
        pytest.skip("set CROSSFLOW_SGLANG_MODEL to a model on local disk")
    check = _script()
    assert check.main(["--model", model, "--out", str(tmp_path)]) == 0, (tmp_path / "report.json").read_text()

"""The real profiler against the emulated SGLang worker (loopback), and against real SGLang on a GPU."""

from __future__ import annotations

import os

import httpx
import pytest

from envs.cost_model import CostModel
from interference_model.schema import validate_profiles
from serving.emulated_worker import BackgroundWorker, EmulatedWorker
from serving.profiler import RealProfileConfig, run_profile

SCALE = 3.0  # slow the emulated GPU down so event-loop jitter is small against an iteration


@pytest.fixture(scope="module")
def worker() -> EmulatedWorker:
    cm = CostModel("H200", "gpt-oss-120b", 1)
    with BackgroundWorker(EmulatedWorker(cm, time_scale=SCALE)) as w:
        yield w  # type: ignore[misc]


def test_emulated_worker_speaks_generate(worker: EmulatedWorker) -> None:
    info = httpx.get(f"{worker.url}/get_server_info", timeout=10).json()
    assert info["max_total_num_tokens"] == worker.cm.kv_capacity_tokens
    body = {"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 3}}
    out = httpx.post(f"{worker.url}/generate", json=body, timeout=10).json()
    assert out["meta_info"]["completion_tokens"] == 3 and out["meta_info"]["prompt_tokens"] == 100
    lines: list[str] = []
    with httpx.stream("POST", f"{worker.url}/generate", json={**body, "stream": True}, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(lines) == 4 and lines[-1] == "data: [DONE]"
    bad = httpx.post(f"{worker.url}/generate", json={"sampling_params": {}}, timeout=10)
    assert bad.status_code == 400 and "input_ids" in bad.json()["error"]


def test_real_profiler_recovers_the_emulated_timing(worker: EmulatedWorker) -> None:
    cfg = RealProfileConfig(
        url=worker.url,
        hardware="H200",
        model="gpt-oss-120b",
        batch_sizes=(2, 8),
        context_tokens=(2048,),
        chunk_tokens=(512, 4096),
        repeats=2,
        seed=3,
    )
    df = run_profile(cfg)
    validate_profiles(df)  # the schema the fitter reads
    assert set(df["source"]) == {"sglang"} and df["state_id"].nunique() == 2
    cm = worker.cm
    for batch, rows in df.groupby("decode_batch_size"):
        ctx = int(batch) * 2048
        expect_decode = cm.decode_step_time_s(int(batch), ctx) * SCALE
        assert rows["decode_only_time_s"].median() == pytest.approx(expect_decode, rel=0.35)
        big = rows[rows["chunk_tokens"] == 4096]["iteration_time_s"].median()
        small = rows[rows["chunk_tokens"] == 512]["iteration_time_s"].median()
        assert big == pytest.approx(cm.iteration_time_s([(4096, 0)], int(batch), ctx) * SCALE, rel=0.35)
        assert big > small > rows["decode_only_time_s"].median()


@pytest.mark.gpu
def test_real_profiler_on_sglang() -> None:
    """Needs a running SGLang worker: set CROSSFLOW_SGLANG_URL, CROSSFLOW_GPU and CROSSFLOW_MODEL."""
    url = os.environ.get("CROSSFLOW_SGLANG_URL")
    if not url:
        pytest.skip("CROSSFLOW_SGLANG_URL is not set")
    cfg = RealProfileConfig(
        url=url,
        hardware=os.environ.get("CROSSFLOW_GPU", "H100"),
        model=os.environ.get("CROSSFLOW_MODEL", "unknown"),
        batch_sizes=(1, 16),
        context_tokens=(2048,),
        chunk_tokens=(512, 2048),
        repeats=2,
    )
    df = run_profile(cfg)
    assert (df["iteration_time_s"] >= df["decode_only_time_s"] * 0.9).all()


def test_emulated_worker_serves_current_and_legacy_info_routes(worker: EmulatedWorker) -> None:
    for path in ("/server_info", "/get_server_info"):
        assert httpx.get(f"{worker.url}{path}", timeout=10).json()["chunked_prefill_size"] == 8192
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(f"{worker.url}{path}", timeout=10).json()["model_path"] == "gpt-oss-120b"
    assert httpx.get(f"{worker.url}/no/such/route", timeout=10).status_code == 404

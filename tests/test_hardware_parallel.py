"""Precision and parallelism in the cost model: an FP8 step and the EP all-to-all by hand, the checks."""

from __future__ import annotations

import numpy as np
import pytest

from envs.cost_model import (
    DEFAULT_ITERATION_OVERHEAD_S,
    CostModel,
    ParallelismError,
    all_to_all_time_s,
    check_parallelism,
    weight_bytes,
    weight_params,
)
from envs.hardware import SettingError, get_gpu, get_model, with_knobs
from envs.models import resolve_model, with_precision
from train.cli import main


def test_fp8_decode_step_by_hand() -> None:
    """Llama-3.1-8B-FP8 on one H100, one request with 8192 tokens of context (every GEMM weight-bound)."""
    gpu = get_gpu("H100")
    cm = CostModel(gpu, "Llama-3.1-8B-FP8")
    weight_read_bw = gpu.hbm_bytes_per_s * gpu.memory_efficiency

    def gemm(k: int, n: int, bytes_per_weight: float) -> float:  # one row: memory-bound
        return gpu.kernel_launch_s + (k * n * bytes_per_weight + (k + n) * 2) / weight_read_bw

    # FP8 (1 byte) projections: QKV 4096 -> (32 + 2 x 8) x 128, O, gate+up 2 x 14336, down.
    layer = gemm(4096, 6144, 1) + gemm(4096, 4096, 1) + gemm(4096, 28672, 1) + gemm(14336, 4096, 1)
    # Norms, rotary on 32 + 8 heads, SiLU-and-mul over 14336, residual: BF16 bytes for the one token.
    elementwise_bytes = (4 * 4096 + 2 * 40 * 128 + 3 * 14336 + 3 * 4096) * 2
    layer += gpu.elementwise_launch_s + elementwise_bytes / (
        gpu.hbm_bytes_per_s * gpu.elementwise_memory_efficiency
    )
    lm_head = gemm(4096, 128256, 2)  # BF16: the FP8 checkpoint keeps the LM head unquantised
    # Decode attention: 8192 tokens x (K + V) x 8 heads x 128 x 2 bytes (BF16 KV) per layer, read-bound.
    kv_read = 8192 * 2 * 8 * 128 * 2 / (gpu.hbm_bytes_per_s * gpu.attention_decode_memory_efficiency)
    attention = gpu.attention_decode_launch_s + gpu.attention_decode_per_request_s + kv_read
    by_hand = 32 * (layer + attention) + lm_head + DEFAULT_ITERATION_OVERHEAD_S
    assert cm.decode_step_time_s(1, 8192) == pytest.approx(by_hand, rel=1e-12)
    assert 4.5e-3 < by_hand < 6.5e-3
    # The same step in BF16 reads twice the projection bytes; an FP8 KV cache halves the KV read.
    bf16 = CostModel(gpu, "Llama-3.1-8B").decode_step_time_s(1, 8192)
    assert bf16 - by_hand == pytest.approx(
        32 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) / weight_read_bw, rel=1e-9
    )
    fp8_kv = CostModel(gpu, with_precision(cm.model, gpu, kv_dtype="fp8"))
    assert by_hand - fp8_kv.decode_step_time_s(1, 8192) == pytest.approx(32 * kv_read / 2, rel=1e-9)
    assert fp8_kv.kv_bytes_per_token == cm.kv_bytes_per_token // 2


def test_all_to_all_by_hand() -> None:
    """EP16 over two 8-GPU H200 nodes: 7/16 of the copies over NVLink, 8/16 over the NIC, in parallel."""
    gpu = get_gpu("H200")
    token = 7168  # bytes of one FP8 hidden state of DeepSeek-V3
    nvlink_s = 128 * 8 * token * 7 / 16 / (450e9 * 0.77)
    rdma_s = 128 * 8 * token * 8 / 16 / 50e9
    assert rdma_s > nvlink_s
    assert all_to_all_time_s(gpu, np.array([128.0]), token, 8, 16)[0] == pytest.approx(5e-5 + rdma_s)
    # DeepEP's published low-latency figures for this case (H800, CX7): 118 us dispatch, 195 us combine.
    assert 1e6 * (5e-5 + rdma_s) == pytest.approx(123, abs=1)
    # The high-throughput kernel sends a token once to the other node if any of its 8 experts is there.
    once = 128 * (1 - 0.5**8) * token / 50e9
    assert all_to_all_time_s(gpu, np.array([128.0]), token, 8, 16, per_node=True)[0] == pytest.approx(
        5e-5 + max(once, nvlink_s)
    )
    # Inside one node everything but the local share crosses NVLink.
    assert all_to_all_time_s(gpu, np.array([128.0]), token, 8, 8)[0] == pytest.approx(
        5e-5 + 128 * 8 * token * 7 / 8 / (450e9 * 0.77)
    )
    assert all_to_all_time_s(gpu, np.array([128.0]), token, 8, 1)[0] == 0.0
    assert all_to_all_time_s(gpu, np.array([0.0]), token, 8, 16)[0] == 0.0
    # GB300: 72 GPUs in one NVLink domain, so EP72 never touches the NIC.
    gb = get_gpu("GB300")
    assert all_to_all_time_s(gb, np.array([128.0]), token, 8, 72)[0] == pytest.approx(
        gb.all_to_all_latency_s + 128 * 8 * token * 71 / 72 / (900e9 * 0.77)
    )


def test_ep_layer_communication_by_hand() -> None:
    """DeepSeek-V3 on 16 H200 with DP attention: each MoE layer is one FP8 dispatch + one BF16 combine."""
    cm = CostModel("H200", "DeepSeek-V3", 16, ep=16, dp_attention=16)
    tokens = 16 * 128  # 128 tokens on every GPU
    dispatch = 5e-5 + 128 * 8 * 7168 * 1 * 8 / 16 / 50e9
    combine = 5e-5 + 128 * 8 * 7168 * 2 * 8 / 16 / 50e9
    decode = cm.moe_communication_s(np.array([float(tokens)]), prefill=False)[0]
    assert decode == pytest.approx(58 * (dispatch + combine))
    # Attention runs on one GPU per replica (no all-reduce), so against a free interconnect the decode
    # step costs exactly that more; a prefill iteration pays the per-node kernel's time instead.
    free = with_knobs(cm.gpu, all_to_all_latency_s=0.0, scale_out_gb_per_s=1e15, nvlink_gb_per_s=1e15)
    ideal = CostModel(free, "DeepSeek-V3", 16, ep=16, dp_attention=16)
    step = cm.decode_step_time_s(tokens, tokens * 2000) - ideal.decode_step_time_s(tokens, tokens * 2000)
    assert step == pytest.approx(decode, rel=1e-6)
    per_node = 2 * 5e-5 + 128 * (1 - 0.5**8) * 7168 * (1 + 2) / 50e9
    prefill = cm.iteration_time_s([(128, 0)] * 16) - ideal.iteration_time_s([(128, 0)] * 16)
    assert prefill == pytest.approx(58 * per_node, rel=1e-6)
    big = 4 * 16384  # past the tabulated token counts: the exact path adds the same terms
    assert cm.iteration_time_s([(big, 0)]) - ideal.iteration_time_s([(big, 0)]) == pytest.approx(
        float(cm.moe_communication_s(np.array([float(big)]), prefill=True)[0]), rel=1e-6
    )
    assert CostModel("H200", "DeepSeek-V3", 8).moe_communication_s(np.array([1024.0]), prefill=True)[0] == 0.0


def test_dp_attention_stores_each_latent_once_and_replicates_dense_weights() -> None:
    tp8 = CostModel("H200", "DeepSeek-V3", 8)
    dp8 = CostModel("H200", "DeepSeek-V3", 8, ep=8, dp_attention=8)
    assert tp8.kv_bytes_per_token == 8 * dp8.kv_bytes_per_token == 8 * (512 + 64) * 2 * 61
    params = weight_params(dp8.model)
    replicated = (params["dense_ffn"] + params["shared_experts"] + params["attention"]) * 1.0 + (
        params["router"] + params["embeddings"]
    ) * 2.0
    assert dp8.weight_bytes == pytest.approx(params["routed_experts"] + 8 * replicated)
    assert dp8.kv_capacity_tokens > 4 * tp8.kv_capacity_tokens  # latent once, despite 8 attention copies
    # 256 experts over 72 ranks: 4 slots each (32 redundant, as EPLB places them).
    assert weight_bytes(dp8.model, ep=72) == pytest.approx(
        params["routed_experts"] * 288 / 256 + replicated, rel=1e-12
    )


def test_ep_without_dp_attention_keeps_the_allreduce_and_memory() -> None:
    tp = CostModel("H200", "Qwen3-30B-A3B", 4)
    ep = CostModel("H200", "Qwen3-30B-A3B", 4, ep=4)
    assert ep.weight_bytes == tp.weight_bytes and ep.kv_capacity_tokens == tp.kv_capacity_tokens
    # Whole experts on fewer GPUs: more rows per expert GEMM in prefill, so EP is no slower there.
    assert ep.iteration_time_s(((8192, 0),)) <= tp.iteration_time_s(((8192, 0),)) * 1.001


@pytest.mark.parametrize(
    ("model", "tp", "ep", "dp", "field"),
    [
        ("gpt-oss-120b", 3, 1, 1, "tp"),  # 64 query heads
        ("Llama-3.1-70B", 16, 1, 1, "tp"),  # two nodes of tensor-parallel attention
        ("Llama-3.1-8B", 12, 1, 1, "tp"),  # 8 KV heads neither split over nor replicate onto 12
        ("Llama-3.1-8B", 2, 2, 1, "ep"),  # dense model
        ("Qwen3-30B-A3B", 4, 3, 1, "ep"),  # does not divide tp
        ("DeepSeek-V3", 16, 16, 3, "dp_attention"),
        ("gpt-oss-120b", 0, 1, 1, "tp"),
    ],
)
def test_parallelism_is_checked(model: str, tp: int, ep: int, dp: int, field: str) -> None:
    with pytest.raises(ParallelismError) as err:
        check_parallelism(get_model(model), get_gpu("H200"), tp, ep, dp)
    assert err.value.field == field
    with pytest.raises(ParallelismError):
        CostModel("H200", model, tp, ep=ep, dp_attention=dp)


def test_dtype_needs_the_tensor_cores() -> None:
    with pytest.raises(SettingError, match="H200 has no FP4 tensor cores"):
        resolve_model("gpt-oss-120b", "H200", dtype="fp4")
    with pytest.raises(SettingError, match="A100 has no FP8 tensor cores"):
        resolve_model("Llama-3.1-8B", "A100", dtype="fp8")
    b200 = resolve_model("gpt-oss-120b", "B200", dtype="fp4")
    assert (b200.weight_precision, b200.dense_precision, b200.embedding_precision) == ("fp4", "fp4", "bf16")
    # Without --dtype a checkpoint's own precision runs weight-only where the path is missing.
    assert resolve_model("gpt-oss-120b", "H200").weight_precision == "fp4"


def test_cli_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in (
        (["--tp", "3"], "--tp 3: gpt-oss-120b's 64 query heads"),
        (["--dtype", "fp4"], "--dtype fp4: H200 has no FP4"),
        (["--model", "llama-3.1-8b", "--ep", "2"], "--ep 2:"),
        (["--model", "nope"], "--model: unknown model 'nope'"),
        (["--model", "missing/config.json"], "--model missing/config.json:"),
    ):
        assert main(["simulate", "--max-requests", "2", "--no-progress", *argv]) == 2
        assert flag in capsys.readouterr().err
    assert main(["profile", "--tp", "3", "--n-states", "2", "--out", "unused.parquet"]) == 2
    assert "--tp 3:" in capsys.readouterr().err


def test_simulate_takes_precision_and_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--trace", "mooncake", "--max-requests", "30", "--no-progress"]
    assert main([*argv, "--model", "Qwen3-30B-A3B", "--dtype", "fp8", "--kv-dtype", "fp8", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3-30B-A3B / H200 TP2, weights fp8 / KV fp8" in out and "30 / 30" in out
    assert main([*argv, "--model", "DeepSeek-V3", "--tp", "8", "--ep", "8", "--dp-attention", "8"]) == 0
    assert "DeepSeek-V3 / H200 TP8 EP8 DP-attention 8, weights fp8 / KV bf16" in capsys.readouterr().out


def test_compare_checks_precision_and_parallelism_before_simulating() -> None:
    from train.compare import GridSpec, check_names

    with pytest.raises(ValueError, match="--dtype fp4: H200 has no FP4"):
        check_names(GridSpec(policies=("static",), dtype="fp4"))
    with pytest.raises(ValueError, match=r"--ep 2: Llama-3\.1-8B is not an MoE model"):
        check_names(GridSpec(policies=("static",), models=("llama-3.1-8b",), ep=2))
    with pytest.raises(ValueError, match="--models: unknown model"):
        check_names(GridSpec(policies=("static",), models=("nope",)))
    check_names(GridSpec(policies=("static",), models=("Qwen3-30B-A3B-FP8",), kv_dtype="fp8"))


def test_vectorised_equals_scalar_with_dp_attention() -> None:
    cm = CostModel("H200", "DeepSeek-V3", 16, ep=16, dp_attention=16)
    new = np.array([0, 0, 512, 8192, 20000, 0, 3])
    cached = np.array([0, 0, 100, 0, 0, 0, 7])
    batch = np.array([0, 64, 0, 32, 0, 20000, 5])
    ctx = batch * 3000
    pairs = np.array([cm.prefill_attention_pairs(int(n), int(c)) for n, c in zip(new, cached, strict=True)])
    scalar = [
        cm.iteration_time_s(((int(n), int(c)),) if n else (), int(b), int(x))
        for n, c, b, x in zip(new, cached, batch, ctx, strict=True)
    ]
    np.testing.assert_allclose(cm.iteration_times_s(new, pairs, batch, ctx), scalar, rtol=1e-12)

"""The hardware cost model: the one source of iteration timing in the project.

An iteration is one forward pass of a worker (``tp`` GPUs running tensor parallel) over a batch that
mixes prefill chunks and decode requests. Its time is the sum of

* token-dependent work, a function of the batch's total token count ``T`` only: every linear layer as
  a roofline ``launch + max(flops / (peak * eff(M)), bytes / (hbm_bw * mem_eff))`` where ``M`` is the
  GEMM's row count (``T``, or tokens per activated expert for MoE) and ``eff`` the fitted GEMM
  efficiency curve; element-wise kernels; two TP all-reduces per layer;
* the LM head over the rows that need logits;
* prefill attention, proportional to the query-key pairs it computes;
* decode attention, a KV-cache read proportional to the summed context;
* a fixed per-iteration overhead (CPU scheduling, sampling).

The per-operator formulas are module functions so ``envs.calibration`` checks the very code the
simulator runs against the measurements. ``CostModel`` tabulates the token-dependent part once at
construction so a call on the simulator's hot path is a handful of float operations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from envs.hardware import BYTES_PER_PARAM, GPUSpec, ModelSpec, SettingError, get_gpu, get_model

ACTIVATION_BYTES = 2  # activations and attention math run in BF16 everywhere we model
DEFAULT_ITERATION_OVERHEAD_S = 8.7e-4
"""Intercept of schedule + sampler + prepare-inputs + process-outputs medians over batch size in
Vidur's A100 ``cpu_overheads.csv`` (refit with ``python -m envs.calibration``)."""
DEFAULT_KV_TRANSFER_BYTES_PER_S = 50e9
"""One 400 Gb/s RDMA NIC per GPU, as on an 8-NIC HGX node: ~50 GB/s per prefill->decode pair."""
DEFAULT_KV_TRANSFER_LATENCY_S = 1e-3
"""Assumed connection handshake and bookkeeping per transfer (not measured here)."""
ACTIVATION_RESERVE_TOKENS = 8192
"""Largest prefill chunk the activation reserve is sized for."""
RUNTIME_RESERVE_BYTES_PER_GPU = 2 * 2**30
"""CUDA graphs, NCCL buffers, allocator slack (SGLang leaves a few GiB outside its static pool)."""
TABLE_TOKENS = 16384
"""Token counts tabulated at construction; larger batches take a slower exact path."""
PREFILL_TIMES_KEPT = 1 << 16
"""Answers ``prefill_time_s`` keeps (then it starts over)."""
PREFILL_SUMS_KEYS = 4096
"""(cached, chunk) pairs whose full-chunk running sums ``prefill_time_s`` keeps (then it starts over)."""


# --- Per-operator formulas (vectorised over numpy arrays; also used by envs.calibration) -----------


def gemm_efficiency(gpu: GPUSpec, rows: np.ndarray) -> np.ndarray:
    """Fraction of peak a GEMM with ``rows`` rows (M dimension) reaches; log2-interpolated, flat outside."""
    knots = np.log2(np.asarray(gpu.gemm_efficiency_tokens, dtype=np.float64))
    return np.interp(np.log2(np.maximum(rows, 1.0)), knots, np.asarray(gpu.gemm_efficiency))


def gemm_time_s(
    gpu: GPUSpec,
    rows: np.ndarray,
    k: np.ndarray | float,
    n: np.ndarray | float,
    *,
    matrices: np.ndarray | float = 1.0,
    weight_bytes_per_param: float = 2.0,
    peak_flops_per_s: float | None = None,
) -> np.ndarray:
    """Time of ``[rows, k] x [k, n]`` spread over ``matrices`` weight matrices (grouped MoE GEMM).

    ``rows`` counts all rows over all matrices; each matrix sees ``rows / matrices`` of them. Zero rows
    cost nothing.
    """
    rows = np.asarray(rows, dtype=np.float64)
    peak = gpu.bf16_tflops * 1e12 if peak_flops_per_s is None else peak_flops_per_s
    matrices_arr = np.maximum(np.asarray(matrices, dtype=np.float64), 1e-12)
    flops = 2.0 * rows * k * n
    weight_bytes = matrices_arr * k * n * weight_bytes_per_param
    bytes_moved = weight_bytes + rows * (k + n) * ACTIVATION_BYTES
    compute_s = flops / (peak * gemm_efficiency(gpu, rows / matrices_arr))
    memory_s = bytes_moved / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
    return np.where(rows > 0, gpu.kernel_launch_s + np.maximum(compute_s, memory_s), 0.0)


def elementwise_time_s(gpu: GPUSpec, tokens: np.ndarray, bytes_per_token: np.ndarray | float) -> np.ndarray:
    """Norms, rotary, activation and residual adds of one layer: streaming ``bytes_per_token``."""
    tokens = np.asarray(tokens, dtype=np.float64)
    stream_s = tokens * bytes_per_token / (gpu.hbm_bytes_per_s * gpu.elementwise_memory_efficiency)
    return np.where(tokens > 0, gpu.elementwise_launch_s + stream_s, 0.0)


def allreduce_time_s(gpu: GPUSpec, size_bytes: np.ndarray, tp: int) -> np.ndarray:
    """One ring all-reduce of ``size_bytes`` over ``tp`` GPUs on NVLink (0 for tp == 1)."""
    size_bytes = np.asarray(size_bytes, dtype=np.float64)
    if tp <= 1:
        return np.zeros_like(size_bytes)
    bus_bytes = size_bytes * 2.0 * (tp - 1) / tp
    wire_s = bus_bytes / (gpu.nvlink_gb_per_s * 1e9 * gpu.allreduce_bus_efficiency)
    return np.where(size_bytes > 0, gpu.allreduce_latency_s + wire_s, 0.0)


def all_to_all_time_s(
    gpu: GPUSpec,
    tokens_per_gpu: np.ndarray,
    bytes_per_token: float,
    top_k: int,
    ep: int,
    *,
    per_node: bool = False,
) -> np.ndarray:
    """One MoE dispatch (or combine) over ``ep`` GPUs, each holding ``tokens_per_gpu`` tokens routed to
    ``top_k`` experts spread uniformly over the ranks (uniform routing, balanced ranks).

    A ``1/ep`` share of the copies stays on the GPU, ``(local - 1)/ep`` crosses NVLink
    (``local = min(ep, gpus_per_node)``) and the rest the scale-out network, both links in parallel:
    ``latency + max(nvlink_bytes / (nvlink_bw * eff_nvl), rdma_bytes / (rdma_bw * eff_rdma))``.
    ``per_node`` is DeepEP's high-throughput (prefill) kernel, which sends a token once per remote
    node and forwards it over NVLink there: ``(nodes - 1) * (1 - (1 - 1/nodes)^top_k)`` RDMA copies per
    token instead of ``top_k * (ep - local) / ep`` (the low-latency decode kernel's per-expert sends).
    0 for ``ep == 1``. The knobs are DeepEP's published H800 figures, not a measurement of ours.
    """
    tokens = np.asarray(tokens_per_gpu, dtype=np.float64)
    if ep <= 1:
        return np.zeros_like(tokens)
    local = min(ep, gpu.gpus_per_node)
    nodes = math.ceil(ep / gpu.gpus_per_node)
    nvlink_copies = top_k * (local - 1) / ep
    if per_node and nodes > 1:
        rdma_copies = (nodes - 1) * -math.expm1(top_k * math.log1p(-1.0 / nodes))
    else:
        rdma_copies = top_k * (ep - local) / ep
    nvlink_s = (
        tokens
        * nvlink_copies
        * bytes_per_token
        / (gpu.nvlink_gb_per_s * 1e9 * gpu.all_to_all_nvlink_efficiency)
    )
    rdma_s = (
        tokens
        * rdma_copies
        * bytes_per_token
        / (gpu.scale_out_gb_per_s * 1e9 * gpu.all_to_all_rdma_efficiency)
    )
    return np.where(tokens > 0, gpu.all_to_all_latency_s + np.maximum(nvlink_s, rdma_s), 0.0)


def attention_prefill_time_s(
    gpu: GPUSpec, flops: np.ndarray, query_head_rows: np.ndarray | float = 0.0
) -> np.ndarray:
    """One layer's prefill attention on one GPU performing ``flops`` (BF16) for ``query_head_rows``
    (new tokens x query heads on the GPU): a per-row cost (softmax state, Q/O traffic) plus the math."""
    flops = np.asarray(flops, dtype=np.float64)
    compute_s = flops / (gpu.bf16_tflops * 1e12 * gpu.attention_prefill_efficiency)
    rows_s = np.asarray(query_head_rows, dtype=np.float64) * gpu.attention_prefill_row_s
    return np.where(flops > 0, gpu.attention_prefill_launch_s + rows_s + compute_s, 0.0)


def attention_decode_time_s(
    gpu: GPUSpec, batch: np.ndarray, kv_bytes: np.ndarray, flops: np.ndarray | float = 0.0
) -> np.ndarray:
    """One layer's decode attention on one GPU: ``batch`` requests reading ``kv_bytes`` of KV cache."""
    batch = np.asarray(batch, dtype=np.float64)
    read_s = np.asarray(kv_bytes, dtype=np.float64) / (
        gpu.hbm_bytes_per_s * gpu.attention_decode_memory_efficiency
    )
    compute_s = np.asarray(flops, dtype=np.float64) / (
        gpu.bf16_tflops * 1e12 * gpu.attention_prefill_efficiency
    )
    busy_s = gpu.attention_decode_launch_s + batch * gpu.attention_decode_per_request_s
    return np.where(batch > 0, busy_s + np.maximum(read_s, compute_s), 0.0)


def expected_active_experts(experts: int, active_per_token: int, tokens: np.ndarray) -> np.ndarray:
    """Distinct experts hit by ``tokens`` tokens routing uniformly: ``E * (1 - (1 - k/E)^tokens)``."""
    tokens = np.asarray(tokens, dtype=np.float64)
    return experts * -np.expm1(tokens * math.log1p(-active_per_token / experts))


# --- Model-level bookkeeping --------------------------------------------------------------------


def attention_projection_shapes(model: ModelSpec, tp: int = 1) -> list[tuple[float, float]]:
    """(k, n) of every attention projection of one layer as one of ``tp`` GPUs holds it.

    Column-parallel projections split n, the output projection splits k; MLA's low-rank down
    projections are replicated; GQA KV heads are replicated when ``tp > kv_heads``.
    """
    hq, dqk, dv, h = model.q_heads, model.head_dim, model.value_head_dim, model.hidden
    if model.attention == "mla":
        q: list[tuple[float, float]] = (
            [(h, model.q_lora_rank), (model.q_lora_rank, hq * dqk / tp)]
            if model.q_lora_rank
            else [(h, hq * dqk / tp)]
        )
        nope = dqk - model.rope_head_dim
        kv = [(h, model.kv_lora_rank + model.rope_head_dim), (model.kv_lora_rank, hq * (nope + dv) / tp)]
        return [*q, *kv, (hq * dv / tp, h)]
    kv_heads_per_gpu = max(model.kv_heads / tp, 1.0)
    return [(h, (hq / tp + 2 * kv_heads_per_gpu) * dqk), (hq * dv / tp, h)]


def weight_params(model: ModelSpec) -> dict[str, float]:
    """Parameter counts by group: attention, dense FFN, routed and shared experts, router, embeddings."""
    ffn_mats = 3 if model.gated_mlp else 2
    attention = model.layers * sum(k * n for k, n in attention_projection_shapes(model, 1))
    dense_layers = model.dense_layers if model.is_moe else model.layers
    dense_ffn = dense_layers * ffn_mats * model.hidden * model.intermediate
    expert_size = ffn_mats * model.hidden * model.expert_intermediate
    router = model.moe_layers * model.hidden * model.experts
    embeddings = model.vocab * model.hidden * (1 if model.tied_embeddings else 2)
    return {
        "attention": attention,
        "dense_ffn": dense_ffn,
        "routed_experts": model.moe_layers * model.experts * expert_size,
        "shared_experts": model.moe_layers * model.shared_experts * expert_size,
        "router": router,
        "embeddings": embeddings,
    }


def weight_bytes(model: ModelSpec, ep: int = 1, dp_attention: int = 1) -> float:
    """Bytes of all weights of one worker: FFN/expert weights at ``weight_precision``, attention at
    ``dense_precision``, embeddings, LM head and router at ``embedding_precision``.

    With data-parallel attention every weight but the routed experts is held once per attention
    replica (``dp_attention`` copies: SGLang runs attention, dense FFN, shared experts and the LM head
    data-parallel); routed experts are spread over ``ep`` ranks of ``ceil(experts / ep)`` slots each
    (when ``ep`` does not divide the experts the spare slots hold redundant experts, as EPLB does).
    """
    params = weight_params(model)
    ffn_bpp = BYTES_PER_PARAM[model.weight_precision]
    slots = math.ceil(model.experts / ep) * ep if model.experts else 0
    routed = params["routed_experts"] * (slots / model.experts if model.experts else 0.0) * ffn_bpp
    replicated = (
        (params["dense_ffn"] + params["shared_experts"]) * ffn_bpp
        + params["attention"] * BYTES_PER_PARAM[model.dense_precision]
        + (params["router"] + params["embeddings"]) * BYTES_PER_PARAM[model.embedding_precision]
    )
    return routed + dp_attention * replicated


class ParallelismError(SettingError):
    """A parallel layout the model cannot be split into (``field`` is ``tp``, ``ep`` or ``dp_attention``)."""


def check_parallelism(model: ModelSpec, gpu: GPUSpec, tp: int, ep: int = 1, dp_attention: int = 1) -> None:
    """Raise ``ParallelismError`` unless ``model`` splits over ``tp`` GPUs as SGLang would split it.

    Attention runs on ``tp / dp_attention`` GPUs per replica: its query heads must divide evenly, and
    GQA KV heads must divide or be replicated evenly; that group must fit in one NVLink domain (an
    all-reduce over the scale-out network is not modelled). Experts are spread over ``ep`` ranks, each
    expert split over ``tp / ep`` GPUs. ``ep`` and ``dp_attention`` are for MoE models only.
    """
    for name, value in (("tp", tp), ("ep", ep), ("dp_attention", dp_attention)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ParallelismError(name, value, "must be a positive integer")
    if tp % dp_attention:
        raise ParallelismError("dp_attention", dp_attention, f"does not divide tp={tp}")
    for name, value in (("ep", ep), ("dp_attention", dp_attention)):
        if value > 1 and not model.is_moe:
            raise ParallelismError(name, value, f"{model.name} is not an MoE model (use more workers)")
    attn_tp = tp // dp_attention
    group = f"{attn_tp} GPUs" + (f" (tp={tp} / dp_attention={dp_attention})" if dp_attention > 1 else "")
    if model.q_heads % attn_tp:
        raise ParallelismError(
            "tp", tp, f"{model.name}'s {model.q_heads} query heads do not split over {group}"
        )
    if model.attention == "gqa" and model.kv_heads % attn_tp and attn_tp % model.kv_heads:
        raise ParallelismError(
            "tp",
            tp,
            f"{model.name}'s {model.kv_heads} KV heads neither split over nor replicate onto {group}",
        )
    if attn_tp > gpu.gpus_per_node:
        raise ParallelismError(
            "tp",
            tp,
            f"tensor-parallel attention over {group} spans {gpu.name} NVLink domains of "
            f"{gpu.gpus_per_node}; an all-reduce over the scale-out network is not modelled "
            "(use data-parallel attention)",
        )
    dense_width = model.intermediate if (model.dense_layers or not model.is_moe) else 0
    if dense_width % attn_tp:
        raise ParallelismError(
            "tp", tp, f"{model.name}'s dense FFN width {dense_width} does not split over {group}"
        )
    if tp % ep:
        raise ParallelismError(
            "ep", ep, f"does not divide tp={tp} (experts are spread over the worker's GPUs)"
        )
    if model.is_moe and model.expert_intermediate % (tp // ep):
        raise ParallelismError(
            "tp",
            tp,
            f"{model.name}'s expert width {model.expert_intermediate} does not split over tp / ep = "
            f"{tp // ep} GPUs",
        )


def kv_bytes_per_token_per_gpu_layer(model: ModelSpec, tp: int) -> float:
    """KV bytes one GPU stores per token per full-attention layer.

    GQA shards KV heads over TP (replicated when ``tp > kv_heads``); MLA's latent is shared by all
    heads, so every TP rank keeps the whole latent.
    """
    element = BYTES_PER_PARAM[model.kv_precision]
    if model.attention == "mla":
        return (model.kv_lora_rank + model.rope_head_dim) * element
    heads_per_gpu = max(model.kv_heads / tp, 1.0)
    return 2.0 * heads_per_gpu * model.head_dim * element


def kv_transfer_bytes_per_token(model: ModelSpec) -> float:
    """Unique KV bytes per token a prefill worker sends (full-attention layers; one latent copy)."""
    element = BYTES_PER_PARAM[model.kv_precision]
    if model.attention == "mla":
        return (model.kv_lora_rank + model.rope_head_dim) * element * model.layers
    return 2.0 * model.kv_heads * model.head_dim * element * model.full_attention_layers


def elementwise_bytes_per_token(
    hidden: int, qk_heads_per_gpu: float, head_dim: int, ffn_width_per_gpu: float, gated: bool = True
) -> float:
    """Bytes one token streams through one layer's element-wise kernels on one GPU.

    Two RMSNorms (read + write hidden), rotary on q and k (read + write), the activation (gated: read
    2I, write I), a residual add (read 2, write 1 hidden), all BF16.
    """
    act = 3.0 if gated else 2.0
    per_token_elems = 4 * hidden + 2 * qk_heads_per_gpu * head_dim + act * ffn_width_per_gpu + 3 * hidden
    return per_token_elems * ACTIVATION_BYTES


# --- The cost model -----------------------------------------------------------------------------


class CostModel:
    """Iteration timing, KV size and KV capacity of one worker: ``model`` on ``tp`` x ``gpu``.

    Args:
        gpu: a ``GPUSpec`` or a catalog name (``"H200"``).
        model: a ``ModelSpec``, a catalog name (``"gpt-oss-120b"``) or a ``config.json`` path.
        tp: GPUs per worker (the tensor-parallel degree when neither ``ep`` nor ``dp_attention`` is set).
        ep: expert-parallel degree (MoE only): routed experts are spread over ``ep`` ranks, each expert
            split over ``tp / ep`` GPUs. Without data-parallel attention the experts' outputs are summed
            by the TP all-reduce, as today's SGLang EP MoE does.
        dp_attention: data-parallel attention degree (MoE only, SGLang ``--enable-dp-attention --dp``):
            attention, dense FFN, shared experts and LM head run as ``dp_attention`` replicas of
            ``tp / dp_attention`` GPUs, each on an equal share of the batch (balanced ranks assumed); the
            routed experts are reached by an all-to-all dispatch and combine (``all_to_all_time_s``).
        kv_memory_fraction: share of HBM the serving engine may use for weights + KV cache (SGLang's
            ``mem_fraction_static``).
        iteration_overhead_s: fixed CPU cost per iteration; ``None`` uses ``DEFAULT_ITERATION_OVERHEAD_S``.

    Raises:
        ParallelismError: the model does not split over ``tp``, ``ep``, ``dp_attention`` (``field``
            names which).
        ValueError: bad arguments, or the weights plus activation reserve do not fit in the memory.
    """

    def __init__(
        self,
        gpu: GPUSpec | str,
        model: ModelSpec | str,
        tp: int = 1,
        *,
        ep: int = 1,
        dp_attention: int = 1,
        kv_memory_fraction: float = 0.9,
        iteration_overhead_s: float | None = None,
    ) -> None:
        self.gpu: GPUSpec = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.model: ModelSpec = get_model(model) if isinstance(model, str) else model
        check_parallelism(self.model, self.gpu, tp, ep, dp_attention)
        if not 0.0 < kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
        if iteration_overhead_s is not None and iteration_overhead_s < 0:
            raise ValueError(f"iteration_overhead_s must be >= 0, got {iteration_overhead_s}")
        self.tp: int = tp
        self.ep: int = ep
        self.dp_attention: int = dp_attention
        self.attention_tp: int = tp // dp_attention
        """GPUs of one attention replica."""
        self.iteration_overhead_s: float = (
            DEFAULT_ITERATION_OVERHEAD_S if iteration_overhead_s is None else iteration_overhead_s
        )
        m, attn_tp, dp = self.model, self.attention_tp, dp_attention

        per_gpu_layer = kv_bytes_per_token_per_gpu_layer(m, attn_tp)
        kv_layers = m.layers if m.attention == "mla" else m.full_attention_layers
        self.kv_bytes_per_token: int = round(per_gpu_layer * kv_layers * attn_tp)
        self.kv_transfer_bytes_per_token: float = kv_transfer_bytes_per_token(m)
        self.weight_bytes: float = weight_bytes(m, ep, dp)
        self.activation_reserve_bytes: float = tp * (RUNTIME_RESERVE_BYTES_PER_GPU + self._activation_bytes())
        budget_bytes = self.gpu.hbm_bytes * tp * kv_memory_fraction
        free_bytes = budget_bytes - self.weight_bytes - self.activation_reserve_bytes
        if free_bytes <= 0:
            raise ValueError(
                f"{m.name} does not fit on {tp} x {self.gpu.name}: "
                f"weights {self.weight_bytes / 1e9:.1f} GB + "
                f"activation reserve {self.activation_reserve_bytes / 1e9:.1f} GB > "
                f"{kv_memory_fraction:.2f} x {tp} x {self.gpu.hbm_gb:g} GB; raise tp"
            )
        self.kv_capacity_tokens: int = int(free_bytes // self.kv_bytes_per_token)

        # Per-pair / per-context-token coefficients of the attention terms (all layers, one GPU). With
        # data-parallel attention each replica sees 1/dp of the pairs, contexts and requests.
        hq_gpu = m.q_heads / attn_tp
        self._prefill_flops_per_pair = 2.0 * hq_gpu * (m.head_dim + m.value_head_dim)
        self._sliding_window_tokens = float(m.sliding_window_tokens)
        if m.attention == "mla":
            # Absorbed MLA decode: each query head scores the latent (+ rope key) and sums the latent.
            decode_flops_per_ctx = 2.0 * hq_gpu * (2 * m.kv_lora_rank + m.rope_head_dim)
        else:
            decode_flops_per_ctx = 2.0 * hq_gpu * (m.head_dim + m.value_head_dim)
        self._decode_bytes_per_ctx = per_gpu_layer
        self._decode_flops_per_ctx = decode_flops_per_ctx
        self._attention_layers = kv_layers
        self._sliding_layers = m.sliding_window_layers if m.attention == "gqa" else 0
        read_s = per_gpu_layer / (self.gpu.hbm_bytes_per_s * self.gpu.attention_decode_memory_efficiency)
        math_s = decode_flops_per_ctx / (self.gpu.bf16_tflops * 1e12 * self.gpu.attention_prefill_efficiency)
        per_ctx_layer_s = max(read_s, math_s)
        self._decode_s_per_ctx_token = kv_layers * per_ctx_layer_s / dp
        self._decode_s_per_request = (
            m.layers * self.gpu.attention_decode_per_request_s
            + self._sliding_layers * self._sliding_window_tokens * per_ctx_layer_s
        ) / dp
        self._decode_fixed_s = m.layers * self.gpu.attention_decode_launch_s
        prefill_pair_s = self._prefill_flops_per_pair / (
            self.gpu.bf16_tflops * 1e12 * self.gpu.attention_prefill_efficiency
        )
        self._prefill_s_per_pair_full = kv_layers * prefill_pair_s / dp
        self._prefill_s_per_pair_sliding = self._sliding_layers * prefill_pair_s / dp
        self._prefill_fixed_s = m.layers * self.gpu.attention_prefill_launch_s
        self._prefill_s_per_token = m.layers * hq_gpu * self.gpu.attention_prefill_row_s / dp

        # Tabulate everything that depends only on the batch's token count (python lists: fastest
        # scalar indexing on the hot path).
        tokens = np.arange(TABLE_TOKENS + 1, dtype=np.float64)
        self._token_table = self._token_time_s(tokens)
        self._lm_head_table = self._lm_head_time_s(tokens)
        self._token_list: list[float] = self._token_table.tolist()
        self._lm_head_list: list[float] = self._lm_head_table.tolist()
        self._all_to_all = dp_attention > 1
        self._a2a_prefill_table = self.moe_communication_s(tokens, prefill=True)
        self._a2a_decode_table = self.moe_communication_s(tokens, prefill=False)
        self._a2a_prefill_list: list[float] = self._a2a_prefill_table.tolist()
        self._a2a_decode_list: list[float] = self._a2a_decode_table.tolist()
        self._prefill_times: dict[tuple[int, int, int], float] = {}
        """(new tokens, cached tokens, chunk tokens) -> ``prefill_time_s``."""
        self._prefill_sums: dict[tuple[int, int], list[float]] = {}
        """(cached tokens, chunk tokens) -> running sums of the full chunks' times (``prefill_time_s``)."""

    # -- construction helpers --------------------------------------------------------------------

    def _activation_bytes(self) -> float:
        """Per-GPU activation workspace for an ``ACTIVATION_RESERVE_TOKENS`` chunk (a few live buffers)."""
        m, tp = self.model, self.attention_tp
        ffn_width = max(m.intermediate, m.active_experts * m.expert_intermediate) * 2 / tp
        qkv_width = sum(n for _, n in attention_projection_shapes(m, tp))
        return ACTIVATION_RESERVE_TOKENS * ACTIVATION_BYTES * (4 * m.hidden + qkv_width + ffn_width)

    def moe_communication_s(self, tokens: np.ndarray, prefill: bool) -> np.ndarray:
        """Dispatch + combine of every MoE layer for a worker batch of ``tokens`` (0 without DP attention).

        Each GPU sends its ``tokens / tp`` tokens to their ``top-k`` experts: FP8 activations when the
        experts run on FP8/FP4 tensor cores (DeepEP's FP8 dispatch), BF16 otherwise; the combine
        returns them in BF16. Iterations with prefill use the high-throughput kernel (one RDMA copy per
        remote node), decode-only ones the low-latency kernel (one per expert), as SGLang's
        ``--deepep-mode auto`` does.
        """
        m, gpu = self.model, self.gpu
        tokens = np.asarray(tokens, dtype=np.float64)
        if self.dp_attention == 1:
            return np.zeros_like(tokens)
        low_precision = m.weight_precision != "bf16" and gpu.fp8_tflops > 0
        dispatch_bytes = (1.0 if low_precision else float(ACTIVATION_BYTES)) * m.hidden
        per_gpu = tokens / self.tp
        layer_s = all_to_all_time_s(
            gpu, per_gpu, dispatch_bytes, m.active_experts, self.ep, per_node=prefill
        ) + all_to_all_time_s(
            gpu, per_gpu, ACTIVATION_BYTES * m.hidden, m.active_experts, self.ep, per_node=prefill
        )
        return np.asarray(m.moe_layers * layer_s)

    def _token_time_s(self, tokens: np.ndarray) -> np.ndarray:
        """Linear layers, element-wise kernels and communication of all layers for ``tokens`` batch tokens."""
        m, gpu, tp, dp, attn_tp, ep = (
            self.model,
            self.gpu,
            self.tp,
            self.dp_attention,
            self.attention_tp,
            self.ep,
        )
        dense_peak = gpu.peak_flops_per_s(m.dense_precision)
        dense_bpp = BYTES_PER_PARAM[m.dense_precision]
        ffn_peak = gpu.peak_flops_per_s(m.weight_precision)
        ffn_bpp = BYTES_PER_PARAM[m.weight_precision]
        router_peak = gpu.peak_flops_per_s(m.embedding_precision)
        router_bpp = BYTES_PER_PARAM[m.embedding_precision]
        local = tokens / dp  # tokens of one attention replica

        attention_s = sum(
            gemm_time_s(gpu, local, k, n, weight_bytes_per_param=dense_bpp, peak_flops_per_s=dense_peak)
            for k, n in attention_projection_shapes(m, attn_tp)
        )
        qk_heads_gpu = m.q_heads / attn_tp + (1.0 if m.attention == "mla" else max(m.kv_heads / attn_tp, 1.0))
        one_allreduce_s = allreduce_time_s(gpu, local * m.hidden * ACTIVATION_BYTES, attn_tp)
        up = 2 if m.gated_mlp else 1

        def dense_ffn_s(width: float) -> np.ndarray:
            return gemm_time_s(
                gpu,
                local,
                m.hidden,
                up * width / attn_tp,
                weight_bytes_per_param=ffn_bpp,
                peak_flops_per_s=ffn_peak,
            ) + gemm_time_s(
                gpu,
                local,
                width / attn_tp,
                m.hidden,
                weight_bytes_per_param=ffn_bpp,
                peak_flops_per_s=ffn_peak,
            )

        def elementwise_s(ffn_width: float) -> np.ndarray:
            per_token = elementwise_bytes_per_token(
                m.hidden, qk_heads_gpu, m.head_dim, ffn_width, m.gated_mlp
            )
            return elementwise_time_s(gpu, local, per_token)

        dense_layer_s = attention_s + 2.0 * one_allreduce_s
        if m.intermediate:
            dense_layer_s = (
                dense_layer_s + dense_ffn_s(m.intermediate) + elementwise_s(m.intermediate / attn_tp)
            )
        if not m.is_moe:
            return np.asarray(m.layers * dense_layer_s)

        total = np.zeros_like(tokens)
        if m.dense_layers:
            total += m.dense_layers * dense_layer_s
        # Routed experts: each of the ep ranks holds 1/ep of the experts, hit by 1/ep of the routed rows.
        rows = tokens * m.active_experts / ep
        active = expected_active_experts(m.experts, m.active_experts, tokens) / ep
        ie, expert_tp = m.expert_intermediate, tp // ep
        experts_s = gemm_time_s(
            gpu,
            rows,
            m.hidden,
            up * ie / expert_tp,
            matrices=active,
            weight_bytes_per_param=ffn_bpp,
            peak_flops_per_s=ffn_peak,
        ) + gemm_time_s(
            gpu,
            rows,
            ie / expert_tp,
            m.hidden,
            matrices=active,
            weight_bytes_per_param=ffn_bpp,
            peak_flops_per_s=ffn_peak,
        )
        router_s = gemm_time_s(
            gpu, local, m.hidden, m.experts, weight_bytes_per_param=router_bpp, peak_flops_per_s=router_peak
        )
        shared_s = dense_ffn_s(m.shared_experts * ie) if m.shared_experts else 0.0
        # Without DP attention the experts' partial outputs are summed by the layer's second all-reduce;
        # with it, the combine does that (``moe_communication_s``, added per iteration since its kernel
        # depends on the batch kind) and only the attention output is all-reduced (in its replica).
        communication_s = 2.0 * one_allreduce_s if dp == 1 else one_allreduce_s
        moe_layer_s = (
            attention_s
            + communication_s
            + experts_s
            + router_s
            + shared_s
            + elementwise_s((m.active_experts + m.shared_experts) * ie / attn_tp)
        )
        total += m.moe_layers * moe_layer_s
        return np.asarray(total)

    def _lm_head_time_s(self, logits_rows: np.ndarray) -> np.ndarray:
        m = self.model
        return gemm_time_s(
            self.gpu,
            logits_rows / self.dp_attention,
            m.hidden,
            m.vocab / self.attention_tp,
            weight_bytes_per_param=BYTES_PER_PARAM[m.embedding_precision],
            peak_flops_per_s=self.gpu.peak_flops_per_s(m.embedding_precision),
        )

    # -- public API ------------------------------------------------------------------------------

    @staticmethod
    def prefill_attention_pairs(new_tokens: int, cached_tokens: int) -> float:
        """Causal query-key pairs of a chunk of ``new_tokens`` after ``cached_tokens`` already in KV.

        Every new token attends the whole cached prefix and the new tokens up to itself:
        ``new * cached + new * (new + 1) / 2``.
        """
        return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2.0

    def iteration_time_s(
        self, prefill: Sequence[tuple[int, int]] = (), decode_batch: int = 0, decode_context_tokens: int = 0
    ) -> float:
        """One forward iteration mixing prefill chunks [(new_tokens, cached_prefix_tokens), ...] with a
        decode batch of ``decode_batch`` requests whose KV contexts sum to ``decode_context_tokens``.
        0.0 if nothing to do.

        Sliding-window layers attend ``min(pairs, new_tokens * window)`` pairs in prefill and
        ``window`` tokens per decode request (contexts are assumed to be at least the window).
        """
        new_tokens = 0
        pairs = 0.0
        for new, cached in prefill:
            if new < 0 or cached < 0:
                raise ValueError(f"prefill chunk (new_tokens={new}, cached_tokens={cached}) must be >= 0")
            new_tokens += new
            pairs += new * cached + new * (new + 1) * 0.5
        if decode_batch < 0 or decode_context_tokens < 0:
            raise ValueError(
                f"decode_batch={decode_batch} and decode_context_tokens={decode_context_tokens} must be >= 0"
            )
        tokens = new_tokens + decode_batch
        if tokens == 0:
            return 0.0
        logits_rows = decode_batch + (1 if new_tokens else 0)
        if tokens <= TABLE_TOKENS:
            total_s = self._token_list[tokens] + self._lm_head_list[logits_rows]
            if self._all_to_all:
                total_s += (self._a2a_prefill_list if new_tokens else self._a2a_decode_list)[tokens]
        else:
            big = np.array([float(tokens)])
            total_s = float(
                self._token_time_s(big)[0]
                + self._lm_head_time_s(np.array([float(logits_rows)]))[0]
                + self.moe_communication_s(big, prefill=new_tokens > 0)[0]
            )
        if new_tokens:
            window_pairs = new_tokens * self._sliding_window_tokens
            total_s += (
                self._prefill_fixed_s
                + new_tokens * self._prefill_s_per_token
                + pairs * self._prefill_s_per_pair_full
                + min(pairs, window_pairs) * self._prefill_s_per_pair_sliding
            )
        if decode_batch:
            total_s += (
                self._decode_fixed_s
                + decode_batch * self._decode_s_per_request
                + decode_context_tokens * self._decode_s_per_ctx_token
            )
        return total_s + self.iteration_overhead_s

    def iteration_times_s(
        self,
        prefill_tokens: np.ndarray,
        prefill_attention_pairs: np.ndarray,
        decode_batch: np.ndarray,
        decode_context_tokens: np.ndarray,
    ) -> np.ndarray:
        """Vectorised form for profilers/sweeps (prefill described by total new tokens and total
        attention query-key pairs). Element ``i`` equals ``iteration_time_s`` of a batch whose prefill
        chunks total ``prefill_tokens[i]`` new tokens and ``prefill_attention_pairs[i]`` pairs."""
        new = np.asarray(prefill_tokens, dtype=np.int64)
        pairs = np.asarray(prefill_attention_pairs, dtype=np.float64)
        batch = np.asarray(decode_batch, dtype=np.int64)
        ctx = np.asarray(decode_context_tokens, dtype=np.float64)
        new, pairs, batch, ctx = np.broadcast_arrays(new, pairs, batch, ctx)
        if (new < 0).any() or (pairs < 0).any() or (batch < 0).any() or (ctx < 0).any():
            raise ValueError("iteration_times_s inputs must be >= 0")
        tokens = new + batch
        logits_rows = batch + (new > 0)
        small = tokens <= TABLE_TOKENS
        total = np.empty(tokens.shape, dtype=np.float64)
        total[small] = (
            self._token_table[tokens[small]]
            + self._lm_head_table[np.minimum(logits_rows[small], TABLE_TOKENS)]
        )
        if not small.all():
            big = ~small
            total[big] = self._token_time_s(tokens[big].astype(np.float64)) + self._lm_head_time_s(
                logits_rows[big].astype(np.float64)
            )
        if self._all_to_all:
            as_float = tokens.astype(np.float64)
            total += np.where(
                new > 0,
                self.moe_communication_s(as_float, prefill=True),
                self.moe_communication_s(as_float, prefill=False),
            )
        window_pairs = new * self._sliding_window_tokens
        total += np.where(
            new > 0,
            self._prefill_fixed_s
            + new * self._prefill_s_per_token
            + pairs * self._prefill_s_per_pair_full
            + np.minimum(pairs, window_pairs) * self._prefill_s_per_pair_sliding,
            0.0,
        )
        total += np.where(
            batch > 0,
            self._decode_fixed_s + batch * self._decode_s_per_request + ctx * self._decode_s_per_ctx_token,
            0.0,
        )
        return np.where(tokens > 0, total + self.iteration_overhead_s, 0.0)

    def decode_step_time_s(self, batch: int, context_tokens: int) -> float:
        """One decode-only iteration: ``iteration_time_s((), batch, context_tokens)``."""
        return self.iteration_time_s((), batch, context_tokens)

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0, chunk_tokens: int = 8192) -> float:
        """Whole prefill run alone in chunks of chunk_tokens: each chunk's ``iteration_time_s`` added in
        order. Answers are kept, and so are the running sums over full chunks per (cached, chunk), the
        same additions in the same order: a scheduler estimates the wait behind every queued prompt and
        each prompt's own prefill at every control interval, and a queue of n chunks cost n
        iterations' timing each time."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if new_tokens <= 0:
            return 0.0
        key = (new_tokens, cached_tokens, chunk_tokens)
        total_s = self._prefill_times.get(key)
        if total_s is not None:
            return total_s
        full, rest = divmod(new_tokens, chunk_tokens)
        sums = self._prefill_sums.get((cached_tokens, chunk_tokens))
        if sums is None or len(sums) <= full:
            sums = self._full_chunk_sums(cached_tokens, chunk_tokens, full)
        total_s = sums[full]
        if rest:
            total_s += self.iteration_time_s(((rest, cached_tokens + full * chunk_tokens),))
        if len(self._prefill_times) >= PREFILL_TIMES_KEPT:  # a bound on memory
            self._prefill_times.clear()
        self._prefill_times[key] = total_s
        return total_s

    def _full_chunk_sums(self, cached_tokens: int, chunk_tokens: int, full: int) -> list[float]:
        """Running sums of the times of full chunks after ``cached_tokens``: entry i is the first i
        chunks' (a new list holding at least ``full + 1`` entries; a list once stored never changes)."""
        key = (cached_tokens, chunk_tokens)
        sums = list(self._prefill_sums.get(key, (0.0,)))
        total_s = sums[-1]
        for i in range(len(sums) - 1, max(full, 2 * (len(sums) - 1))):
            total_s += self.iteration_time_s(((chunk_tokens, cached_tokens + i * chunk_tokens),))
            sums.append(total_s)
        if len(self._prefill_sums) >= PREFILL_SUMS_KEYS:  # a bound on memory
            self._prefill_sums.clear()
        self._prefill_sums[key] = sums
        return sums

    def kv_transfer_time_s(
        self,
        tokens: int,
        bandwidth_bytes_per_s: float | None = None,
        latency_s: float = DEFAULT_KV_TRANSFER_LATENCY_S,
    ) -> float:
        """Prefill->decode KV transfer of ``tokens`` tokens' cache: ``latency + bytes / bandwidth``.

        Default bandwidth: ``DEFAULT_KV_TRANSFER_BYTES_PER_S`` (inter-node RDMA, ~50 GB/s per worker).
        Bytes are the unique KV (one copy of an MLA latent, full-attention layers only). 0 tokens -> 0.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if tokens == 0:
            return 0.0
        bandwidth = (
            DEFAULT_KV_TRANSFER_BYTES_PER_S if bandwidth_bytes_per_s is None else bandwidth_bytes_per_s
        )
        if bandwidth <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth}")
        return latency_s + tokens * self.kv_transfer_bytes_per_token / bandwidth

    def __repr__(self) -> str:
        parallel = (f", ep={self.ep}" if self.ep > 1 else "") + (
            f", dp_attention={self.dp_attention}" if self.dp_attention > 1 else ""
        )
        return (
            f"CostModel({self.gpu.name}, {self.model.name}, tp={self.tp}{parallel}, "
            f"kv_capacity_tokens={self.kv_capacity_tokens})"
        )

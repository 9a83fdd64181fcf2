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

from envs.hardware import BYTES_PER_PARAM, GPUSpec, ModelSpec, get_gpu, get_model

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
    """Parameter counts by group: attention, dense FFN, experts (routed + shared), router, embeddings."""
    ffn_mats = 3 if model.gated_mlp else 2
    attention = model.layers * sum(k * n for k, n in attention_projection_shapes(model, 1))
    dense_layers = model.dense_layers if model.is_moe else model.layers
    dense_ffn = dense_layers * ffn_mats * model.hidden * model.intermediate
    expert_size = ffn_mats * model.hidden * model.expert_intermediate
    experts = model.moe_layers * (model.experts + model.shared_experts) * expert_size
    router = model.moe_layers * model.hidden * model.experts
    embeddings = model.vocab * model.hidden * (1 if model.tied_embeddings else 2)
    return {
        "attention": attention,
        "dense_ffn": dense_ffn,
        "experts": experts,
        "router": router,
        "embeddings": embeddings,
    }


def weight_bytes(model: ModelSpec) -> float:
    """Bytes of all weights: FFN/expert weights at ``weight_precision``, the rest at ``dense_precision``."""
    params = weight_params(model)
    bulk = params["dense_ffn"] + params["experts"]
    rest = params["attention"] + params["router"] + params["embeddings"]
    return bulk * BYTES_PER_PARAM[model.weight_precision] + rest * BYTES_PER_PARAM[model.dense_precision]


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
        model: a ``ModelSpec`` or a catalog name (``"gpt-oss-120b"``).
        tp: tensor-parallel degree (GPUs per worker).
        kv_memory_fraction: share of HBM the serving engine may use for weights + KV cache (SGLang's
            ``mem_fraction_static``).
        iteration_overhead_s: fixed CPU cost per iteration; ``None`` uses ``DEFAULT_ITERATION_OVERHEAD_S``.

    Raises:
        ValueError: bad arguments, or the weights plus activation reserve do not fit in the memory.
    """

    def __init__(
        self,
        gpu: GPUSpec | str,
        model: ModelSpec | str,
        tp: int = 1,
        *,
        kv_memory_fraction: float = 0.9,
        iteration_overhead_s: float | None = None,
    ) -> None:
        self.gpu: GPUSpec = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.model: ModelSpec = get_model(model) if isinstance(model, str) else model
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        if not 0.0 < kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
        if iteration_overhead_s is not None and iteration_overhead_s < 0:
            raise ValueError(f"iteration_overhead_s must be >= 0, got {iteration_overhead_s}")
        self.tp: int = tp
        self.iteration_overhead_s: float = (
            DEFAULT_ITERATION_OVERHEAD_S if iteration_overhead_s is None else iteration_overhead_s
        )
        m = self.model

        per_gpu_layer = kv_bytes_per_token_per_gpu_layer(m, tp)
        kv_layers = m.layers if m.attention == "mla" else m.full_attention_layers
        self.kv_bytes_per_token: int = round(per_gpu_layer * kv_layers * tp)
        self.kv_transfer_bytes_per_token: float = kv_transfer_bytes_per_token(m)
        self.weight_bytes: float = weight_bytes(m)
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

        # Per-pair / per-context-token coefficients of the attention terms (all layers, one GPU).
        hq_gpu = m.q_heads / tp
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
        self._decode_s_per_ctx_token = kv_layers * per_ctx_layer_s
        self._decode_s_per_request = (
            m.layers * self.gpu.attention_decode_per_request_s
            + self._sliding_layers * self._sliding_window_tokens * per_ctx_layer_s
        )
        self._decode_fixed_s = m.layers * self.gpu.attention_decode_launch_s
        prefill_pair_s = self._prefill_flops_per_pair / (
            self.gpu.bf16_tflops * 1e12 * self.gpu.attention_prefill_efficiency
        )
        self._prefill_s_per_pair_full = kv_layers * prefill_pair_s
        self._prefill_s_per_pair_sliding = self._sliding_layers * prefill_pair_s
        self._prefill_fixed_s = m.layers * self.gpu.attention_prefill_launch_s
        self._prefill_s_per_token = m.layers * hq_gpu * self.gpu.attention_prefill_row_s

        # Tabulate everything that depends only on the batch's token count (python lists: fastest
        # scalar indexing on the hot path).
        tokens = np.arange(TABLE_TOKENS + 1, dtype=np.float64)
        self._token_table = self._token_time_s(tokens)
        self._lm_head_table = self._lm_head_time_s(tokens)
        self._token_list: list[float] = self._token_table.tolist()
        self._lm_head_list: list[float] = self._lm_head_table.tolist()

    # -- construction helpers --------------------------------------------------------------------

    def _activation_bytes(self) -> float:
        """Per-GPU activation workspace for an ``ACTIVATION_RESERVE_TOKENS`` chunk (a few live buffers)."""
        m, tp = self.model, self.tp
        ffn_width = max(m.intermediate, m.active_experts * m.expert_intermediate) * 2 / tp
        qkv_width = sum(n for _, n in attention_projection_shapes(m, tp))
        return ACTIVATION_RESERVE_TOKENS * ACTIVATION_BYTES * (4 * m.hidden + qkv_width + ffn_width)

    def _token_time_s(self, tokens: np.ndarray) -> np.ndarray:
        """Linear layers, element-wise kernels and all-reduces of all layers for ``tokens`` batch tokens."""
        m, gpu, tp = self.model, self.gpu, self.tp
        dense_peak = gpu.peak_flops_per_s(m.dense_precision)
        dense_bpp = BYTES_PER_PARAM[m.dense_precision]
        ffn_peak = gpu.peak_flops_per_s(m.weight_precision)
        ffn_bpp = BYTES_PER_PARAM[m.weight_precision]

        attention_s = sum(
            gemm_time_s(gpu, tokens, k, n, weight_bytes_per_param=dense_bpp, peak_flops_per_s=dense_peak)
            for k, n in attention_projection_shapes(m, tp)
        )
        qk_heads_gpu = m.q_heads / tp + (1.0 if m.attention == "mla" else max(m.kv_heads / tp, 1.0))
        allreduce_s = 2.0 * allreduce_time_s(gpu, tokens * m.hidden * ACTIVATION_BYTES, tp)
        up = 2 if m.gated_mlp else 1

        def dense_ffn_s(width: float) -> np.ndarray:
            return gemm_time_s(
                gpu,
                tokens,
                m.hidden,
                up * width / tp,
                weight_bytes_per_param=ffn_bpp,
                peak_flops_per_s=ffn_peak,
            ) + gemm_time_s(
                gpu, tokens, width / tp, m.hidden, weight_bytes_per_param=ffn_bpp, peak_flops_per_s=ffn_peak
            )

        common_s = attention_s + allreduce_s
        if not m.is_moe:
            layer_s = (
                common_s
                + dense_ffn_s(m.intermediate)
                + elementwise_time_s(
                    gpu,
                    tokens,
                    elementwise_bytes_per_token(
                        m.hidden, qk_heads_gpu, m.head_dim, m.intermediate / tp, m.gated_mlp
                    ),
                )
            )
            return np.asarray(m.layers * layer_s)

        total = np.zeros_like(tokens)
        if m.dense_layers:
            dense_layer_s = (
                common_s
                + dense_ffn_s(m.intermediate)
                + elementwise_time_s(
                    gpu,
                    tokens,
                    elementwise_bytes_per_token(
                        m.hidden, qk_heads_gpu, m.head_dim, m.intermediate / tp, m.gated_mlp
                    ),
                )
            )
            total += m.dense_layers * dense_layer_s
        rows = tokens * m.active_experts
        active = expected_active_experts(m.experts, m.active_experts, tokens)
        ie = m.expert_intermediate
        experts_s = gemm_time_s(
            gpu,
            rows,
            m.hidden,
            up * ie / tp,
            matrices=active,
            weight_bytes_per_param=ffn_bpp,
            peak_flops_per_s=ffn_peak,
        ) + gemm_time_s(
            gpu,
            rows,
            ie / tp,
            m.hidden,
            matrices=active,
            weight_bytes_per_param=ffn_bpp,
            peak_flops_per_s=ffn_peak,
        )
        router_s = gemm_time_s(
            gpu, tokens, m.hidden, m.experts, weight_bytes_per_param=dense_bpp, peak_flops_per_s=dense_peak
        )
        shared_s = dense_ffn_s(m.shared_experts * ie) if m.shared_experts else 0.0
        ffn_width_gpu = (m.active_experts + m.shared_experts) * ie / tp
        moe_layer_s = (
            common_s
            + experts_s
            + router_s
            + shared_s
            + elementwise_time_s(
                gpu,
                tokens,
                elementwise_bytes_per_token(m.hidden, qk_heads_gpu, m.head_dim, ffn_width_gpu, m.gated_mlp),
            )
        )
        total += m.moe_layers * moe_layer_s
        return np.asarray(total)

    def _lm_head_time_s(self, logits_rows: np.ndarray) -> np.ndarray:
        m = self.model
        return gemm_time_s(
            self.gpu,
            logits_rows,
            m.hidden,
            m.vocab / self.tp,
            weight_bytes_per_param=BYTES_PER_PARAM[m.dense_precision],
            peak_flops_per_s=self.gpu.peak_flops_per_s(m.dense_precision),
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
        else:
            total_s = float(
                self._token_time_s(np.array([float(tokens)]))[0]
                + self._lm_head_time_s(np.array([float(logits_rows)]))[0]
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
        """Whole prefill run alone in chunks of chunk_tokens."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        total_s = 0.0
        done = 0
        while done < new_tokens:
            chunk = min(chunk_tokens, new_tokens - done)
            total_s += self.iteration_time_s(((chunk, cached_tokens + done),))
            done += chunk
        return total_s

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
        return (
            f"CostModel({self.gpu.name}, {self.model.name}, tp={self.tp}, "
            f"kv_capacity_tokens={self.kv_capacity_tokens})"
        )

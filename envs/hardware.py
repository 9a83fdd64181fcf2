"""GPU catalog and the model spec type of the cost model.

``GPUSpec`` holds public datasheet numbers (dense tensor throughput without sparsity, HBM size and
bandwidth, NVLink bandwidth per direction, NVLink domain size and scale-out NIC bandwidth) plus
efficiency knobs fitted by ``envs.calibration`` to Vidur's H100 / A100 operator measurements. H200,
B200 and GB300 were never measured here: they reuse the H100 efficiency knobs (same software stack,
same kind of tensor cores), so their timings are datasheet extrapolations. The all-to-all knobs come
from DeepEP's published H800 figures and are measured on no GPU here.

``ModelSpec`` holds the architecture numbers the cost model needs. The model catalog is a folder of
Hugging Face configs read by ``envs.models`` (``MODELS`` and ``get_model`` here delegate to it);
``docs/cost_model.md`` lists the source of each entry.

Look-ups are case-insensitive and accept aliases: ``get_gpu("h200")``, ``get_model("gpt-oss")``;
``get_model`` also takes the path of a ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

Precision = Literal["bf16", "fp8", "fp4"]
AttentionKind = Literal["gqa", "mla"]
_Spec = TypeVar("_Spec")

BYTES_PER_PARAM: dict[str, float] = {
    "bf16": 2.0,
    "fp8": 1.0,
    # MXFP4: 4-bit values plus one 8-bit scale per 32 values = 4.25 bits.
    "fp4": 4.25 / 8.0,
}

# --- Fitted by `python -m envs.calibration` on the shipped points (envs/data/calibration/). ---------
# GEMM compute efficiency (fraction of peak dense throughput) as a function of the GEMM's M dimension
# (rows per weight matrix), interpolated in log2(rows); flat outside the knots. Below ~128 rows the
# measured BF16 GEMMs are bound by weight reads, so the data only bound the efficiency there; the fit
# takes the highest value they allow and keeps the curve non-decreasing (see envs/calibration.py).
_H100_GEMM_TOKENS: tuple[int, ...] = (1, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096)
_H100_GEMM_EFFICIENCY: tuple[float, ...] = (
    0.35,
    0.35,
    0.35,
    0.35,
    0.35,
    0.435,
    0.505,
    0.615,
    0.615,
    0.615,
    0.73,
    0.73,
    0.73,
)
_A100_GEMM_TOKENS: tuple[int, ...] = (
    1,
    16,
    32,
    64,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
)
_A100_GEMM_EFFICIENCY: tuple[float, ...] = (
    0.155,
    0.155,
    0.155,
    0.31,
    0.48,
    0.52,
    0.655,
    0.675,
    0.7,
    0.7,
    0.7,
    0.755,
    0.755,
    0.755,
    0.755,
    0.765,
)
# Attention was measured on A100 only (Vidur e2d00e9); every GPU uses these efficiencies.
_ATTENTION_KNOBS: dict[str, float] = {
    "attention_prefill_launch_s": 5.186e-06,
    "attention_prefill_row_s": 4.226e-09,
    "attention_prefill_efficiency": 0.4175,
    "attention_decode_launch_s": 1.279e-05,
    "attention_decode_per_request_s": 0.0,
    "attention_decode_memory_efficiency": 0.7581,
}


class SettingError(ValueError):
    """A deployment setting the model or GPU cannot take: ``field`` (an argument name such as ``tp``
    or ``dtype``) and its ``value`` name it, so a command line can name its flag; ``detail`` says why.
    ``str()`` is ``"<field>=<value>: <detail>"``."""

    def __init__(self, field: str, value: object, detail: str) -> None:
        super().__init__(f"{field}={value}: {detail}")
        self.field = field
        self.value = value
        self.detail = detail


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One accelerator. Throughputs are dense (no 2:4 sparsity), per GPU."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    """0 where the tensor cores have no FP8 path (A100)."""
    fp4_tflops: float
    """0 where the tensor cores have no FP4 path (Hopper and older)."""
    hbm_gb: float
    """HBM per GPU in decimal GB as the datasheet states it (conservative: 80 GB is 80e9 bytes)."""
    hbm_tb_per_s: float
    nvlink_gb_per_s: float
    """NVLink bandwidth per direction per GPU (half the datasheet's bidirectional figure)."""
    # Efficiency knobs, fitted by envs.calibration (see docs/cost_model.md for the fit and its error).
    gemm_efficiency_tokens: tuple[int, ...] = _H100_GEMM_TOKENS
    gemm_efficiency: tuple[float, ...] = _H100_GEMM_EFFICIENCY
    memory_efficiency: float = 0.87
    """Fraction of HBM bandwidth a weight-streaming GEMM reaches."""
    kernel_launch_s: float = 3.6e-6
    """Fixed cost added to every GEMM (launch, tail of the previous kernel)."""
    elementwise_memory_efficiency: float = 0.5
    """Fraction of HBM bandwidth reached by norms, rotary, activation and residual adds."""
    elementwise_launch_s: float = 1.5e-5
    """Fixed cost of those element-wise kernels per layer."""
    attention_prefill_efficiency: float = 0.5
    """Fraction of the BF16 peak reached by prefill (flash) attention."""
    attention_prefill_launch_s: float = 1.0e-5
    attention_prefill_row_s: float = 4.0e-9
    """Prefill attention cost per new token per query head on a GPU (per layer)."""
    attention_decode_memory_efficiency: float = 0.6
    """Fraction of HBM bandwidth reached by the paged decode-attention KV read."""
    attention_decode_launch_s: float = 8.0e-6
    attention_decode_per_request_s: float = 5.0e-8
    allreduce_latency_s: float = 2.0e-5
    """Fixed cost of one all-reduce (per call)."""
    allreduce_bus_efficiency: float = 0.75
    """Ring bus bandwidth reached, as a fraction of ``nvlink_gb_per_s``."""
    gpus_per_node: int = 8
    """GPUs in one NVLink domain (8 on an HGX board, 72 in an NVL72 rack)."""
    scale_out_gb_per_s: float = 50.0
    """RDMA bandwidth per GPU per direction between NVLink domains (one 400 Gb/s NIC per GPU)."""
    all_to_all_latency_s: float = 5.0e-5
    """Fixed cost of one MoE dispatch or combine. Not measured here: read off DeepEP's published H800
    low-latency table (EP16-EP64: measured time minus bytes at 50 GB/s is 45-57 us)."""
    all_to_all_nvlink_efficiency: float = 0.77
    """Share of ``nvlink_gb_per_s`` an all-to-all reaches inside a node (DeepEP's published H800 figure:
    153 of 200 GB/s). Not measured here."""
    all_to_all_rdma_efficiency: float = 1.0
    """Share of ``scale_out_gb_per_s`` an all-to-all reaches between nodes (DeepEP's published H800
    normal kernels: 43-58 GB/s, median 51, on 400 Gb/s NICs). Not measured here."""
    measured: bool = False
    """True when the knobs were fitted on this GPU's own measurements (H100, A100)."""

    def peak_flops_per_s(self, precision: Precision) -> float:
        """Tensor-core peak for weights stored at ``precision``; BF16 where the GPU lacks that path.

        Weight-only quantisation is how FP4/FP8 checkpoints run on GPUs without those tensor-core
        paths (e.g. MXFP4 gpt-oss on Hopper: weights dequantised, math in BF16).
        """
        native = {"fp4": self.fp4_tflops, "fp8": self.fp8_tflops, "bf16": self.bf16_tflops}[precision]
        tflops = native if native > 0 else self.bf16_tflops
        if tflops <= 0:
            raise ValueError(f"GPU {self.name!r} has no BF16 throughput set")
        return tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tb_per_s * 1e12


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture numbers of one decoder-only transformer (per the model's published config)."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    """Query/key head dimension (MLA: nope + rope part)."""
    intermediate: int
    """Dense FFN intermediate size (0 when every layer is MoE)."""
    vocab: int
    total_params_b: float
    """Published total parameter count in billions (checked against our count in tests/docs)."""
    v_head_dim: int = 0
    """Value head dimension; 0 means ``head_dim``."""
    experts: int = 0
    """Routed experts per MoE layer (0 = dense model)."""
    active_experts: int = 0
    """Routed experts per token (top-k)."""
    expert_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    """Leading layers with a dense FFN of ``intermediate`` size in an MoE model (GLM's
    ``first_k_dense_replace``). Ignored for dense models, where every layer is dense."""
    gated_mlp: bool = True
    weight_precision: Precision = "bf16"
    """Precision of the FFN / expert weights (the bulk of the parameters)."""
    dense_precision: Precision = "bf16"
    """Precision of the attention projections."""
    embedding_precision: Precision = "bf16"
    """Precision of the embeddings, the LM head and the MoE router, which FP8 and FP4 checkpoints keep
    unquantised (DeepSeek-V3, ModelOpt and compressed-tensors checkpoints all exclude them)."""
    kv_precision: Precision = "bf16"
    attention: AttentionKind = "gqa"
    kv_lora_rank: int = 0
    """MLA only: width of the compressed (latent) KV cache."""
    q_lora_rank: int = 0
    """MLA only: width of the compressed query (0 = full-rank query projection)."""
    rope_head_dim: int = 0
    """MLA only: decoupled rotary key width stored next to the latent."""
    sliding_window_layers: int = 0
    sliding_window_tokens: int = 0
    tied_embeddings: bool = False
    max_context_tokens: int = 131072
    """Context window: input plus output tokens of one request (the config's
    ``max_position_embeddings``, or the window the model card states when RoPE scaling extends it).
    The simulator never serves a request past it (see ``ClusterConfig.context_policy``)."""
    aliases: tuple[str, ...] = field(default=(), compare=False)
    source: str = field(default="", compare=False)
    """Where the numbers come from (a config file, a published checkpoint)."""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def full_attention_layers(self) -> int:
        return self.layers - self.sliding_window_layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0


def _gpu(
    name: str,
    bf16: float,
    fp8: float,
    fp4: float,
    hbm_gb: float,
    hbm_tb_s: float,
    nvlink_gb_s: float,
    **knobs: object,
) -> GPUSpec:
    return GPUSpec(name, bf16, fp8, fp4, hbm_gb, hbm_tb_s, nvlink_gb_s, **knobs)  # type: ignore[arg-type]


_H100_KNOBS: dict[str, object] = {
    "gemm_efficiency_tokens": _H100_GEMM_TOKENS,
    "gemm_efficiency": _H100_GEMM_EFFICIENCY,
    "memory_efficiency": 0.8672,
    "kernel_launch_s": 3.467e-06,
    "elementwise_launch_s": 1.446e-05,
    "elementwise_memory_efficiency": 0.7006,
    "allreduce_latency_s": 2.159e-05,
    "allreduce_bus_efficiency": 0.7093,
    **_ATTENTION_KNOBS,
}
_A100_KNOBS: dict[str, object] = {
    "gemm_efficiency_tokens": _A100_GEMM_TOKENS,
    "gemm_efficiency": _A100_GEMM_EFFICIENCY,
    "memory_efficiency": 0.7794,
    "kernel_launch_s": 4.524e-06,
    "elementwise_launch_s": 1.734e-05,
    "elementwise_memory_efficiency": 0.5851,
    "allreduce_latency_s": 2.719e-05,
    "allreduce_bus_efficiency": 0.4928,
    **_ATTENTION_KNOBS,
}

GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 SXM4 80GB datasheet: 312 TF BF16 dense, 2,039 GB/s, NVLink 600 GB/s bidirectional.
    # DGX A100: one 200 Gb/s HDR NIC per GPU.
    "A100": _gpu(
        "A100", 312.0, 0.0, 0.0, 80.0, 2.039, 300.0, scale_out_gb_per_s=25.0, measured=True, **_A100_KNOBS
    ),
    # NVIDIA H100 SXM5 datasheet: 989 TF BF16 / 1,979 TF FP8 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
    "H100": _gpu("H100", 989.0, 1979.0, 0.0, 80.0, 3.35, 450.0, measured=True, **_H100_KNOBS),
    # NVIDIA H200 SXM datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    "H200": _gpu("H200", 989.0, 1979.0, 0.0, 141.0, 4.8, 450.0, **_H100_KNOBS),
    # NVIDIA HGX B200 datasheet (per GPU, dense = half the sparse figure): 2.25 PF BF16, 4.5 PF FP8,
    # 9 PF FP4, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s bidirectional.
    "B200": _gpu("B200", 2250.0, 4500.0, 9000.0, 180.0, 8.0, 900.0, **_H100_KNOBS),
    # NVIDIA GB300 NVL72 datasheet / 72 GPUs: 15 PF FP4 dense, FP8 5 PF and BF16 2.5 PF dense
    # (half of the listed sparse figures), 288 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s bidirectional.
    # One NVLink domain of 72 GPUs; ConnectX-8 800 Gb/s per GPU between racks.
    "GB300": _gpu(
        "GB300",
        2500.0,
        5000.0,
        15000.0,
        288.0,
        8.0,
        900.0,
        gpus_per_node=72,
        scale_out_gb_per_s=100.0,
        **_H100_KNOBS,
    ),
}
_GPU_ALIASES: dict[str, str] = {
    "a100-80gb": "A100",
    "a100-sxm": "A100",
    "h100-sxm": "H100",
    "h100-80gb": "H100",
    "h200-sxm": "H200",
    "hgx-b200": "B200",
    "gb300-nvl72": "GB300",
    "b300": "GB300",
}


def _lookup(registry: dict[str, _Spec], aliases: dict[str, str], name: str, kind: str) -> _Spec:
    key = name.strip().lower()
    key = aliases.get(key, key).lower()
    for registered, spec in registry.items():
        if registered.lower() == key:
            return spec
    raise KeyError(f"unknown {kind} {name!r}; choices: {', '.join(sorted(registry, key=str.lower))}")


def get_gpu(name: str) -> GPUSpec:
    """The GPU called ``name`` (case-insensitive, aliases such as ``h100-sxm`` accepted)."""
    return _lookup(GPUS, {k.lower(): v for k, v in _GPU_ALIASES.items()}, name, "GPU")


def get_model(name: str) -> ModelSpec:
    """The model called ``name``: a catalog name (case-insensitive; HF ids such as
    ``openai/gpt-oss-120b`` accepted) or the path of a Hugging Face ``config.json``.

    The catalog is the shipped ``envs/data/models/`` plus every folder listed in the
    ``CROSSFLOW_MODELS_DIR`` environment variable (``os.pathsep``-separated); see ``envs.models``.
    """
    from envs.models import lookup_model

    return lookup_model(name)


def __getattr__(name: str) -> dict[str, ModelSpec]:
    # ``MODELS`` is loaded from the catalog files on first use (they import this module's ModelSpec).
    if name == "MODELS":
        from envs.models import catalog

        return catalog()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def with_knobs(gpu: GPUSpec, **knobs: object) -> GPUSpec:
    """A copy of ``gpu`` with some efficiency knobs replaced (used by calibration and sweeps)."""
    return replace(gpu, **knobs)  # type: ignore[arg-type]

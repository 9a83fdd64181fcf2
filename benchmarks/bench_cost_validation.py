"""End-to-end throughputs of the cost model against published engine benchmarks.

Each row of ``PUBLISHED`` is one figure from a public benchmark table, with the setup that table
states; ``ours`` replays the same setup on ``envs.cost_model.CostModel`` with the project's default
knobs (nothing is fitted to these figures):

* ``offline``: an in-flight-batching engine given every request at once (``trtllm-bench
  throughput``): chunked prefill under a per-iteration token budget, decode of every running request
  each iteration, admission while the batch cap and the KV cache (reserving input + output per
  request, TensorRT-LLM's guaranteed-no-evict policy) allow. The figure is total output tokens over
  the makespan.
* ``prefill`` / ``decode``: one PD worker's steady-state iteration as the source measured it (a full
  prefill batch of fixed-length prompts; a full decode batch at a fixed KV length), per 8-GPU node.

Run: ``python benchmarks/bench_cost_validation.py`` (prints the markdown table of docs/cost_model.md).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

from envs.cost_model import CostModel
from envs.hardware import Precision
from envs.models import resolve_model

SOURCES = {
    "trtllm": "NVIDIA TensorRT-LLM `docs/source/performance/perf-overview.md` (v1.0 docs, commit 00f3768): "
    "`trtllm-bench throughput`, PyTorch backend, ModelOpt FP8 checkpoints, total output tokens/s",
    "lmsys": "LMSYS blog 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 "
    "H100 GPUs' (2025-05-05): SGLang, DeepEP, DeepGEMM, two-batch overlap, EPLB; tokens/s per node",
}


ENGINES = {"trtllm": "TensorRT-LLM", "lmsys": "SGLang"}
FIGURES = {
    "offline": "output tok/s, offline",
    "prefill": "input tok/s per node, prefill",
    "decode": "output tok/s per node, decode",
}


@dataclass(frozen=True)
class Published:
    """One published figure and the setup it states."""

    source: str
    kind: str  # "offline" | "prefill" | "decode"
    gpu: str
    model: str
    tp: int
    input_tokens: int
    output_tokens: int
    figure: float
    requests: int = 0
    """offline: requests in the run (the table's num_requests for that ISL/OSL)."""
    ep: int = 1
    dp_attention: int = 1
    batch_per_gpu: int = 0
    """prefill: tokens per GPU per batch; decode: requests per GPU."""
    kv_dtype: Precision | None = None

    def label(self) -> str:
        parallel = f"TP{self.tp}" + (f" EP{self.ep}" if self.ep > 1 else "")
        parallel += f" DP-attn{self.dp_attention}" if self.dp_attention > 1 else ""
        return parallel


_TRT_8B = {  # Llama 3.1 8B FP8, TP1: (ISL, OSL, requests): (H200, H100)
    (128, 128, 30000): (27911, 28312),
    (128, 2048, 3000): (26221, 22714),
    (2048, 128, 3000): (3538, 3450),
    (1000, 1000, 3000): (17744, 15220),
    (2048, 2048, 1500): (12194, 9305),
    (5000, 500, 1500): (3902, 3459),
    (20000, 2000, 1000): (1804, 1351),
}
_TRT_70B = {  # Llama 3.3 70B FP8: H200 TP1, H100 TP2
    (128, 128, 30000): (3803, 6378),
    (128, 2048, 3000): (4336, 6651),
    (2048, 128, 3000): (442, 762),
    (1000, 1000, 3000): (2909, 4205),
    (2048, 2048, 1500): (2003, 3082),
    (5000, 500, 1500): (566, 898),
}
_TRT_QWEN235 = {  # Qwen3-235B-A22B FP8: H200 TP8, H100 TP8 (attention DP and EP as the table's MoE recipe)
    (128, 2048, 3000): (42821, 19658),
    (1000, 1000, 3000): (23789, 14898),
    (2048, 2048, 1500): (16672, 9924),
    (5000, 500, 1500): (3623, 3225),
}

PUBLISHED: list[Published] = [
    *(
        Published("trtllm", "offline", gpu, "Llama-3.1-8B-FP8", 1, isl, osl, fig, requests=n)
        for (isl, osl, n), figs in _TRT_8B.items()
        for gpu, fig in zip(("H200", "H100"), figs, strict=True)
    ),
    *(
        Published("trtllm", "offline", gpu, "Llama-3.1-70B-FP8", tp, isl, osl, fig, requests=n)
        for (isl, osl, n), figs in _TRT_70B.items()
        for (gpu, tp), fig in zip((("H200", 1), ("H100", 2)), figs, strict=True)
    ),
    *(
        Published(
            "trtllm",
            "offline",
            gpu,
            "Qwen3-235B-A22B-FP8",
            8,
            isl,
            osl,
            fig,
            requests=n,
            ep=8,
            dp_attention=8,
        )
        for (isl, osl, n), figs in _TRT_QWEN235.items()
        for gpu, fig in zip(("H200", "H100"), figs, strict=True)
    ),
    # DeepSeek-V3 prefill: 4 nodes, EP32 with DP attention, 16,384 tokens per GPU per batch.
    *(
        Published(
            "lmsys",
            "prefill",
            "H100",
            "DeepSeek-V3",
            32,
            isl,
            0,
            fig,
            ep=32,
            dp_attention=32,
            batch_per_gpu=16384,
        )
        for isl, fig in ((1024, 57674), (2048, 54543), (4096, 50302))
    ),
    # DeepSeek-V3 decode: 9 nodes, EP72 with DP attention, 256 requests per GPU at KV length 2,000.
    Published(
        "lmsys",
        "decode",
        "H100",
        "DeepSeek-V3",
        72,
        2000,
        1,
        22282,
        ep=72,
        dp_attention=72,
        batch_per_gpu=256,
    ),
]


def offline_output_tokens_per_s(
    cm: CostModel,
    input_tokens: int,
    output_tokens: int,
    requests: int,
    *,
    max_batch: int,
    max_num_tokens: int,
) -> float:
    """Output tokens per second of ``requests`` identical requests given to one engine at once."""
    per_request_kv = input_tokens + output_tokens
    running_cap = min(max_batch, cm.kv_capacity_tokens // per_request_kv)
    if running_cap < 1:
        raise ValueError(f"{cm}: one request of {per_request_kv} tokens does not fit in the KV cache")
    waiting = requests
    prefilling: list[int] = []  # tokens already prefilled of each admitted request
    cohorts: list[tuple[int, int]] = []  # (requests, iteration their prefill finished), oldest first
    decoding = weighted_start = 0  # requests decoding; sum of requests x start iteration
    elapsed_s, iteration = 0.0, 0
    while waiting or prefilling or cohorts:
        budget = max_num_tokens - decoding
        while waiting and len(prefilling) + decoding < running_cap and (not prefilling or budget > 0):
            if sum(input_tokens - done for done in prefilling) >= budget:
                break
            prefilling.append(0)
            waiting -= 1
        chunks, finished_prefill = [], 0
        for i, done in enumerate(prefilling):
            if budget <= 0:
                break
            chunk = min(budget, input_tokens - done)
            chunks.append((chunk, done))
            prefilling[i] += chunk
            budget -= chunk
        context = decoding * (input_tokens + iteration) - weighted_start
        elapsed_s += cm.iteration_time_s(chunks, decoding, context)
        # Requests whose prefill completed emit their first token and decode from the next iteration.
        finished_prefill = sum(1 for done in prefilling if done == input_tokens)
        prefilling = [done for done in prefilling if done < input_tokens]
        while cohorts and iteration - cohorts[0][1] + 1 >= output_tokens - 1:
            count, start = cohorts.pop(0)
            decoding -= count
            weighted_start -= count * start
        if finished_prefill and output_tokens > 1:
            cohorts.append((finished_prefill, iteration + 1))
            decoding += finished_prefill
            weighted_start += finished_prefill * (iteration + 1)
        iteration += 1
    return requests * output_tokens / elapsed_s


def ours(
    row: Published,
    *,
    max_batch: int = 2048,
    max_num_tokens: int = 8192,
    kv_dtype: Precision | None = None,
    iteration_overhead_s: float | None = None,
) -> float:
    """The cost model's figure for ``row``'s setup (see the module docstring)."""
    spec = resolve_model(row.model, row.gpu, kv_dtype=kv_dtype or row.kv_dtype)
    cm = CostModel(
        row.gpu,
        spec,
        row.tp,
        ep=row.ep,
        dp_attention=row.dp_attention,
        iteration_overhead_s=iteration_overhead_s,
    )
    nodes = row.tp / 8
    if row.kind == "offline":
        return offline_output_tokens_per_s(
            cm,
            row.input_tokens,
            row.output_tokens,
            row.requests,
            max_batch=max_batch,
            max_num_tokens=max_num_tokens,
        )
    if row.kind == "prefill":
        prompts = row.batch_per_gpu * row.tp // row.input_tokens
        step_s = cm.iteration_time_s([(row.input_tokens, 0)] * prompts)
        return prompts * row.input_tokens / step_s / nodes
    if row.kind == "decode":
        batch = row.batch_per_gpu * row.tp
        if batch * row.input_tokens > cm.kv_capacity_tokens:
            raise ValueError(f"{cm}: {batch} requests x {row.input_tokens} tokens exceed the KV cache")
        return batch / cm.decode_step_time_s(batch, batch * row.input_tokens) / nodes
    raise ValueError(f"unknown kind {row.kind!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--max-batch", type=int, default=2048, help="offline engine's batch cap (default 2048)"
    )
    parser.add_argument(
        "--max-num-tokens", type=int, default=8192, help="offline engine's token budget (8192)"
    )
    parser.add_argument(
        "--iteration-overhead-s",
        type=float,
        default=None,
        help="CPU cost per iteration (default: the cost model's, 0.87 ms; 0 for an engine that overlaps it)",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    print(
        "| engine | figure | setup | GPU | model | weights | ISL / OSL | published | ours, BF16 KV | ratio "
        "| ours, FP8 KV | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    ratios: dict[str, list[float]] = {}
    for row in PUBLISHED:
        kv_choices: tuple[Precision, ...] = ("bf16", "fp8") if row.kind == "offline" else ("bf16",)
        figures = [
            ours(
                row,
                max_batch=args.max_batch,
                max_num_tokens=args.max_num_tokens,
                kv_dtype=kv,
                iteration_overhead_s=args.iteration_overhead_s,
            )
            for kv in kv_choices
        ]
        spec = resolve_model(row.model, row.gpu)
        cells = [f"{f:,.0f} | {f / row.figure:.2f}" for f in figures] + ["– | –"] * (2 - len(figures))
        for kv, f in zip(kv_choices, figures, strict=True):
            ratios.setdefault(f"{ENGINES[row.source]} {row.kind}, {kv} KV", []).append(f / row.figure)
        io = {
            "offline": f"{row.input_tokens} / {row.output_tokens}",
            "prefill": f"{row.input_tokens} / –",
            "decode": f"KV {row.input_tokens}",
        }[row.kind]
        print(
            f"| {ENGINES[row.source]} | {FIGURES[row.kind]} | {row.label()} | {row.gpu} | {row.model} | "
            f"{spec.weight_precision} | {io} | {row.figure:,.0f} | {' | '.join(cells)} |"
        )
    print()
    for key, values in ratios.items():
        geo = math.exp(sum(map(math.log, values)) / len(values))
        print(
            f"{key}: {len(values)} rows, ratio geo-mean {geo:.2f}, range {min(values):.2f}-{max(values):.2f}"
        )
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    for key, text in SOURCES.items():
        print(f"{key}: {text}")


if __name__ == "__main__":
    main()

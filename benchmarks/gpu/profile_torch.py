"""Real interference profiles on a GPU with torch alone: operator tables and mixed iterations.

For each catalog model (at its TP degree, one GPU's shard) this times, with random BF16 weights:

1. ``gemm.csv`` -- every linear operator of a layer (the projections of ``envs.cost_model``'s
   accounting, the MoE router, the grouped expert GEMMs at uniform random routing, the LM head) over
   token counts, as Vidur's ``mlp.csv``: ``time_stats.<op>.{min,max,mean,median,std}`` in ms;
2. ``attention.csv`` -- prefill attention (causal chunk over a cached prefix) and decode attention
   (a batch over its KV cache), as Vidur's ``attention.csv``;
3. ``profiles.csv`` -- mixed iterations: a stack of real-shaped transformer layers runs a prefill
   chunk and a decode batch together, for node states x chunk sizes x repeats, at checkpoints of each
   state's evolution, written in the profile schema (``interference_model.columns``) so
   ``crossflow fit-interference`` / ``eval-interference`` take it as they are;
4. ``meta.json`` -- device, versions, what was measured and how long it took.

What it is and is not: weights are BF16 (gpt-oss-120b serves MXFP4 experts, GLM-5 FP8), so a
weight-streaming step reads more bytes than in serving; the stack has ``--stack-layers`` layers and
an iteration is scaled to the model's layer count (plus the LM head); rotary embeddings, sampling,
the CPU scheduler and TP all-reduces are not included (one GPU); kernels run eagerly, without the
CUDA graphs SGLang uses for decode. Contexts within a state are equal; each state's requests leave
at spread-out steps (remaining output uniform on (0, 2 x mean]).

    python benchmarks/gpu/profile_torch.py --out gpu_profiles            # CUDA, < 5 minutes
    python benchmarks/gpu/profile_torch.py --out /tmp/smoke --device cpu --tiny   # CPU smoke test

Needs torch and numpy only; fetches nothing. Run from the repository root (it imports the
project's catalog, cost-model accounting and profile columns from the working tree).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from envs.cost_model import CostModel, attention_projection_shapes  # noqa: E402
from envs.hardware import GPUS, ModelSpec, get_model  # noqa: E402
from interference_model.columns import PROFILE_COLUMNS, PROFILE_SCHEMA_VERSION, drain_features  # noqa: E402

STATS = ("min", "max", "mean", "median", "std")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What to measure (the defaults fit a few minutes on one H200 for two models)."""

    num_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    prefill_chunks: tuple[int, ...] = (64, 256, 1024, 4096)
    prefill_kv: tuple[int, ...] = (0, 4096, 16384)
    decode_batches: tuple[int, ...] = (1, 4, 16, 64, 128)
    decode_kv: tuple[int, ...] = (1024, 4096, 16384)
    state_batches: tuple[int, ...] = (1, 4, 16, 64, 128)
    state_contexts: tuple[int, ...] = (1024, 4096, 16384)
    state_remaining: tuple[int, ...] = (64, 512)
    checkpoints: tuple[int, ...] = (0, 64, 160, 320)
    chunks: tuple[int, ...] = (8, 32, 128, 512, 1024, 2048)
    repeats: int = 5
    op_repeats: int = 7
    max_state_tokens: int = 1_000_000
    """Largest batch x context of a state (KV cache of the stack, per layer shared)."""


TINY = Sweep(
    num_tokens=(1, 8, 32),
    prefill_chunks=(16,),
    prefill_kv=(0, 32),
    decode_batches=(1, 3),
    decode_kv=(32,),
    state_batches=(1, 3),
    state_contexts=(48,),
    state_remaining=(6,),
    checkpoints=(0, 4),
    chunks=(8, 32),
    repeats=2,
    op_repeats=2,
    max_state_tokens=4096,
)


def tiny_spec(spec: ModelSpec) -> ModelSpec:
    """The catalog model scaled down to run in a second on a CPU (same kind of attention and FFN)."""
    mla = spec.attention == "mla"
    return dataclasses.replace(
        spec,
        hidden=64,
        q_heads=4,
        kv_heads=4 if mla else 2,
        head_dim=24 if mla else 16,
        v_head_dim=16 if mla else 0,
        intermediate=96 if spec.intermediate else 0,
        vocab=512,
        experts=8 if spec.experts else 0,
        active_experts=2 if spec.experts else 0,
        expert_intermediate=32 if spec.experts else 0,
        kv_lora_rank=32 if mla else 0,
        q_lora_rank=32 if spec.q_lora_rank else 0,
        rope_head_dim=8 if mla else 0,
        sliding_window_tokens=8 if spec.sliding_window_layers else 0,
    )


class Timer:
    """Times a callable on the device: CUDA events on a GPU, ``perf_counter`` on the CPU (ms)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], repeats: int, warmup: int = 2) -> list[float]:
        for _ in range(warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(float(start.elapsed_time(end)))
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
        return out


def stats(times_ms: list[float], op: str) -> dict[str, float]:
    """Vidur's ``time_stats.<op>.{min,max,mean,median,std}`` columns (ms)."""
    std = statistics.pstdev(times_ms) if len(times_ms) > 1 else 0.0
    values = (min(times_ms), max(times_ms), statistics.fmean(times_ms), statistics.median(times_ms), std)
    return {f"time_stats.{op}.{s}": v for s, v in zip(STATS, values, strict=True)}


class Experts:
    """Routed experts of one layer: ``up`` (E, 2I or I, h) and ``down`` (E, h, I), as out x in."""

    def __init__(self, spec: ModelSpec, tp: int, device: torch.device, dtype: torch.dtype) -> None:
        width = spec.expert_intermediate // tp
        up = (2 if spec.gated_mlp else 1) * width
        self.experts, self.top_k, self.gated = spec.experts, spec.active_experts, spec.gated_mlp
        self.up = torch.randn(spec.experts, up, spec.hidden, device=device, dtype=dtype) * 0.02
        self.down = torch.randn(spec.experts, spec.hidden, width, device=device, dtype=dtype) * 0.02
        self.grouped = _grouped_mm_mode(device, dtype)

    def route(self, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform random top-k routing, relabelled so the active experts come first (the weights are
        random, so experts are interchangeable): (rows per active expert, token index per row)."""
        scores = torch.rand(tokens, self.experts, generator=generator)
        choice = scores.topk(self.top_k, dim=1).indices.flatten()
        token = torch.arange(tokens).repeat_interleave(self.top_k)
        counts = torch.bincount(choice, minlength=self.experts)
        active = torch.nonzero(counts).flatten()
        relabel = torch.empty(self.experts, dtype=torch.long)
        relabel[active] = torch.arange(len(active))
        order = torch.argsort(relabel[choice], stable=True)
        return counts[active], token[order]

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        n = len(counts)
        if self.grouped:
            if self.grouped == "padded":  # groups padded to 16 rows with zeros (the kernel's alignment)
                padded = (counts + 15) // 16 * 16
                slot = torch.repeat_interleave(torch.cumsum(padded, 0) - padded, counts)
                slot = (
                    slot
                    + torch.arange(len(rows))
                    - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
                )
                xs = torch.zeros(int(padded.sum()), x.shape[1], device=x.device, dtype=x.dtype)
                xs[slot.to(x.device)] = x[rows]
                ends = torch.cumsum(padded, 0)
            else:
                xs, slot, ends = x[rows], None, torch.cumsum(counts, 0)
            offs = ends.to(device=x.device, dtype=torch.int32)
            h = _act(torch._grouped_mm(xs, self.up[:n].transpose(-2, -1), offs=offs), self.gated)
            y = torch._grouped_mm(h, self.down[:n].transpose(-2, -1), offs=offs)
            if slot is not None:
                y = y[slot.to(x.device)]
        else:
            xs = x[rows]
            y = torch.empty(len(rows), x.shape[1], device=x.device, dtype=x.dtype)
            start = 0
            for e, c in enumerate(counts.tolist()):
                part = xs[start : start + c]
                y[start : start + c] = _act(part @ self.up[e].T, self.gated) @ self.down[e].T
                start += c
        out = torch.zeros_like(x)
        out.index_add_(0, rows.to(x.device), y)
        return out


def _dense_ffn(h: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gated: bool) -> torch.Tensor:
    return _act(h @ up.T, gated) @ down.T


def _act(h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return F.silu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _grouped_mm_mode(device: torch.device, dtype: torch.dtype) -> str:
    """How the routed experts run: ``"direct"`` (``torch._grouped_mm`` on groups of any size),
    ``"padded"`` (it needs groups of 16 rows: pad with zeros) or ``""`` (a loop of GEMMs: slow on a
    GPU, where the profile then overstates the expert time; ``meta.json`` says which)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return ""
    b = torch.randn(3, 24, 32, device=device, dtype=dtype)
    for mode, sizes in (("direct", (5, 16, 27)), ("padded", (16, 16, 32))):
        try:
            a = torch.randn(sum(sizes), 32, device=device, dtype=dtype)
            ends = torch.cumsum(torch.tensor(sizes), 0)
            got = fn(a, b.transpose(-2, -1), offs=ends.to(device=device, dtype=torch.int32)).float()
            starts = [0, *ends.tolist()[:-1]]
            want = torch.cat(
                [a[s : s + n] @ b[i].T for i, (s, n) in enumerate(zip(starts, sizes, strict=True))]
            ).float()
            if torch.allclose(got, want, rtol=2e-2, atol=2e-1):
                return mode
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue
    return ""


class Layer:
    """One transformer layer of ``spec`` as one GPU of ``tp`` holds it, with random weights."""

    def __init__(
        self, spec: ModelSpec, tp: int, device: torch.device, dtype: torch.dtype, sliding: bool
    ) -> None:
        self.spec, self.tp, self.sliding = spec, tp, sliding
        g = 0.02

        def w(k: float, n: float) -> torch.Tensor:
            return torch.randn(int(n), int(k), device=device, dtype=dtype) * g

        self.proj = [w(k, n) for k, n in attention_projection_shapes(spec, tp)]
        self.hq = spec.q_heads // tp
        self.hkv = max(spec.kv_heads // tp, 1)
        if spec.is_moe:
            self.router = w(spec.hidden, spec.experts)
            self.experts: Experts | None = Experts(spec, tp, device, dtype)
            width = spec.shared_experts * spec.expert_intermediate // tp
        else:
            self.experts, width = None, spec.intermediate // tp
        self.ffn_up = w(spec.hidden, (2 if spec.gated_mlp else 1) * width) if width else None
        self.ffn_down = w(width, spec.hidden) if width else None

    # -- attention ---------------------------------------------------------------------------------

    def attention(self, h: torch.Tensor, chunk: int, batch: int, kv: KvCache) -> torch.Tensor:
        """Prefill attention of the first ``chunk`` rows (causal, no cached prefix) and decode attention
        of the last ``batch`` rows over ``kv``; returns the attention output before the output GEMM."""
        if self.spec.attention == "mla":
            return self._mla(h, chunk, batch, kv)
        d = self.spec.head_dim
        qkv = h @ self.proj[0].T
        q, k, v = qkv.split([self.hq * d, self.hkv * d, self.hkv * d], dim=-1)
        parts = []
        if chunk:
            qp = q[:chunk].reshape(chunk, self.hq, d).transpose(0, 1)[None]
            kp = k[:chunk].reshape(chunk, self.hkv, d).transpose(0, 1)[None]
            vp = v[:chunk].reshape(chunk, self.hkv, d).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            parts.append(o[0].transpose(0, 1).reshape(chunk, self.hq * d))
        if batch:
            qd = q[chunk:].reshape(batch, self.hq, 1, d)
            kc, vc = kv.gqa(batch)
            if self.sliding:
                kc, vc = (
                    kc[:, :, -self.spec.sliding_window_tokens :],
                    vc[:, :, -self.spec.sliding_window_tokens :],
                )
            o = F.scaled_dot_product_attention(qd, kc, vc, enable_gqa=True)
            parts.append(o.reshape(batch, self.hq * d))
        return torch.cat(parts)

    def _mla(self, h: torch.Tensor, chunk: int, batch: int, kv: KvCache) -> torch.Tensor:
        s = self.spec
        rope, r, dv = s.rope_head_dim, s.kv_lora_rank, s.value_head_dim
        nope = s.head_dim - rope
        if s.q_lora_rank:
            q = (h @ self.proj[0].T) @ self.proj[1].T
            kv_a, kv_b = self.proj[2], self.proj[3]
        else:
            q = h @ self.proj[0].T
            kv_a, kv_b = self.proj[1], self.proj[2]
        q = q.reshape(-1, self.hq, s.head_dim)
        latent = h @ kv_a.T  # (tokens, r + rope)
        parts = []
        if chunk:
            kvb = (latent[:chunk, :r] @ kv_b.T).reshape(chunk, self.hq, nope + dv)
            k_rope = latent[:chunk, None, r:].expand(chunk, self.hq, rope)
            k = torch.cat([kvb[..., :nope], k_rope], dim=-1).transpose(0, 1)[None]
            vp = kvb[..., nope:].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[:chunk].transpose(0, 1)[None], k, vp, is_causal=True)
            parts.append(o[0].transpose(0, 1).reshape(chunk, self.hq * dv))
        if batch:
            w_kvb = kv_b.view(self.hq, nope + dv, r)
            q_nope, q_rope = q[chunk:, :, :nope], q[chunk:, :, nope:]
            q_abs = torch.einsum("bhn,hnr->bhr", q_nope, w_kvb[:, :nope])  # absorbed: scores on the latent
            qd = torch.cat([q_abs, q_rope], dim=-1)  # (batch, heads, r + rope)
            cache = kv.mla(batch)  # (batch, context, r + rope): one latent shared by all heads
            scores = torch.einsum("bhr,bcr->bhc", qd, cache) * (s.head_dim**-0.5)
            o = torch.einsum(
                "bhc,bcr->bhr", torch.softmax(scores.float(), dim=-1).to(qd.dtype), cache[..., :r]
            )
            o = torch.einsum("bhr,hvr->bhv", o, w_kvb[:, nope:])
            parts.append(o.reshape(batch, self.hq * dv))
        return torch.cat(parts)

    # -- whole layer -------------------------------------------------------------------------------

    def __call__(
        self,
        x: torch.Tensor,
        chunk: int,
        batch: int,
        kv: KvCache,
        routing: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],))
        x = x + self.attention(h, chunk, batch, kv) @ self.proj[-1].T
        h = F.rms_norm(x, (x.shape[-1],))
        y = torch.zeros_like(x)
        if self.experts is not None and routing is not None:
            _ = h @ self.router.T  # the router GEMM (its choice is replaced by uniform routing)
            y = self.experts(h, *routing)
        if self.ffn_up is not None and self.ffn_down is not None:
            y = y + _act(h @ self.ffn_up.T, self.spec.gated_mlp) @ self.ffn_down.T
        return x + y


class KvCache:
    """A flat KV cache big enough for the largest state, viewed per state as (batch, heads, ctx, dim)."""

    def __init__(
        self, spec: ModelSpec, tp: int, tokens: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.spec, self.context = spec, 1
        if spec.attention == "mla":
            self.latent = torch.randn(
                tokens, spec.kv_lora_rank + spec.rope_head_dim, device=device, dtype=dtype
            )
        else:
            heads = max(spec.kv_heads // tp, 1)
            self.k = torch.randn(tokens, heads, spec.head_dim, device=device, dtype=dtype)
            self.v = torch.randn(tokens, heads, spec.head_dim, device=device, dtype=dtype)

    def gqa(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch * self.context
        shape = (batch, self.context, self.k.shape[1], self.k.shape[2])
        return self.k[:n].view(shape).transpose(1, 2), self.v[:n].view(shape).transpose(1, 2)

    def mla(self, batch: int) -> torch.Tensor:
        n = batch * self.context
        return self.latent[:n].view(batch, self.context, -1)


class Stack:
    """``layers`` transformer layers and the LM head; an iteration is scaled to the model's depth."""

    def __init__(
        self, spec: ModelSpec, tp: int, layers: int, kv_tokens: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        sliding = [spec.sliding_window_layers > 0 and i % 2 == 0 for i in range(layers)]
        self.layers = [Layer(spec, tp, device, dtype, s) for s in sliding]
        self.lm_head = torch.randn(spec.vocab // tp, spec.hidden, device=device, dtype=dtype) * 0.02
        self.kv = KvCache(spec, tp, kv_tokens, device, dtype)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.scale = spec.layers / layers

    def run(
        self, chunk: int, batch: int, context: int, generator: torch.Generator
    ) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """Closures running the layers of one iteration (``chunk`` prefill tokens + a decode batch at
        ``context``) and its LM head (the decode rows, and the chunk's last row)."""
        self.kv.context = context
        tokens = chunk + batch
        x = torch.randn(tokens, self.spec.hidden, device=self.device, dtype=self.dtype)
        experts = self.layers[0].experts
        routing = None
        if experts is not None:
            counts, rows = experts.route(tokens, generator)
            routing = (counts, rows.to(self.device))
        head_in = torch.randn(
            batch + (1 if chunk else 0), self.spec.hidden, device=self.device, dtype=self.dtype
        )

        def layers() -> Any:
            y = x
            for layer in self.layers:
                y = layer(y, chunk, batch, self.kv, routing)
            return y

        return layers, lambda: head_in @ self.lm_head.T


# --- the three tables ------------------------------------------------------------------------------


def gemm_rows(
    spec: ModelSpec,
    tp: int,
    sweep: Sweep,
    timer: Timer,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> list[dict[str, Any]]:
    """Vidur-style ``mlp.csv`` rows: one per token count, every linear operator of a layer."""
    names = (
        ["attn_q_a_proj", "attn_q_b_proj", "attn_kv_a_proj", "attn_kv_b_proj", "attn_post_proj"]
        if spec.attention == "mla" and spec.q_lora_rank
        else ["attn_q_proj", "attn_kv_a_proj", "attn_kv_b_proj", "attn_post_proj"]
        if spec.attention == "mla"
        else ["attn_pre_proj", "attn_post_proj"]
    )
    shapes = attention_projection_shapes(spec, tp)
    layer = Layer(spec, tp, device, dtype, sliding=False)
    lm_head = torch.randn(spec.vocab // tp, spec.hidden, device=device, dtype=dtype)
    experts = layer.experts
    rows = []
    for tokens in sweep.num_tokens:
        row: dict[str, Any] = {"model": spec.name, "num_tensor_parallel_workers": tp, "num_tokens": tokens}
        ops: list[tuple[str, Callable[[], Any]]] = []
        for name, (k, _), weight in zip(names, shapes, layer.proj, strict=True):
            x = torch.randn(tokens, int(k), device=device, dtype=dtype)
            ops.append((name, functools.partial(torch.matmul, x, weight.T)))
        h = torch.randn(tokens, spec.hidden, device=device, dtype=dtype)
        if experts is not None:
            counts, idx = experts.route(tokens, generator)
            routing = (counts, idx.to(device))
            ops.append(("moe_router", functools.partial(torch.matmul, h, layer.router.T)))
            ops.append(("moe_experts", functools.partial(experts, h, *routing)))
            row["active_experts"] = len(counts)
        if layer.ffn_up is not None and layer.ffn_down is not None:
            up, down = layer.ffn_up, layer.ffn_down
            ops.append(("mlp_dense", functools.partial(_dense_ffn, h, up, down, spec.gated_mlp)))
        ops.append(("lm_head", functools.partial(torch.matmul, h, lm_head.T)))
        for op, fn in ops:
            row.update(stats(timer(fn, sweep.op_repeats), op))
        row.update(
            {
                "n_embd": spec.hidden,
                "n_head": spec.q_heads,
                "n_kv_head": spec.kv_heads,
                "n_expanded_embd": spec.expert_intermediate or spec.intermediate,
                "vocab_size": spec.vocab,
                "use_gated_mlp": spec.gated_mlp,
                "experts": spec.experts,
                "grouped_mm": (layer.experts.grouped or "loop") if layer.experts is not None else "",
            }
        )
        rows.append(row)
    return rows


def attention_rows(
    spec: ModelSpec, tp: int, sweep: Sweep, timer: Timer, device: torch.device, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """Vidur-style ``attention.csv`` rows: prefill (chunk x cached prefix) and decode (batch x KV)."""
    most = max(
        [c + p for c in sweep.prefill_chunks for p in sweep.prefill_kv]
        + [b * k for b in sweep.decode_batches for k in sweep.decode_kv]
    )
    layer = Layer(spec, tp, device, dtype, sliding=False)
    kv = KvCache(spec, tp, most, device, dtype)
    base = {
        "model": spec.name,
        "n_embd": spec.hidden,
        "n_q_head": spec.q_heads,
        "n_kv_head": spec.kv_heads,
        "num_tensor_parallel_workers": tp,
        "block_size": 0,
        "attention_backend": "torch_sdpa",
    }
    rows = []
    for chunk in sweep.prefill_chunks:
        for prefix in sweep.prefill_kv:
            q, k, v = _prefill_qkv(spec, tp, chunk, prefix, device, dtype)

            # Without a cached prefix the chunk is causal; with one it attends all of prefix + chunk
            # (no offset mask: at most twice the chunk-on-chunk part).
            def fn(
                q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, causal: bool = prefix == 0
            ) -> Any:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

            rows.append(
                {
                    **base,
                    "batch_size": 1,
                    "prefill_chunk_size": chunk,
                    "kv_cache_size": prefix,
                    "is_prefill": True,
                    **stats(timer(fn, sweep.op_repeats), "attn_prefill"),
                }
            )
    for batch in sweep.decode_batches:
        for ctx in sweep.decode_kv:
            kv.context = ctx
            h = torch.randn(batch, spec.hidden, device=device, dtype=dtype)

            def decode(h: torch.Tensor = h, batch: int = batch) -> Any:
                return layer.attention(h, 0, batch, kv)

            rows.append(
                {
                    **base,
                    "batch_size": batch,
                    "prefill_chunk_size": 0,
                    "kv_cache_size": ctx,
                    "is_prefill": False,
                    **stats(timer(decode, sweep.op_repeats), "attn_decode"),
                }
            )
    return rows


def _prefill_qkv(
    spec: ModelSpec, tp: int, chunk: int, prefix: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hq = spec.q_heads // tp
    if spec.attention == "mla":
        hk, dk, dv = hq, spec.head_dim, spec.value_head_dim
    else:
        hk, dk, dv = max(spec.kv_heads // tp, 1), spec.head_dim, spec.head_dim
    q = torch.randn(1, hq, chunk, dk, device=device, dtype=dtype)
    k = torch.randn(1, hk, prefix + chunk, dk, device=device, dtype=dtype)
    v = torch.randn(1, hk, prefix + chunk, dv, device=device, dtype=dtype)
    return q, k, v


def remaining_outputs(batch: int, mean_tokens: int) -> list[int]:
    """Remaining outputs spread uniformly on (0, 2 x mean]: the batch leaves one by one."""
    return [max(1, round(2 * mean_tokens * (i + 1) / batch)) for i in range(batch)]


def profile_rows(
    spec: ModelSpec,
    tp: int,
    hardware: str,
    stack: Stack,
    sweep: Sweep,
    timer: Timer,
    capacity: int,
    generator: torch.Generator,
    deadline: float,
) -> tuple[list[dict[str, Any]], bool]:
    """Profile-schema rows of mixed iterations; stops (and says so) at ``deadline`` (perf_counter)."""
    rows: list[dict[str, Any]] = []
    state_id = 0
    for batch in sweep.state_batches:
        for ctx in sweep.state_contexts:
            if batch * (ctx + max(sweep.checkpoints)) > min(sweep.max_state_tokens, 0.9 * capacity):
                continue
            for rem_mean in sweep.state_remaining:
                remaining = remaining_outputs(batch, rem_mean)
                rem_max, rem_weighted = drain_features([ctx] * batch, remaining)
                occupancy = batch * ctx / capacity
                for step in sweep.checkpoints:
                    alive = sum(r > step for r in remaining)
                    if alive == 0:
                        break
                    context = ctx + step
                    times = {}
                    for chunk in (0, *sweep.chunks):
                        layers, head = stack.run(chunk, alive, context, generator)
                        layers_ms = timer(layers, sweep.repeats, warmup=1)
                        head_ms = timer(head, sweep.repeats, warmup=1)
                        times[chunk] = [a * stack.scale + b for a, b in zip(layers_ms, head_ms, strict=True)]
                    for chunk in sweep.chunks:
                        for rep in range(sweep.repeats):
                            rows.append(
                                {
                                    "schema_version": PROFILE_SCHEMA_VERSION,
                                    "source": "torch",
                                    "hardware": hardware,
                                    "model": spec.name,
                                    "tp": tp,
                                    "state_id": state_id,
                                    "state_group": state_id,
                                    "repeat": rep,
                                    "decode_batch_size": batch,
                                    "context_tokens_mean": float(ctx),
                                    "context_tokens_std": 0.0,
                                    "remaining_output_tokens_mean": statistics.fmean(remaining),
                                    "kv_occupancy": min(occupancy, 1.0),
                                    "remaining_output_tokens_max": rem_max,
                                    "remaining_output_tokens_context_weighted": rem_weighted,
                                    "kv_capacity_tokens": capacity,
                                    "decode_step": step,
                                    "step_batch_size": alive,
                                    "step_context_tokens": float(alive * context),
                                    "chunk_tokens": chunk,
                                    "cached_prefix_tokens": 0,
                                    "iteration_time_s": times[chunk][rep] / 1e3,
                                    "decode_only_time_s": times[0][rep] / 1e3,
                                }
                            )
                    if time.perf_counter() > deadline:
                        return rows, True
                state_id += 1
    return rows, False


def write_csv(path: Path, rows: list[dict[str, Any]], columns: Iterable[str] | None = None) -> None:
    """CSV with the union of the rows' keys (first-seen order) or the given columns."""
    cols: list[str] = (
        list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    )
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols, restval="")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k, "") for k in cols})


def hardware_name(device: torch.device) -> str:
    """The catalog GPU this device is (``H200`` from ``NVIDIA H200``), else the device's own name."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    for gpu in sorted(GPUS, key=len, reverse=True):
        if gpu.lower() in name.lower():
            return gpu
    return name.replace(" ", "_")


def parse_models(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, tp = item.partition(":")
        out.append((get_model(name.strip()).name, int(tp or 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", required=True, help="folder for gemm.csv, attention.csv, profiles.csv, meta.json"
    )
    ap.add_argument("--models", default="gpt-oss-120b:1,GLM-5:8", help="catalog models with their TP degree")
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    ap.add_argument("--tiny", action="store_true", help="scaled-down shapes and sweep (CPU smoke test)")
    ap.add_argument("--stack-layers", type=int, default=2, help="layers in the timed stack (default 2)")
    ap.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="node KV capacity for kv_occupancy (default: the cost model's)",
    )
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=270.0,
        help="stop the mixed-iteration sweep after this long (default 270)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "profile_torch: --device cuda but torch sees no CUDA device (use --device cpu --tiny)"
        )
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    dtype = torch.bfloat16
    sweep = TINY if args.tiny else Sweep()
    timer = Timer(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hardware = hardware_name(device)
    gemm, attention, profiles = [], [], []
    meta: dict[str, Any] = {
        "command": " ".join(
            ["python", "benchmarks/gpu/profile_torch.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "hardware": hardware,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "tiny": args.tiny,
        "sweep": dataclasses.asdict(sweep),
        "stack_layers": args.stack_layers,
        "models": {},
    }
    truncated = False
    per_model_s = max(args.max_seconds - (time.perf_counter() - t_start), 1.0) / max(
        len(parse_models(args.models)), 1
    )
    for name, tp in parse_models(args.models):
        t_model = time.perf_counter()
        spec = get_model(name)
        if args.tiny:
            spec, tp = tiny_spec(spec), 1
        if args.kv_capacity_tokens is not None:
            capacity = args.kv_capacity_tokens
        elif hardware in GPUS and not args.tiny:
            capacity = CostModel(hardware, name, tp=tp).kv_capacity_tokens
        else:
            capacity = 10 * sweep.max_state_tokens
        gemm += gemm_rows(spec, tp, sweep, timer, device, dtype, generator)
        attention += attention_rows(spec, tp, sweep, timer, device, dtype)
        stack = Stack(spec, tp, args.stack_layers, sweep.max_state_tokens, device, dtype)
        rows, cut = profile_rows(
            spec, tp, hardware, stack, sweep, timer, capacity, generator, t_model + per_model_s
        )
        truncated |= cut
        for r in rows:
            r["state_id"] += 100_000 * len(meta["models"])
            r["state_group"] = r["state_id"]
        profiles += rows
        meta["models"][name] = {
            "tp": tp,
            "kv_capacity_tokens": capacity,
            "states": len({r["state_id"] for r in rows}),
            "profile_rows": len(rows),
            "grouped_mm": (stack.layers[0].experts.grouped or "loop") if stack.layers[0].experts else None,
            "seconds": round(time.perf_counter() - t_model, 1),
            "truncated": cut,
        }
        del stack
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_csv(out / "gemm.csv", gemm)
    write_csv(out / "attention.csv", attention)
    write_csv(out / "profiles.csv", profiles, PROFILE_COLUMNS)
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    meta["truncated"] = truncated
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    note = " (truncated at --max-seconds)" if truncated else ""
    print(
        f"profile_torch: {len(gemm)} GEMM rows, {len(attention)} attention rows, {len(profiles)} profile "
        f"rows in {meta['seconds']} s -> {out}{note}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A ``ModelSpec`` from a Hugging Face ``config.json``.

``spec_from_hf_config(config, source)`` reads the fields the cost model needs from one of the model
families below and refuses, with the file and the field named, anything it cannot express:

* dense GQA: ``llama``, ``mistral``, ``qwen2``, ``qwen3``;
* GQA MoE: ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``gpt_oss``, ``glm4_moe``;
* MLA MoE: ``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``, ``kimi_k2``, ``glm_moe_dsa``.

Sliding-window layers come from ``layer_types`` (gpt-oss, newer transformers) or ``use_sliding_window``
/ ``max_window_layers`` (Qwen2) or ``sliding_window`` (Mistral, every layer). Weight precision comes
from ``quantization_config`` (``fp8``, ``mxfp4``, ``compressed-tensors``, ``modelopt``); embeddings,
LM head and router stay BF16 as every such checkpoint keeps them.

The context window follows SGLang's rule (``get_context_length``): ``max_position_embeddings``, times
``rope_scaling.factor`` only when the scaling states no ``original_max_position_embeddings`` and is not
``llama3``. A YaRN config (gpt-oss, DeepSeek-V3) already states the extended window in
``max_position_embeddings``; a linear or dynamic scaling extends the trained window by its factor.

Every top-level field must be known: read, or listed in ``_HARMLESS`` as not changing any shape or
cost. An unknown field is an error, since the loader cannot tell whether it changes the model.

A ``crossflow`` block (not part of HF configs) may name the model and give ``aliases``, the published
``total_params_b``, a ``source`` note, and ``variant_of`` (a catalog model whose fields this file
overrides, e.g. an FP8 checkpoint of a BF16 model); ``envs.models`` resolves ``variant_of``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from envs.hardware import ModelSpec, Precision

CROSSFLOW_KEYS = frozenset({"name", "aliases", "total_params_b", "source", "variant_of"})

DENSE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
GQA_MOE_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe"})
MLA_FAMILIES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa"})
FAMILIES = DENSE_FAMILIES | GQA_MOE_FAMILIES | MLA_FAMILIES

_HARMLESS = frozenset(
    {
        # identity, tokens, numerics, training-only knobs: no shape, no cost
        "architectures",
        "auto_map",
        "_name_or_path",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "rms_norm_eps",
        "layer_norm_eps",
        "attention_dropout",
        "hidden_dropout",
        "rope_theta",
        "rope_parameters",
        "rope_interleave",
        "partial_rotary_factor",
        "attention_bias",
        "mlp_bias",
        "use_qk_norm",
        "qk_layernorm",
        "swiglu_limit",
        "initial_context_length",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "output_router_logits",
        "aux_loss_alpha",
        "seq_aux",
        "norm_topk_prob",
        "routed_scaling_factor",
        "scoring_func",
        "topk_method",
        "n_group",
        "topk_group",
        "ep_size",
        "use_bfloat16",
        "bias",
        # DeepSeek sparse attention indexer (GLM-5, DeepSeek-V3.2): not modelled, see docs/cost_model.md
        "index_topk",
        "index_head_dim",
        "index_n_heads",
        # multi-token-prediction layers: not modelled (speculative decoding is out of scope)
        "num_nextn_predict_layers",
    }
)


_MODELOPT: dict[str, Precision] = {"FP8": "fp8", "NVFP4": "fp4"}


class ConfigError(ValueError):
    """A config file the loader cannot turn into a ``ModelSpec`` (message names file and field)."""


class _Fields:
    """Typed access to one config's fields that remembers which ones were read."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config = config
        self.source = source
        self.read: set[str] = set()

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: field {key!r}: {problem}")

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.config.get(key)
        return default if value is None else value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.raw(key, default)
        if value is None:
            raise self.error(key, "missing (needed for this model family)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def string(self, key: str, default: str | None = None) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        return value

    def reject_unknown(self, model_type: str) -> None:
        unknown = sorted(set(self.config) - self.read - _HARMLESS - {"crossflow"})
        if unknown:
            raise ConfigError(
                f"{self.source}: unknown field {unknown[0]!r} for model_type {model_type!r}"
                + (f" (and {len(unknown) - 1} more: {', '.join(unknown[1:])})" if len(unknown) > 1 else "")
                + "; the loader does not know whether it changes the model's shapes. Remove it if it "
                "does not, or extend envs/models/hf_config.py"
            )


def context_window_tokens(fields: _Fields) -> int:
    """SGLang's context length of this config (see the module docstring for the rule)."""
    max_positions = fields.integer("max_position_embeddings")
    scaling = fields.raw("rope_scaling")
    if scaling is None:
        return max_positions
    if not isinstance(scaling, Mapping):
        raise fields.error("rope_scaling", f"must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        raise fields.error("rope_scaling", f"factor must be a number >= 1, got {factor!r}")
    if "original_max_position_embeddings" in scaling or kind == "llama3":
        return max_positions
    return int(factor * max_positions)


def _precisions(fields: _Fields) -> tuple[Precision, Precision]:
    """(FFN/expert weights, attention projections) precision from ``quantization_config``/``torch_dtype``."""
    for key in ("torch_dtype", "dtype"):
        dtype = fields.raw(key)
        if dtype is not None and dtype not in ("bfloat16", "float16", "auto"):
            raise fields.error(
                key, f"{dtype!r} is not modelled (BF16/FP16 weights, or a quantization_config)"
            )
    quant = fields.raw("quantization_config")
    if quant is None:
        return "bf16", "bf16"
    if not isinstance(quant, Mapping):
        raise fields.error("quantization_config", f"must be an object, got {quant!r}")
    method = quant.get("quant_method")
    excluded = " ".join(
        str(m)
        for key in ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules")
        for m in (quant.get(key) or ())
    )
    attention_kept = "attn" in excluded  # e.g. gpt-oss keeps "model.layers.*.self_attn" in BF16
    if method == "fp8":
        return "fp8", "bf16" if attention_kept else "fp8"
    if method == "mxfp4":  # MXFP4 checkpoints quantise the MoE experts only
        return "fp4", "bf16"
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        precision = _MODELOPT.get(algo)
        if precision is None:
            raise fields.error(
                "quantization_config", f"modelopt quant_algo {algo!r} is not modelled (FP8, NVFP4)"
            )
        return precision, "bf16" if attention_kept else precision
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        widths = {(g.get("weights") or {}).get("num_bits") for g in groups.values() if isinstance(g, Mapping)}
        kinds = {(g.get("weights") or {}).get("type") for g in groups.values() if isinstance(g, Mapping)}
        if kinds == {"float"} and widths in ({8}, {4}):
            bits: Precision = "fp8" if widths == {8} else "fp4"
            return bits, "bf16" if attention_kept else bits
        raise fields.error(
            "quantization_config",
            f"compressed-tensors weights {sorted(map(str, kinds))} x {sorted(map(str, widths))} bits are "
            "not modelled (float 8 or 4 bits)",
        )
    raise fields.error(
        "quantization_config",
        f"quant_method {method!r} is not modelled (fp8, mxfp4, compressed-tensors, modelopt)",
    )


def _sliding_layers(fields: _Fields, layers: int, family: str) -> tuple[int, int]:
    """(sliding-window layers, window tokens)."""
    layer_types = fields.raw("layer_types")
    window = fields.raw("sliding_window")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise fields.error("layer_types", f"must list num_hidden_layers={layers} entries")
        bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise fields.error("layer_types", f"unknown layer type {bad[0]!r}")
        sliding = layer_types.count("sliding_attention")
    elif family == "qwen2" or family.startswith("qwen"):
        if not fields.boolean("use_sliding_window", False):
            fields.raw("max_window_layers")
            return 0, 0
        sliding = layers - fields.integer("max_window_layers", layers, minimum=0)
    elif family in ("mistral", "mixtral"):
        sliding = layers if window is not None else 0
    else:
        sliding = 0
    if sliding == 0:
        return 0, 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise fields.error(
            "sliding_window", f"must be a positive integer with sliding layers, got {window!r}"
        )
    if window >= context_window_tokens(fields):
        return 0, 0  # a window as long as the context is full attention
    if sliding >= layers:
        raise fields.error(
            "sliding_window",
            "every layer uses a sliding window: not modelled (the cost model needs at least one "
            "full-attention layer to size the KV cache)",
        )
    return sliding, window


def _moe(fields: _Fields, family: str, layers: int) -> dict[str, int]:
    """Experts, top-k, expert width, shared experts and leading dense layers of an MoE config."""
    experts_key = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts"}.get(
        family, "num_experts" if family in ("qwen2_moe", "qwen3_moe") else "n_routed_experts"
    )
    experts = fields.integer(experts_key)
    top_k = fields.integer("num_experts_per_tok")
    if (
        family == "gpt_oss"
        and fields.has("experts_per_token")
        and fields.integer("experts_per_token") != top_k
    ):
        raise fields.error("experts_per_token", f"disagrees with num_experts_per_tok={top_k}")
    if top_k > experts:
        raise fields.error("num_experts_per_tok", f"{top_k} > {experts_key}={experts}")
    if family in ("mixtral", "gpt_oss"):
        width = fields.integer("intermediate_size")
    else:
        width = fields.integer("moe_intermediate_size")
    shared = 0
    if family == "qwen2_moe":
        shared_width = fields.integer("shared_expert_intermediate_size", 0, minimum=0)
        if shared_width % width:
            raise fields.error(
                "shared_expert_intermediate_size",
                f"{shared_width} is not a multiple of moe_intermediate_size={width} (not modelled)",
            )
        shared = shared_width // width
    elif family not in ("mixtral", "gpt_oss", "qwen3_moe"):
        shared = fields.integer("n_shared_experts", 0, minimum=0)
    dense = 0
    if family in ("qwen2_moe", "qwen3_moe"):
        if fields.integer("decoder_sparse_step", 1) != 1:
            raise fields.error("decoder_sparse_step", "only 1 (every layer MoE) is modelled")
        if fields.raw("mlp_only_layers", []):
            raise fields.error("mlp_only_layers", "dense layers among MoE layers are not modelled")
    elif family not in ("mixtral", "gpt_oss"):
        dense = fields.integer("first_k_dense_replace", 0, minimum=0)
        if fields.integer("moe_layer_freq", 1) != 1:
            raise fields.error(
                "moe_layer_freq", "only 1 (every layer after the dense ones is MoE) is modelled"
            )
    if dense >= layers:
        raise fields.error("first_k_dense_replace", f"{dense} >= num_hidden_layers={layers}")
    return {
        "experts": experts,
        "active_experts": top_k,
        "expert_intermediate": width,
        "shared_experts": shared,
        "dense_layers": dense,
    }


def _check_activation(fields: _Fields) -> None:
    act = fields.raw("hidden_act", "silu")
    if act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh"):
        raise fields.error("hidden_act", f"{act!r} is not modelled (gated SiLU/GELU MLPs)")
    if fields.integer("pretraining_tp", 1) != 1:
        raise fields.error("pretraining_tp", "only 1 is modelled")


def _attention(
    f: _Fields, family: str, layers: int, hidden: int, q_heads: int
) -> tuple[dict[str, Any], int, int]:
    """Attention fields of a ``ModelSpec`` (MLA or GQA), sliding-window layers, window tokens."""
    if family in MLA_FAMILIES:
        for key in ("layer_types", "sliding_window"):
            if f.has(key):
                raise f.error(key, "sliding windows with MLA are not modelled")
        nope = f.integer("qk_nope_head_dim")
        rope = f.integer("qk_rope_head_dim")
        mla = {
            "attention": "mla",
            "head_dim": nope + rope,
            "v_head_dim": f.integer("v_head_dim"),
            "kv_lora_rank": f.integer("kv_lora_rank"),
            "q_lora_rank": f.integer("q_lora_rank", 0, minimum=0),
            "rope_head_dim": rope,
        }
        return mla, 0, 0
    if f.has("head_dim"):
        head_dim = f.integer("head_dim")
    elif hidden % q_heads:
        raise f.error(
            "hidden_size", f"{hidden} is not a multiple of num_attention_heads={q_heads} (no head_dim)"
        )
    else:
        head_dim = hidden // q_heads
    sliding, window = _sliding_layers(f, layers, family)
    return {"head_dim": head_dim}, sliding, window


def _meta_name_and_aliases(
    meta: Mapping[str, Any], source: str, name: str | None
) -> tuple[str, tuple[str, ...]]:
    unknown = sorted(set(meta) - CROSSFLOW_KEYS)
    if unknown:
        known = ", ".join(sorted(CROSSFLOW_KEYS))
        raise ConfigError(f"{source}: field 'crossflow.{unknown[0]}': unknown (known: {known})")
    aliases = meta.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ConfigError(f"{source}: field 'crossflow.aliases': must be a list of strings")
    model_name = meta.get("name") or name
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError(f"{source}: field 'crossflow.name': the model needs a name")
    return model_name, tuple(aliases)


def spec_from_hf_config(
    config: Mapping[str, Any],
    source: str,
    *,
    name: str | None = None,
    count_params_b: Callable[[ModelSpec], float] | None = None,
) -> ModelSpec:
    """The ``ModelSpec`` of one HF config (``source`` names it in errors).

    ``name`` is used when the config has no ``crossflow.name``. ``total_params_b`` is the
    ``crossflow`` block's published figure, else ``count_params_b(spec)`` (our count from the shapes).

    Raises:
        ConfigError: unknown model type or field, a missing or inconsistent field (file and field named).
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: a config must be a JSON object")
    meta = config.get("crossflow") or {}
    if not isinstance(meta, Mapping):
        raise ConfigError(f"{source}: field 'crossflow': must be an object")
    model_name, aliases = _meta_name_and_aliases(meta, source, name)
    f = _Fields(config, source)
    family = f.string("model_type") if f.has("model_type") else ""
    if family not in FAMILIES:
        raise f.error(
            "model_type", f"{family or None!r} is not modelled; known: {', '.join(sorted(FAMILIES))}"
        )
    _check_activation(f)
    layers = f.integer("num_hidden_layers")
    hidden = f.integer("hidden_size")
    q_heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", q_heads)
    if q_heads % kv_heads:
        raise f.error("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={q_heads}")
    vocab = f.integer("vocab_size")
    weights, attention = _precisions(f)
    spec, sliding, window = _attention(f, family, layers, hidden, q_heads)
    if family in DENSE_FAMILIES:
        intermediate = f.integer("intermediate_size")
    else:
        spec.update(_moe(f, family, layers))
        # The dense FFN width matters only where dense layers exist (a config always states one).
        dense_width = f.integer("intermediate_size") if f.has("intermediate_size") else 0
        intermediate = dense_width if spec["dense_layers"] else 0
        if spec["dense_layers"] and not dense_width:
            raise f.error("intermediate_size", "missing, and first_k_dense_replace > 0 needs it")
    context = context_window_tokens(f)
    tied = f.boolean("tie_word_embeddings", False)
    f.reject_unknown(family)
    out = ModelSpec(
        model_name,
        layers=layers,
        hidden=hidden,
        q_heads=q_heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        total_params_b=0.0,
        weight_precision=weights,
        dense_precision=attention,
        sliding_window_layers=sliding,
        sliding_window_tokens=window,
        tied_embeddings=tied,
        max_context_tokens=context,
        aliases=aliases,
        source=str(meta.get("source") or source),
        **spec,
    )
    published = meta.get("total_params_b")
    if published is not None:
        if isinstance(published, bool) or not isinstance(published, int | float) or published <= 0:
            raise ConfigError(f"{source}: field 'crossflow.total_params_b': must be a positive number")
        total_b = float(published)
    elif count_params_b is not None:
        total_b = round(count_params_b(out), 3)
    else:
        raise ConfigError(f"{source}: field 'crossflow.total_params_b': missing")
    return replace(out, total_params_b=total_b)


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path`` (errors name the file, line and column)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read model config: {exc.strerror or exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a model config must be a JSON object")
    return config


def default_name(path: Path) -> str:
    """``.../Llama-3.1-8B-Instruct/config.json`` -> ``Llama-3.1-8B-Instruct``; ``x/foo.json`` -> ``foo``."""
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem

"""The Hugging Face config loader: one config.json per architecture family, made here, and its errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from envs.cost_model import CostModel, weight_params
from envs.hardware import get_gpu, get_model
from envs.models import (
    CATALOG_DIR,
    MODELS_DIR_ENV,
    ConfigError,
    catalog,
    load_model_config,
    lookup_model,
    with_precision,
)
from envs.models.hf_config import spec_from_hf_config


def write(folder: Path, name: str, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(config))
    return path


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
}
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 768,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 32,
    "n_shared_experts": 2,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "vocab_size": 50000,
    "max_position_embeddings": 16384,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "num_nextn_predict_layers": 1,
}
QWEN_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 8,
}
OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 512,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
}


def test_dense_gqa_config(tmp_path: Path) -> None:
    spec = load_model_config(write(tmp_path / "Tiny-Llama", "config.json", LLAMA))
    assert spec.name == "Tiny-Llama"  # the folder of a config.json names the model
    assert (spec.layers, spec.hidden, spec.q_heads, spec.kv_heads, spec.head_dim) == (4, 1024, 16, 4, 64)
    assert (spec.intermediate, spec.vocab, spec.tied_embeddings, spec.is_moe) == (2816, 32000, True, False)
    assert (spec.weight_precision, spec.dense_precision, spec.kv_precision) == ("bf16", "bf16", "bf16")
    assert spec.max_context_tokens == 8192
    # No published count in a user's config: ours, from the shapes (tied: one embedding matrix).
    by_hand = 4 * (1024 * (16 + 2 * 4) * 64 + 16 * 64 * 1024 + 3 * 1024 * 2816) + 32000 * 1024
    assert spec.total_params_b == pytest.approx(by_hand / 1e9, abs=1e-3)
    assert CostModel("H100", spec).kv_bytes_per_token == 4 * 2 * 4 * 64 * 2


def test_mla_moe_config_with_fp8_checkpoint(tmp_path: Path) -> None:
    spec = load_model_config(write(tmp_path, "tiny-deepseek.json", DEEPSEEK))
    assert spec.name == "tiny-deepseek" and spec.attention == "mla"
    assert (spec.head_dim, spec.v_head_dim, spec.rope_head_dim) == (96, 64, 32)
    assert (spec.kv_lora_rank, spec.q_lora_rank) == (256, 768)
    assert (spec.experts, spec.active_experts, spec.expert_intermediate) == (32, 4, 512)
    assert (spec.shared_experts, spec.dense_layers, spec.moe_layers, spec.intermediate) == (2, 1, 5, 8192)
    # Block-wise FP8: every linear layer, attention included; embeddings/LM head stay BF16.
    assert (spec.weight_precision, spec.dense_precision, spec.embedding_precision) == ("fp8", "fp8", "bf16")
    # YaRN with original_max_position_embeddings: SGLang serves max_position_embeddings as stated.
    assert spec.max_context_tokens == 16384
    assert CostModel("H200", spec).kv_bytes_per_token == (256 + 32) * 2 * 6


def test_moe_gqa_config_without_dense_layers(tmp_path: Path) -> None:
    spec = load_model_config(write(tmp_path, "qwen-moe.json", QWEN_MOE))
    assert (spec.experts, spec.active_experts, spec.expert_intermediate) == (64, 8, 384)
    assert spec.shared_experts == 0
    assert spec.intermediate == 0 and spec.dense_layers == 0  # the dense width is unused: every layer is MoE
    assert spec.sliding_window_layers == 0 and spec.head_dim == 128


def test_sliding_window_layers_and_mxfp4_experts(tmp_path: Path) -> None:
    spec = load_model_config(write(tmp_path, "oss.json", OSS))
    assert (spec.sliding_window_layers, spec.sliding_window_tokens, spec.full_attention_layers) == (2, 128, 2)
    assert (spec.weight_precision, spec.dense_precision) == ("fp4", "bf16")
    assert (spec.experts, spec.expert_intermediate, spec.intermediate) == (16, 512, 0)
    # Qwen2-style: the top layers (from max_window_layers on) use the window.
    qwen = {**LLAMA, "model_type": "qwen2", "tie_word_embeddings": False, "use_sliding_window": True}
    qwen |= {"sliding_window": 1024, "max_window_layers": 3}
    spec = load_model_config(write(tmp_path, "qwen2.json", qwen))
    assert (spec.sliding_window_layers, spec.sliding_window_tokens) == (1, 1024)


def test_context_window_follows_sglang(tmp_path: Path) -> None:
    def window(scaling: dict[str, Any] | None) -> int:
        config = {**LLAMA, "rope_scaling": scaling}
        return load_model_config(write(tmp_path, "m.json", config)).max_context_tokens

    assert window(None) == 8192
    assert window({"rope_type": "linear", "factor": 4.0}) == 32768  # extends the trained window
    assert window({"rope_type": "dynamic", "factor": 2.0}) == 16384
    assert window({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}) == 8192
    assert window({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}) == 8192


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"hidden_size": 1000, "num_attention_heads": 16}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": "big"}, "vocab_size"),
        ({"model_type": "gemma3"}, "model_type"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"torch_dtype": "float32"}, "torch_dtype"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"parallel_attn": True}, "parallel_attn"),
        ({"crossflow": {"nickname": "x"}}, "crossflow.nickname"),
    ],
)
def test_unknown_or_inconsistent_field_names_file_and_field(
    tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    path = write(tmp_path, "bad.json", {**LLAMA, **change})
    with pytest.raises(ConfigError, match=rf"bad\.json.*'{field}'"):
        load_model_config(path)


def test_inconsistent_moe_and_layer_fields(tmp_path: Path) -> None:
    cases = [
        ({**QWEN_MOE, "num_experts_per_tok": 65}, "num_experts_per_tok"),
        ({**QWEN_MOE, "mlp_only_layers": [3]}, "mlp_only_layers"),
        ({**DEEPSEEK, "first_k_dense_replace": 6}, "first_k_dense_replace"),
        ({**DEEPSEEK, "moe_layer_freq": 2}, "moe_layer_freq"),
        ({**OSS, "layer_types": ["full_attention"] * 3}, "layer_types"),
        ({**OSS, "layer_types": ["sliding_attention"] * 4}, "sliding_window"),
        ({**OSS, "layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ]
    for config, field in cases:
        with pytest.raises(ConfigError, match=rf"m\.json: field '{field}'"):
            load_model_config(write(tmp_path, "m.json", config))


def test_bad_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "model_type": "llama",\n  "hidden_size": 10,,\n}')
    with pytest.raises(ConfigError, match=r"broken\.json:3:\d+: not valid JSON"):
        load_model_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_model_config(tmp_path / "missing.json")


def test_lookup_by_path_and_models_dir_extends_the_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "extra", "tiny-llama.json", {**LLAMA, "crossflow": {"aliases": ["org/tiny"]}})
    assert lookup_model(str(path)).name == "tiny-llama"
    with pytest.raises(KeyError, match="choices:"):
        get_model("tiny-llama")
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path / "extra"))
    assert get_model("ORG/tiny").name == "tiny-llama"
    assert "tiny-llama" in catalog() and "gpt-oss-120b" in catalog()
    # A variant of a catalog model: only the quantisation differs.
    variant = {"crossflow": {"name": "tiny-fp8", "variant_of": "tiny-llama"}}
    variant["quantization_config"] = {"quant_method": "fp8"}
    write(tmp_path / "extra", "tiny-fp8.json", variant)
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path / "extra") + ":" + str(tmp_path / "extra"))
    fp8 = get_model("tiny-fp8")
    assert (fp8.weight_precision, fp8.hidden) == ("fp8", 1024)
    # A name already taken by a shipped model is an error naming both files.
    write(tmp_path / "clash", "x.json", {**LLAMA, "crossflow": {"name": "gpt-oss-120b"}})
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path / "clash"))
    with pytest.raises(ConfigError, match=r"x\.json.*gpt-oss-120b.*gpt-oss-120b\.json"):
        catalog()


def test_shipped_catalog_uses_the_loader_and_publishes_sources() -> None:
    files = sorted(CATALOG_DIR.glob("*.json"))
    models = catalog()
    assert len(files) == len(models) >= 19
    for spec in models.values():
        assert spec.source and spec.total_params_b > 0
    # Every shipped context window, as the rule reads each config.
    assert models["gpt-oss-120b"].max_context_tokens == 131072
    assert models["deepseek-v3"].max_context_tokens == 163840
    assert models["qwen3-30b-a3b"].max_context_tokens == 40960


@pytest.mark.parametrize(
    ("fp8", "base"),
    [
        ("Llama-3.1-8B-FP8", "Llama-3.1-8B"),
        ("Llama-3.1-70B-FP8", "Llama-3.1-70B"),
        ("Qwen3-30B-A3B-FP8", "Qwen3-30B-A3B"),
        ("Qwen3-235B-A22B-FP8", "Qwen3-235B-A22B"),
        ("GLM-4.5-Air-FP8", "GLM-4.5-Air"),
    ],
)
def test_fp8_checkpoints_equal_their_base_served_at_fp8(fp8: str, base: str) -> None:
    shipped = get_model(fp8)
    requested = with_precision(get_model(base), get_gpu("H100"), "fp8")
    assert dataclasses.replace(requested, name=shipped.name) == shipped
    assert weight_params(shipped) == weight_params(get_model(base))


def test_spec_from_config_without_a_name_or_count_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"crossflow\.name"):
        spec_from_hf_config(LLAMA, "inline")
    with pytest.raises(ConfigError, match="total_params_b"):
        spec_from_hf_config(LLAMA, "inline", name="x")

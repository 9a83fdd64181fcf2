"""The model catalog: Hugging Face ``config.json`` files read by one loader.

* ``envs/data/models/*.json`` is the shipped catalog (trimmed HF configs with a ``crossflow`` block
  for the name, aliases, published parameter count and source; see the README there).
* Every folder in the ``CROSSFLOW_MODELS_DIR`` environment variable (``os.pathsep``-separated) adds
  its ``*.json`` files (and ``*/config.json``) to it; the commands' ``--models-dir`` sets it.
* ``lookup_model("path/to/config.json")`` (or a folder holding one) reads a config directly.

``resolve_model(name, gpu=..., dtype=..., kv_dtype=...)`` is what the commands use: the looked-up
spec with the weight and KV precision a deployment asks for.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

from envs.hardware import GPUSpec, ModelSpec, Precision, SettingError, get_gpu
from envs.models.hf_config import ConfigError, default_name, read_config, spec_from_hf_config

CATALOG_DIR = Path(__file__).resolve().parent.parent / "data" / "models"
MODELS_DIR_ENV = "CROSSFLOW_MODELS_DIR"
KV_PRECISIONS: tuple[Precision, ...] = ("bf16", "fp8")
WEIGHT_PRECISIONS: tuple[Precision, ...] = get_args(Precision)

__all__ = [
    "CATALOG_DIR",
    "MODELS_DIR_ENV",
    "ConfigError",
    "catalog",
    "load_model_config",
    "lookup_model",
    "resolve_model",
    "with_precision",
]


def _config_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ConfigError(f"{folder}: models folder does not exist (from {MODELS_DIR_ENV} or --models-dir)")
    return sorted(folder.glob("*.json")) + sorted(folder.glob("*/config.json"))


def _names(config: dict[str, Any], path: Path) -> list[str]:
    meta = config.get("crossflow") or {}
    name = meta.get("name") if isinstance(meta, dict) else None
    aliases = meta.get("aliases", []) if isinstance(meta, dict) else []
    return [str(name or default_name(path)), *(str(a) for a in aliases if isinstance(a, str))]


@functools.lru_cache(maxsize=8)
def _raw_catalog(extra_dirs: tuple[str, ...]) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Lower-cased name or alias -> (file, config) over the shipped folder and ``extra_dirs``."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for folder in (CATALOG_DIR, *map(Path, extra_dirs)):
        for path in _config_files(folder):
            config = read_config(path)
            for key in _names(config, path):
                clash = found.get(key.lower())
                if clash is not None and clash[0] != path:
                    raise ConfigError(f"{path}: model name or alias {key!r} is already taken by {clash[0]}")
                found[key.lower()] = (path, config)
    return found


def _extra_dirs() -> tuple[str, ...]:
    return tuple(d for d in os.environ.get(MODELS_DIR_ENV, "").split(os.pathsep) if d)


def _merged(config: dict[str, Any], path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """``config`` with its ``crossflow.variant_of`` base's fields underneath (the variant's win)."""
    meta = config.get("crossflow") or {}
    base_name = meta.get("variant_of") if isinstance(meta, dict) else None
    if base_name is None:
        return config
    entry = _raw_catalog(_extra_dirs()).get(str(base_name).lower())
    if entry is None:
        raise ConfigError(f"{path}: field 'crossflow.variant_of': unknown catalog model {base_name!r}")
    base_path, base_config = entry
    if base_path in seen or base_path == path:
        raise ConfigError(f"{path}: field 'crossflow.variant_of': {base_name!r} is a cycle")
    base = _merged(base_config, base_path, (*seen, path))
    base_meta = base.get("crossflow") or {}
    merged_meta = {
        "total_params_b": base_meta.get("total_params_b"),
        **{k: v for k, v in meta.items() if k != "variant_of"},
    }
    return {**base, **{k: v for k, v in config.items() if k != "crossflow"}, "crossflow": merged_meta}


def _spec(config: dict[str, Any], path: Path) -> ModelSpec:
    from envs.cost_model import weight_params  # the parameter count of a config without a published one

    return spec_from_hf_config(
        _merged(config, path),
        str(path),
        name=default_name(path),
        count_params_b=lambda spec: sum(weight_params(spec).values()) / 1e9,
    )


def load_model_config(path: str | Path) -> ModelSpec:
    """The ``ModelSpec`` of one config file (or of ``config.json`` in a folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return _spec(read_config(path), path)


@functools.lru_cache(maxsize=8)
def _catalog(extra_dirs: tuple[str, ...]) -> dict[str, ModelSpec]:
    specs: dict[Path, ModelSpec] = {}
    for path, config in _raw_catalog(extra_dirs).values():
        if path not in specs:
            specs[path] = _spec(config, path)
    return {spec.name.lower(): spec for spec in specs.values()}


def catalog() -> dict[str, ModelSpec]:
    """Lower-cased name -> spec of every catalog model (shipped plus ``CROSSFLOW_MODELS_DIR``)."""
    return _catalog(_extra_dirs())


def _is_path(name: str) -> bool:
    return name.endswith(".json") or (os.sep in name and Path(name).exists())


def lookup_model(name: str) -> ModelSpec:
    """A catalog model by name or alias (case-insensitive), or the config file at path ``name``.

    Raises:
        KeyError: no such model (the message lists the catalog).
        ConfigError: the config file is unreadable or not a model the loader can express.
    """
    key = name.strip()
    if _is_path(key):
        return load_model_config(key)
    models = catalog()
    entry = _raw_catalog(_extra_dirs()).get(key.lower())
    if entry is not None:
        spec = _spec(entry[1], entry[0])
        return models.get(spec.name.lower(), spec)
    names = ", ".join(sorted((m.name for m in models.values()), key=str.lower))
    raise KeyError(f"unknown model {name!r}; choices: {names}, or a path to a Hugging Face config.json")


def with_precision(
    model: ModelSpec, gpu: GPUSpec, dtype: Precision | None = None, kv_dtype: Precision | None = None
) -> ModelSpec:
    """``model`` served with ``dtype`` linear weights (attention and FFN/experts; embeddings, LM head
    and router stay as the checkpoint has them) and a ``kv_dtype`` KV cache; ``None`` keeps the
    checkpoint's own precision.

    Asking for FP8 or FP4 weights asks for that tensor-core path: ``SettingError`` on a GPU without it
    (a checkpoint shipped in a precision the GPU lacks, such as MXFP4 gpt-oss on Hopper, still runs
    weight-only without ``dtype``).
    """
    if dtype is not None:
        if dtype not in WEIGHT_PRECISIONS:
            raise SettingError(
                "dtype", dtype, f"unknown weight precision; choices: {', '.join(WEIGHT_PRECISIONS)}"
            )
        native = {"bf16": gpu.bf16_tflops, "fp8": gpu.fp8_tflops, "fp4": gpu.fp4_tflops}
        if native[dtype] <= 0:
            have = [p for p in ("fp8", "fp4") if native[p] > 0]
            raise SettingError(
                "dtype",
                dtype,
                f"{gpu.name} has no {dtype.upper()} tensor cores"
                + (f" (it has {', '.join(have)})" if have else " (BF16 only)"),
            )
        model = replace(model, weight_precision=dtype, dense_precision=dtype)
    if kv_dtype is not None:
        if kv_dtype not in KV_PRECISIONS:
            raise SettingError(
                "kv_dtype", kv_dtype, f"unknown KV precision; choices: {', '.join(KV_PRECISIONS)}"
            )
        model = replace(model, kv_precision=kv_dtype)
    return model


def resolve_model(
    name: str | ModelSpec,
    gpu: str | GPUSpec,
    dtype: Precision | None = None,
    kv_dtype: Precision | None = None,
) -> ModelSpec:
    """``lookup_model(name)`` (or ``name`` itself) with ``with_precision`` applied for ``gpu``."""
    spec = lookup_model(name) if isinstance(name, str) else name
    return with_precision(spec, get_gpu(gpu) if isinstance(gpu, str) else gpu, dtype, kv_dtype)

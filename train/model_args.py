"""The model and parallelism flags every command that takes a model shares.

``add_model_arguments(parser)`` adds ``--dtype``, ``--kv-dtype``, ``--ep``, ``--dp-attention`` and
``--models-dir`` (the command keeps its own ``--gpu``, ``--model``/``--models`` and ``--tp``);
``model_from_args(args, model, tp)`` resolves and checks them, and every error names its flag.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from envs.cost_model import check_parallelism
from envs.hardware import ModelSpec, Precision, SettingError, get_gpu
from envs.models import (
    KV_PRECISIONS,
    MODELS_DIR_ENV,
    WEIGHT_PRECISIONS,
    ConfigError,
    lookup_model,
    with_precision,
)

FLAGS = {
    "tp": "--tp",
    "ep": "--ep",
    "dp_attention": "--dp-attention",
    "dtype": "--dtype",
    "kv_dtype": "--kv-dtype",
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the shared precision, parallelism and catalog flags to ``parser``."""
    g = parser.add_argument_group("precision and parallelism")
    g.add_argument(
        "--dtype",
        choices=WEIGHT_PRECISIONS,
        default=None,
        help="weights of the linear layers (attention, FFN, experts): bf16, fp8, or fp4 where the GPU has "
        "those tensor cores (default: the checkpoint's own, e.g. MXFP4 experts for gpt-oss)",
    )
    g.add_argument(
        "--kv-dtype",
        choices=KV_PRECISIONS,
        default=None,
        help="KV-cache precision (default: the checkpoint's, bf16)",
    )
    g.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree per worker, MoE models only (divides --tp)"
    )
    g.add_argument(
        "--dp-attention",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel attention replicas per worker, MoE models only (divides --tp); the experts "
        "are then reached by an all-to-all over --ep ranks",
    )
    g.add_argument(
        "--models-dir",
        action="append",
        default=None,
        metavar="DIR",
        help=f"folder of Hugging Face config.json files that extends the model catalog (repeatable; "
        f"also ${MODELS_DIR_ENV}); --model also takes a config.json path directly",
    )


def apply_models_dir(args: argparse.Namespace) -> None:
    """Put ``--models-dir`` folders into ``CROSSFLOW_MODELS_DIR`` so worker processes see them too."""
    folders = [str(d) for d in (getattr(args, "models_dir", None) or [])]
    if folders:
        previous = [d for d in os.environ.get(MODELS_DIR_ENV, "").split(os.pathsep) if d]
        os.environ[MODELS_DIR_ENV] = os.pathsep.join(dict.fromkeys([*folders, *previous]))


MODEL_OPTIONS = ("dtype", "kv_dtype", "ep", "dp_attention")
"""The ``Point`` (and ``GridSpec``) fields the shared flags set, named as the flags' destinations."""


def model_options(args: Any) -> dict[str, Any]:
    """``MODEL_OPTIONS`` of parsed flags (or of any object with those attributes, e.g. a ``GridSpec``)."""
    return {name: getattr(args, name) for name in MODEL_OPTIONS}


def check_model(
    name: str,
    *,
    gpu: str,
    tp: int | None,
    dtype: Precision | None = None,
    kv_dtype: Precision | None = None,
    ep: int = 1,
    dp_attention: int = 1,
    model_flag: str = "--model",
) -> ModelSpec:
    """The model ``name`` with its precision applied and, when ``tp`` is given, its split over
    ``tp``/``ep``/``dp_attention`` checked.

    Raises:
        ValueError: a bad setting; the message starts with its flag (``model_flag`` for the model).
    """
    try:
        gpu_spec = get_gpu(gpu)
    except KeyError as exc:
        raise ValueError(f"--gpu: {exc.args[0]}") from exc
    try:
        spec = lookup_model(name)
    except KeyError as exc:
        raise ValueError(f"{model_flag}: {exc.args[0]}") from exc
    except ConfigError as exc:
        raise ValueError(f"{model_flag} {name}: {exc}") from exc
    try:
        spec = with_precision(spec, gpu_spec, dtype, kv_dtype)
        if tp is not None:
            check_parallelism(spec, gpu_spec, tp, ep, dp_attention)
    except SettingError as exc:
        raise ValueError(f"{FLAGS[exc.field]} {exc.value}: {exc.detail}") from exc
    return spec


def model_from_args(args: argparse.Namespace, model: str | None = None, tp: int | None = None) -> ModelSpec:
    """``check_model`` of the command's ``--model`` (or ``model``) with its shared flags."""
    apply_models_dir(args)
    return check_model(model if model is not None else args.model, gpu=args.gpu, tp=tp, **model_options(args))


def describe_deployment(spec: ModelSpec, args: argparse.Namespace) -> str:
    """`` EP8 DP-attention 8, weights fp8 / KV bf16`` for a command's header line."""
    parallel = (f" EP{args.ep}" if args.ep > 1 else "") + (
        f" DP-attention {args.dp_attention}" if args.dp_attention > 1 else ""
    )
    weights = (
        spec.weight_precision
        if spec.weight_precision == spec.dense_precision
        else (f"{spec.weight_precision} FFN/{spec.dense_precision} attention")
    )
    return f"{parallel}, weights {weights} / KV {spec.kv_precision}"

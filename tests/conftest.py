"""Test-wide settings: offline W&B, one torch thread, and the ``gpu`` and ``cuda`` marker gates."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a CUDA GPU and real SGLang")
    parser.addoption(
        "--run-timing",
        action="store_true",
        help="run wall-clock agreement tests that need cores nothing else is using",
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)  # small MLPs run several times slower with more threads on 2 cores


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if cuda_items and not _cuda_available():
        for item in cuda_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (torch sees none)"))
    if not config.getoption("--run-timing"):
        quiet = pytest.mark.skip(reason="wall-clock agreement: needs idle cores (run with --run-timing)")
        for item in items:
            if "timing" in item.keywords:
                item.add_marker(quiet)
    if config.getoption("--run-gpu"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and SGLang (run with --run-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

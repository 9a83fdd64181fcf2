"""Test-wide settings: offline W&B, one torch thread, and the ``gpu`` marker gate."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a CUDA GPU and real SGLang")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)  # small MLPs run several times slower with more threads on 2 cores


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-gpu"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and SGLang (run with --run-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

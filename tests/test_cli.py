"""The ``crossflow`` entry point as a user runs it: a subprocess with a tiny budget."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def crossflow(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "train.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )


def test_simulate_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    done = crossflow(
        "simulate",
        "--trace",
        "mooncake",
        "--max-requests",
        "80",
        "--policy",
        "heuristic",
        "--no-progress",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "TTFT mean / p50 / p99" in done.stdout
    assert re.search(r"requests finished\s+80 / 80\n", done.stdout)
    assert re.search(r"busy share decode\s+D0 \d+ %, D1 \d+ %, D2 \d+ %, D3 \d+ %", done.stdout)
    payload = json.loads(out.read_text())
    assert payload["metrics"]["n_finished"] == 80 and payload["config"]["n_decode"] == 4


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "broken.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 1}\n'
    )
    done = crossflow("simulate", "--trace", str(bad), "--no-progress")
    assert done.returncode == 2
    assert "broken.jsonl:2" in done.stderr and "Traceback" not in done.stderr
    done = crossflow("simulate", "--shape", "2x4", "--max-requests", "5", "--no-progress")
    assert done.returncode == 2 and "2P4D" in done.stderr

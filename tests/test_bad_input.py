"""Bad input gets a clear error naming the file (and line or field), exit 2, and nothing half-written."""

from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.request import Request, Trace
from envs.trace_formats import TraceFormatError
from envs.traces import drop_empty_requests, load_trace
from train.jsonio import write_json

MOONCAKE_ROWS = "".join(
    json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]}) + "\n"
    for i in range(400)
)


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()
    files: dict[str, tuple[Path, str]] = {}
    (tmp / "noise.jsonl.gz").write_bytes(noise)
    files["not gzip"] = (tmp / "noise.jsonl.gz", r"noise\.jsonl\.gz:1: not a gzip file")
    whole = gzip.compress(MOONCAKE_ROWS.encode())
    (tmp / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    files["cut gzip"] = (tmp / "cut.jsonl.gz", r"cut\.jsonl\.gz:\d+: the gzip stream is damaged or cut short")
    (tmp / "noise.jsonl").write_bytes(
        MOONCAKE_ROWS.splitlines(keepends=True)[0].encode() + b"\xc5\xff" + noise
    )
    files["not utf-8"] = (tmp / "noise.jsonl", r"noise\.jsonl:2: not UTF-8 text")
    (tmp / "empty.jsonl").write_text("")
    files["empty file"] = (tmp / "empty.jsonl", r"empty\.jsonl: empty trace")
    (tmp / "header.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    files["header only"] = (tmp / "header.csv", r"header\.csv: empty trace \(no requests\)")
    zero = "".join(
        json.dumps(
            {
                "timestamp": i,
                "input_length": 100 * (i % 2),
                "output_length": 10 * (1 - i % 2),
                "hash_ids": [i],
            }
        )
        + "\n"
        for i in range(4)
    )
    (tmp / "zeros.jsonl").write_text(zero)
    files["all empty requests"] = (tmp / "zeros.jsonl", r"zeros\.jsonl: no request has both input and output")
    return files


@pytest.mark.parametrize(
    "case", ["not gzip", "cut gzip", "not utf-8", "empty file", "header only", "all empty requests"]
)
def test_malformed_trace_files_name_the_file_and_line(case: str, tmp_path: Path) -> None:
    path, message = _bad_files(tmp_path)[case]
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)


def test_simulate_on_a_bad_file_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    path, _ = _bad_files(tmp_path)["header only"]
    out = tmp_path / "out.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.cli",
            "simulate",
            "--trace",
            str(path),
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2
    assert "header.csv: empty trace" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()


def test_requests_with_zero_tokens_are_dropped_and_counted_keeping_sessions_whole() -> None:
    reqs = [
        Request(0, 0, 0, 0.0, 1000, 10, think_time_s=1.0),
        Request(
            1, 0, 1, 0.0, 1500, 0, parent_id=0, shared_prefix_tokens=1000, depends_on=0, think_time_s=2.0
        ),
        Request(
            2, 0, 2, 0.0, 2000, 10, parent_id=1, shared_prefix_tokens=1500, depends_on=1, think_time_s=3.0
        ),
        Request(3, 1, 0, 0.0, 0, 5, think_time_s=0.5),
    ]
    trace = drop_empty_requests(Trace("t", reqs, closed_loop=True))
    assert [r.input_tokens for r in trace.requests] == [1000, 2000]
    assert trace.meta["dropped_empty_requests"] == 2
    second = trace.requests[1]
    assert second.depends_on == 0 and second.think_time_s == pytest.approx(5.0)  # 2 s + 3 s
    assert second.parent_id == 0 and second.shared_prefix_tokens == 1000  # the dropped link shared 1000


def test_json_the_project_writes_is_strict_and_group_readable(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "r.json"
    write_json(
        out, {"a": float("nan"), "b": [np.float64("inf"), 1.5, np.int64(3)], "c": {"d": -float("inf")}}
    )
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [None, 1.5, 3], "c": {"d": None}}
    mode = stat.S_IMODE(os.stat(out).st_mode)
    assert mode & stat.S_IRGRP, oct(mode)
    assert not list(out.parent.glob(".*.tmp"))  # no temp file left behind
    with pytest.raises(TypeError):
        write_json(tmp_path / "x.json", {"obj": object()})
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-requests", "-5"], "argument --max-requests: expected a positive integer, got '-5'"),
        (["--max-requests", "0"], "argument --max-requests: expected a positive integer, got '0'"),
        (["--load", "inf"], "argument --load: expected a finite number > 0, got 'inf'"),
        (["--load", "nan"], "argument --load: expected a finite number > 0, got 'nan'"),
        (["--seed", "-1"], "argument --seed: expected a non-negative integer, got '-1'"),
        (["--tp", "-1"], "--tp"),
        (["--gpu", "H900"], "--gpu: unknown GPU 'H900'"),
        (["--trace", "mooncake", "--rate-curve", "m-large"], "--rate-curve: applies to closed-loop"),
        (["--trace", "mooncake", "--session-rate", "1"], "--session-rate: applies to closed-loop"),
    ],
)
def test_simulate_refuses_bad_flags_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from train.cli import main

    try:
        code = main(["simulate", "--no-progress", "--max-requests", "2", *argv])
    except SystemExit as exc:  # argparse's own refusal
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "'H900'\"" not in err  # no stray quotes from a KeyError's text


def test_an_unknown_name_is_reported_without_key_error_quotes(capsys: pytest.CaptureFixture[str]) -> None:
    from train.cli import main

    assert main(["simulate", "--no-progress", "--max-requests", "2", "--policy", "fastest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("crossflow simulate: error: unknown policy 'fastest'"), err


def test_simulate_takes_an_interference_model_and_checks_it_matches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from interference_model.artifact import DATA_DIR
    from train.cli import main

    shipped = str(DATA_DIR / "h200_gpt-oss-120b_tp1")
    base = [
        "simulate",
        "--no-progress",
        "--trace",
        "mooncake",
        "--max-requests",
        "20",
        "--policy",
        "heuristic",
    ]
    assert main([*base, "--interference-model", shipped]) == 0
    assert main([*base, "--gpu", "H100", "--interference-model", shipped]) == 2
    err = capsys.readouterr().err
    assert "field 'hardware' is 'h200', but the caller expects 'h100'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-batch", "0", "--out", "{tmp}/p.parquet"],
            "argument --max-batch: expected a positive integer",
        ),
        (["--out", "{tmp}"], "is a directory; give a file name"),
        (
            ["--source", "sglang", "--url", "http://127.0.0.1:9", "--out", "{tmp}/p.parquet"],
            "--url http://127.0.0.1:9: cannot reach the SGLang worker",
        ),
    ],
)
def test_profile_refuses_bad_flags_naming_them(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from train.cli import main

    try:
        code = main(["profile", "--n-states", "3", *(a.format(tmp=tmp_path) for a in argv)])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "p.parquet").exists()


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_a_damaged_rl_policy_file_is_named(damage: str, tmp_path: Path) -> None:
    import shutil

    from policies.rl_policy import DEFAULT_ARTIFACT, load_artifact

    npz = tmp_path / "policy.npz"
    shutil.copy(Path(DEFAULT_ARTIFACT).with_suffix(".json"), npz.with_suffix(".json"))
    good = Path(DEFAULT_ARTIFACT).with_suffix(".npz").read_bytes()
    npz.write_bytes(good[: len(good) // 2] if damage == "truncated" else np.random.default_rng(1).bytes(4000))
    with pytest.raises(ValueError, match=r"policy\.npz"):
        load_artifact(npz)

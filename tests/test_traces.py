"""Trace loaders, bundle format, bundled traces, arrivals and load scaling."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.arrivals import (
    curve_session_starts,
    load_servegen_curve,
    poisson_session_starts,
    sample_sessions,
    scale_load,
    session_rate_for_load,
    split_sessions,
    window,
)
from envs.request import Trace
from envs.traces import (
    BUNDLED_TRACES,
    TraceFormatError,
    build_bundles,
    load_azure,
    load_bundle,
    load_mooncake,
    load_trace,
    load_weka,
    save_bundle,
    trace_stats,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _jsonl(path: Path, objs: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def _assert_valid(trace: Trace) -> None:
    """Every reference points backwards and prefix sharing never exceeds either input."""
    for i, r in enumerate(trace.requests):
        assert r.request_id == i
        assert -1 <= r.parent_id < i and -1 <= r.depends_on < i
        if r.parent_id < 0:
            assert r.shared_prefix_tokens == 0
        else:
            assert r.shared_prefix_tokens <= min(r.input_tokens, trace.requests[r.parent_id].input_tokens)
        assert r.think_time_s >= 0


MOONCAKE_ROWS: list[dict[str, object]] = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 1500, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [1, 4]},
    {"timestamp": 2000, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 5]},
    {"timestamp": 4000, "input_length": 300, "output_length": 2, "hash_ids": [9]},
]


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    return _jsonl(tmp_path / "moon.jsonl", MOONCAKE_ROWS)


def test_mooncake_orders_by_time_and_derives_prefix_parents(mooncake_file: Path) -> None:
    trace = load_mooncake(mooncake_file)
    assert not trace.closed_loop and trace.block_size_tokens == 512
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.5, 2.0, 3.0, 4.0]
    assert [r.input_tokens for r in trace.requests] == [1000, 1200, 2000, 600, 300]
    # (parent, shared): capped by the parent's 1000 input; 3 blocks capped by 1200; block 1 last held
    # by request 2; no match.
    got = [(r.parent_id, r.shared_prefix_tokens) for r in trace.requests]
    assert got == [(-1, 0), (0, 1000), (1, 1200), (2, 512), (-1, 0)]
    assert {r.session_id for r in trace.requests} == {-1}
    _assert_valid(trace)
    stats = trace_stats(trace)
    assert stats["prefix_hit_share"] == pytest.approx((1000 + 1200 + 512) / 5100)
    assert (stats["requests"], stats["sessions"], stats["span_s"]) == (5, 0, 4.0)


def test_mooncake_prefix_parents_match_brute_force(tmp_path: Path) -> None:
    """Random chained block ids (a branch of an earlier request plus fresh blocks) vs. a direct search."""
    rng = np.random.default_rng(5)
    blocks: list[list[int]] = []
    next_id = 0
    for _ in range(150):
        base = blocks[int(rng.integers(len(blocks)))] if blocks and rng.random() < 0.8 else []
        keep = base[: int(rng.integers(len(base) + 1))]
        fresh = list(range(next_id, next_id + int(rng.integers(0 if keep else 1, 4))))
        next_id += len(fresh)
        blocks.append(keep + fresh)
    inputs = [len(b) * 512 - int(rng.integers(0, 512)) if b else 0 for b in blocks]
    rows = [
        {"timestamp": i, "input_length": max(n, 0), "output_length": 1, "hash_ids": b}
        for i, (n, b) in enumerate(zip(inputs, blocks, strict=True))
    ]
    trace = load_mooncake(_jsonl(tmp_path / "rand.jsonl", rows))
    for i, r in enumerate(trace.requests):
        best_parent, best_blocks = -1, 0
        for j in range(i):
            common = 0
            while common < min(len(blocks[i]), len(blocks[j])) and blocks[i][common] == blocks[j][common]:
                common += 1
            if common >= best_blocks and common > 0:
                best_parent, best_blocks = j, common
        shared = min(best_blocks * 512, r.input_tokens, inputs[best_parent]) if best_parent >= 0 else 0
        expected = (best_parent, shared) if shared > 0 else (-1, 0)
        assert (r.parent_id, r.shared_prefix_tokens) == expected, i


def test_azure_timestamps_to_seconds(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:18:03.9799601,5,1"
    )
    trace = load_azure(path)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.052, 60.0000001]
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests] == [(4808, 10), (3180, 8), (5, 1)]
    assert all(r.parent_id == -1 for r in trace.requests)


def _weka_sessions() -> list[dict[str, object]]:
    def req(t: float, n_in: int, ids: list[int], **extra: object) -> dict[str, object]:
        return {"t": t, "type": "n", "in": n_in, "out": 3, "hash_ids": ids, "api_time": 1.0, **extra}

    marker = {
        "t": 12.0,
        "type": "subagent",
        "agent_id": "agent_001",
        "requests": [req(0.0, 100, [1, 7], think_time=0.0), req(3.0, 150, [1, 7, 8], think_time=1.0)],
    }
    s0: dict[str, object] = {
        "id": "trace_0001",
        "block_size": 64,
        "requests": [
            req(0.0, 128, [1, 2], think_time=0.0),
            req(10.0, 200, [1, 2, 3], think_time=5.0),
            marker,
            req(20.0, 300, [1, 2, 3, 4], think_time=-2.0),
            req(30.0, 310, [1, 2, 3, 4]),  # think_time missing
        ],
    }
    s1: dict[str, object] = {"id": "trace_0002", "requests": [req(0.0, 64, [1, 2], think_time=0.5)]}
    return [s0, s1]


@pytest.fixture
def weka_file(tmp_path: Path) -> Path:
    path = tmp_path / "weka.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in _weka_sessions())
    return path


def test_weka_closed_loop_dependencies_with_subagent(weka_file: Path) -> None:
    trace = load_weka(weka_file)
    assert trace.closed_loop and trace.block_size_tokens == 64
    r = trace.requests
    # release order: parent r0, r1, sub-agent s0 (t=12), s1 (t=15), parent r2 (20), r3 (30); session 1
    assert [x.arrival_s for x in r] == [0.0, 10.0, 12.0, 15.0, 20.0, 30.0, 0.0]
    assert [x.session_id for x in r] == [0, 0, 0, 0, 0, 0, 1]
    assert [x.turn for x in r] == [0, 1, 2, 3, 4, 5, 0]
    assert [x.depends_on for x in r] == [-1, 0, 1, 2, 1, 4, -1]
    assert [x.think_time_s for x in r] == [0.0, 5.0, 0.0, 1.0, 0.0, 0.0, 0.5]
    assert trace.meta == {"clamped_negative_think_times": 1, "missing_think_times": 1}
    # prefixes: 2 blocks capped by 128; sub-agent shares block 1 with r1; s1 extends s0 (capped at 100);
    # r2 shares 3 blocks with r1 (capped at 200); r3 extends r2; session 1 ids are local -> no parent
    got = [(x.parent_id, x.shared_prefix_tokens) for x in r]
    assert got == [(-1, 0), (0, 128), (1, 64), (2, 100), (1, 192), (4, 256), (-1, 0)]
    _assert_valid(trace)


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        (
            "moon.jsonl",
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}\n'
            '{"timestamp": 1, "input_length": "abc", "output_length": 1, "hash_ids": []}\n',
            "moon.jsonl:2: field 'input_length': expected non-negative int, got 'abc'",
        ),
        ("moon.jsonl", "\n{not json\n", "moon.jsonl:2: field '<json>'"),
        (
            "moon.jsonl",
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "x"}\n',
            "moon.jsonl:1: field 'hash_ids'",
        ),
        (
            "az.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04.03,1,1\n2023-11-16 18:17,1,1\n",
            "az.csv:3: field 'TIMESTAMP'",
        ),
        (
            "az.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04.03,1,-4\n",
            "az.csv:2: field 'GeneratedTokens'",
        ),
        (
            "weka.jsonl",
            '{"requests": []}\n{"requests": [{"t": 0, "in": 5, "out": 1, "hash_ids": []}, '
            '{"t": 1, "in": 5, "out": 1.5, "hash_ids": []}]}\n',
            "weka.jsonl:2: field 'requests[1].out'",
        ),
    ],
)
def test_malformed_input_names_file_line_field(
    tmp_path: Path, name: str, content: str, expected: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        load_trace(path)


def test_bundle_round_trip_is_exact_and_reproducible(
    tmp_path: Path, weka_file: Path, mooncake_file: Path
) -> None:
    for original in (load_weka(weka_file), load_mooncake(mooncake_file)):
        original.source = "a source, with spaces = and %"
        a, b = tmp_path / "a.csv.gz", tmp_path / "b.csv.gz"
        save_bundle(original, a)
        save_bundle(original, b)
        assert a.read_bytes() == b.read_bytes()
        loaded = load_bundle(a)
        assert loaded.requests == original.requests
        assert (loaded.name, loaded.closed_loop, loaded.source, loaded.block_size_tokens) == (
            original.name,
            original.closed_loop,
            original.source,
            original.block_size_tokens,
        )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp files left


def _write_bundle_text(path: Path, lines: list[str]) -> None:
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("1,0,1,1.0,10,1,1,0,-1,0", "parent_id"),  # not an earlier request
        ("1,0,1,1.0,10,1,-1,0,3,0", "depends_on"),
        ("1,0,1,1.0,10,1,0,11,-1,0", "shared_prefix_tokens"),  # more than either input
        ("1,0,1,1.0,-10,1,-1,0,-1,0", "input_tokens"),
        ("2,0,1,1.0,10,1,-1,0,-1,0", "request_id"),
        ("1,0,1,x,10,1,-1,0,-1,0", "arrival_s"),
    ],
)
def test_bundle_validation_names_line_and_field(tmp_path: Path, row: str, field: str) -> None:
    path = tmp_path / "bad.csv.gz"
    header = (
        "request_id,session_id,turn,arrival_s,input_tokens,output_tokens,parent_id,shared_prefix_tokens,"
        "depends_on,think_time_s"
    )
    _write_bundle_text(
        path,
        ["# crossflow-trace v1 name=x closed_loop=1 block_size=64", header, "0,0,0,0.0,20,1,-1,0,-1,0", row],
    )
    with pytest.raises(TraceFormatError, match=rf"bad\.csv\.gz:4: field '{field}'"):
        load_bundle(path)


def test_load_trace_detects_formats(tmp_path: Path, weka_file: Path, mooncake_file: Path) -> None:
    assert load_trace(weka_file).closed_loop
    assert len(load_trace(str(mooncake_file))) == 5
    bundle = tmp_path / "m.csv.gz"
    save_bundle(load_mooncake(mooncake_file), bundle)
    assert load_trace(bundle).requests == load_mooncake(mooncake_file).requests
    with pytest.raises(FileNotFoundError, match="not a bundled trace name"):
        load_trace("no-such-trace")


# (name, requests, sessions, prefix-hit share quoted in the upstream README)
BUNDLED_EXPECTED = [
    ("agent", 30165, 449, 0.96),  # 30,182 in the file, 17 with zero output tokens dropped
    ("mooncake", 12031, 0, 0.37),
    ("mooncake-synthetic", 3993, 0, 0.65),
    ("azure-code", 8819, 0, 0.0),
]
DROPPED_EMPTY = {"agent": 17}


@pytest.mark.parametrize(("name", "n_requests", "n_sessions", "hit_share"), BUNDLED_EXPECTED)
def test_bundled_traces_load_with_expected_counts(
    name: str, n_requests: int, n_sessions: int, hit_share: float
) -> None:
    trace = load_trace(name)
    assert trace.name == name and len(trace) == n_requests
    assert trace.meta.get("dropped_empty_requests", 0) == DROPPED_EMPTY.get(name, 0)
    assert all(r.input_tokens > 0 and r.output_tokens > 0 for r in trace.requests)
    assert len([s for s in trace.session_ids if s >= 0]) == n_sessions
    assert trace.closed_loop == (name == "agent")
    shared = sum(r.shared_prefix_tokens for r in trace.requests)
    assert shared / sum(r.input_tokens for r in trace.requests) == pytest.approx(hit_share, abs=0.01)
    _assert_valid(trace)


def test_build_bundles_from_original_layout(tmp_path: Path, weka_file: Path, mooncake_file: Path) -> None:
    src = tmp_path / "src"
    for sub in ("mooncake", "azure_llm_2023", "weka_claude_code", "servegen"):
        (src / sub).mkdir(parents=True)
    (src / "mooncake/conversation_trace.jsonl").write_bytes(mooncake_file.read_bytes())
    (src / "mooncake/synthetic_trace.jsonl").write_bytes(mooncake_file.read_bytes())
    (src / "weka_claude_code/weka_cc_traces.jsonl.gz").write_bytes(weka_file.read_bytes())
    (src / "azure_llm_2023/AzureLLMInferenceTrace_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04.0319600,3180,8\n"
    )
    with gzip.open(src / "servegen/servegen_window_aggregates.csv.gz", "wt") as f:
        f.write(
            "category,model,window_start_s,day,hour_of_day,requests_all,requests_with_dist,input_tokens,"
            "output_tokens,clients_active,clients_with_dist\n"
            "language,m-x,0,0,0,600,300,3000,1000,2,1\nlanguage,m-x,1200,0,0,1200,0,0,0,1,0\n"
        )
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "envs.traces", "build", "--source", str(src), "--out", str(out)],
        check=True,
        cwd=REPO_ROOT,
        capture_output=True,
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*BUNDLED_TRACES.values(), "servegen_rate_curves.csv"]
    )
    assert load_bundle(out / BUNDLED_TRACES["agent"]).requests == load_weka(weka_file).requests
    curve = (out / "servegen_rate_curves.csv").read_text().splitlines()
    # the missing 600 s window is written empty (unknown); mean lengths come from clients with pdfs
    assert curve[1:] == ["language,m-x,0,1,3,10,3", "language,m-x,600,,,,", "language,m-x,1200,2,,,"]
    first = (out / BUNDLED_TRACES["mooncake"]).read_bytes()
    build_bundles(src, out)
    assert (out / BUNDLED_TRACES["mooncake"]).read_bytes() == first


def test_poisson_starts_deterministic_and_at_rate() -> None:
    a = poisson_session_starts(20_000, 4.0, np.random.default_rng(7))
    b = poisson_session_starts(20_000, 4.0, np.random.default_rng(7))
    assert np.array_equal(a, b) and np.all(np.diff(a) > 0) and a[0] > 0
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.03)


def test_curve_starts_follow_piecewise_rate() -> None:
    times, rates = [100.0, 110.0, 120.0], [1.0, 0.0, 2.0]
    starts = curve_session_starts(5000, times, rates, np.random.default_rng(1))
    assert np.all(np.diff(starts) >= 0)
    assert not np.any((starts >= 10.0) & (starts < 20.0))  # the zero-rate window stays empty
    # expected 10 starts in [0, 10) and 2 per second after 20 s
    assert np.sum(starts < 10.0) == pytest.approx(10, abs=12)
    tail = starts[starts >= 20.0]
    assert len(tail) / (tail[-1] - 20.0) == pytest.approx(2.0, rel=0.05)
    with pytest.raises(ValueError, match="ends at rate 0"):
        curve_session_starts(100, [0.0, 10.0], [1.0, 0.0], np.random.default_rng(0))


def test_servegen_curve_bundled() -> None:
    times, rates = load_servegen_curve("m-large")
    assert len(times) == 14 * 144 and times[1] - times[0] == 600.0 and np.all(rates >= 0)
    t1, r1 = load_servegen_curve("m-large", days=1, start_day=3)
    assert len(t1) == 144 and t1[0] == 0.0 and np.array_equal(r1, rates[3 * 144 : 4 * 144])
    with pytest.raises(KeyError, match="m-large"):
        load_servegen_curve("gpt-5")
    # m-small misses the window at 172 h upstream: filled between its neighbours, not with 0
    t_mid, r_mid = load_servegen_curve("m-small")
    i = int(np.flatnonzero(t_mid == 172 * 3600)[0])
    assert r_mid[i] == pytest.approx((r_mid[i - 1] + r_mid[i + 1]) / 2)


def test_scale_load_open_and_closed(mooncake_file: Path, weka_file: Path) -> None:
    moon = load_mooncake(mooncake_file)
    faster = scale_load(moon, 2.0)
    assert [r.arrival_s for r in faster.requests] == [0.0, 0.75, 1.0, 1.5, 2.0]
    assert [r.parent_id for r in faster.requests] == [r.parent_id for r in moon.requests]
    agent = load_weka(weka_file)
    assert scale_load(agent, 3.0) is agent
    assert session_rate_for_load(0.5, 3.0) == 1.5
    with pytest.raises(ValueError):
        scale_load(moon, 0.0)


def test_window_rebases_and_cuts_parents(mooncake_file: Path) -> None:
    w = window(load_mooncake(mooncake_file), 1.5, 2.0)  # original requests 1, 2, 3
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.5]
    assert [(r.parent_id, r.shared_prefix_tokens) for r in w.requests] == [(-1, 0), (0, 1200), (1, 512)]
    _assert_valid(w)


def test_sample_and_split_sessions_keep_references_valid() -> None:
    agent = load_trace("agent")
    train, test = split_sessions(agent, 0.8, seed=3)
    assert len(train.session_ids) == round(0.8 * 449) and len(train) + len(test) == len(agent)
    assert split_sessions(agent, 0.8, seed=3)[0].requests == train.requests
    for part in (train, test):
        _assert_valid(part)
        assert part.session_ids == list(range(len(part.session_ids)))
        # sessions are kept whole, so no dependency or parent was cut
        assert sum(r.depends_on >= 0 for r in part.requests) == len(part) - len(part.session_ids)
    parents = sum(r.parent_id >= 0 for r in agent.requests)
    assert sum(r.parent_id >= 0 for p in (train, test) for r in p.requests) == parents
    sample = sample_sessions(agent, 5, np.random.default_rng(0))
    assert len(sample.session_ids) == 5
    _assert_valid(sample)
    assert sample.requests == sample_sessions(agent, 5, np.random.default_rng(0)).requests
    with pytest.raises(ValueError, match="session id"):
        sample_sessions(load_trace("mooncake"), 2, np.random.default_rng(0))


def test_a_bundled_trace_is_read_once_and_each_load_is_its_own() -> None:
    """A second ``load_trace`` of a bundled name reuses the parsed file; each caller gets its own
    request list and meta, equal to the first."""
    import envs.traces as traces

    traces._BUNDLED_LOADED.pop("mooncake", None)
    first = traces.load_trace("mooncake")
    second = traces.load_trace("mooncake")
    assert first.requests == second.requests and first.meta == second.meta
    assert first.requests is not second.requests and first.meta is not second.meta
    first.requests.pop()
    first.meta["x"] = 1
    third = traces.load_trace("mooncake")
    assert third.requests == second.requests and "x" not in third.meta

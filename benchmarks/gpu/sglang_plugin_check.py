"""GPU check of the Crossflow SGLang plugin: real SGLang 0.5.23, one prefill and one decode worker,
borrowed and normal PD requests at once, and what must hold afterwards.

Needs a CUDA machine with ``pip install -e '.[gpu]'`` (SGLang 0.5.23 and this repository) and a model
on local disk. Not run in CI and, so far, never run on hardware (docs/serving.md says what has run).

    python benchmarks/gpu/sglang_plugin_check.py --model /models/Qwen2.5-0.5B-Instruct --out /tmp/check
    python benchmarks/gpu/sglang_plugin_check.py --model M --print-commands     # the commands only

What it does, in order (every process on 127.0.0.1, stopped at the end):

1. starts the prefill worker (``--disaggregation-mode prefill``) and the decode worker with the
   plugin (``SGLANG_PLUGINS=crossflow``, ``--disaggregation-mode decode --disable-overlap-schedule
   --enable-metrics``), by default both on GPU 0 with ``--mem-fraction-static 0.35`` each and the
   ``mooncake_tcp`` transfer backend (no RDMA needed); waits for ``/health``;
2. checks the plugin is loaded and enabled (``/server_info`` -> ``internal_states[0].crossflow``) and
   installs a lease through ``/set_internal_state`` (what the Crossflow router does for each lease),
   with a per-iteration cap of ``--chunk-cap-tokens`` on borrowed prefill beside a decoding batch
   (the router sends its node policy's ``ChunkLimits``; here the same cap for every batch);
3. starts smg 1.13.0 in PD mode over the two workers (the normal path) and a borrow-all forwarder
   that sends every request to the decode worker alone with ``do_local_prefill: true`` and the
   prefill worker's bootstrap fields (what the Crossflow router sends on the borrowed path; it stands
   in for that router until it exists, and does no fallback);
4. replays the first ``--max-requests`` requests of ``--trace`` twice at once with ``crossflow
   replay``: through smg, and through the forwarder (another seed: other prompts);
5. checks: every request of both replays finished with exactly its trace output length and no
   refusal; the plugin admitted, started and finished every borrowed request, computed their prompts
   locally, paid no token it had no credit for and never computed more than the cap in one step
   while requests decoded; ``sglang:num_retracted_requests_total`` is 0.
   It writes ``report.json`` (the figures, the commands, the problems) and exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.chunk_limits import ChunkLimits

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class CheckConfig:
    """One run of the check; each field is a command-line option."""

    model: str
    out: Path = Path("sglang_plugin_check")
    prefill_gpu: int = 0
    decode_gpu: int = 0
    mem_fraction: float = 0.35
    """``--mem-fraction-static`` of each worker (both share one GPU by default)."""
    transfer_backend: str = "mooncake_tcp"
    prefill_port: int = 31000
    decode_port: int = 31001
    bootstrap_port: int = 31998
    mixed_chunk: bool = False
    """Start the decode worker with ``--enable-mixed-chunk`` (borrowed chunks mixed into decode)."""
    trace: str = "azure-code"
    max_requests: int = 12
    load: float = 1.0
    startup_timeout_s: float = 900.0
    replay_timeout_s: float = 600.0
    lease_ttl_s: float = 3600.0
    chunk_cap_tokens: int = 256
    """The lease's cap on one local EXTEND step beside a decoding batch (``ChunkLimits``)."""
    lease: dict[str, int] = field(
        default_factory=lambda: {
            "prefill_tokens": 100_000_000,
            "kv_tokens": 10_000_000,
            "transfer_tokens": 0,
            "decode_tokens": 10_000_000,
            "tasks": 64,
        }
    )
    """A lease large enough that nothing is refused for lack of budget (the check is of the hooks)."""


def server_commands(cfg: CheckConfig) -> dict[str, tuple[dict[str, str], list[str]]]:
    """name -> (extra environment, argv) of the two SGLang workers."""
    common = [
        "--model-path",
        cfg.model,
        "--host",
        "127.0.0.1",
        "--mem-fraction-static",
        str(cfg.mem_fraction),
    ]
    common += ["--disaggregation-transfer-backend", cfg.transfer_backend]
    prefill = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        *common,
        "--port",
        str(cfg.prefill_port),
        "--base-gpu-id",
        str(cfg.prefill_gpu),
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(cfg.bootstrap_port),
    ]
    decode = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        *common,
        "--port",
        str(cfg.decode_port),
        "--base-gpu-id",
        str(cfg.decode_gpu),
        "--disaggregation-mode",
        "decode",
        "--disable-overlap-schedule",
        "--enable-metrics",
        *(["--enable-mixed-chunk"] if cfg.mixed_chunk else []),
    ]
    plugin_env = {"SGLANG_PLUGINS": "crossflow", "CROSSFLOW_NODE_ID": "0"}
    return {"prefill": ({}, prefill), "decode": (plugin_env, decode)}


def replay_command(cfg: CheckConfig, url: str, seed: int, json_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "train.cli",
        "replay",
        "--url",
        url,
        "--trace",
        cfg.trace,
        "--max-requests",
        str(cfg.max_requests),
        "--load",
        str(cfg.load),
        "--seed",
        str(seed),
        "--timeout-s",
        str(cfg.replay_timeout_s),
        "--json",
        str(json_path),
    ]


def shell_line(env: Mapping[str, str], argv: Sequence[str], *, python: str | None = None) -> str:
    """One shell line (``python`` replaces this interpreter's path, for printing)."""
    words = [python if python is not None and w == sys.executable else w for w in argv]
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, words)])


# ---------------------------------------------------------------- what must hold
def sent_requests(replay: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [r for r in replay["requests"] if r["send_s"] is not None]


def check_replay(name: str, replay: Mapping[str, Any], expected: int) -> list[str]:
    """Every one of ``expected`` requests sent, finished, not refused, with its trace output length."""
    problems = []
    sent = sent_requests(replay)
    if len(sent) != expected:
        problems.append(f"{name}: {len(sent)} requests sent, expected {expected}")
    if replay.get("timed_out"):
        problems.append(f"{name}: the replay timed out")
    for r in sent:
        rid = r["request_id"]
        if r["rejected"] or r["status"] != 200:
            problems.append(f"{name}: request {rid} refused ({r['status']}: {r['error']})")
        elif r["completion_tokens"] != r["output_tokens"]:
            got, want = r["completion_tokens"], r["output_tokens"]
            problems.append(f"{name}: request {rid} gave {got} tokens, the trace has {want}")
        elif r["finish_s"] is None:
            problems.append(f"{name}: request {rid} did not finish ({r['error']})")
    return problems


def uniform_chunk_limits(cap_tokens: int) -> ChunkLimits:
    """A lease's ``ChunkLimits`` that caps every borrowed step beside a decoding batch at ``cap_tokens``."""
    from policies.chunk_limits import ChunkLimits

    return ChunkLimits((1, 1 << 20), (0, 1 << 40), ((cap_tokens, cap_tokens), (cap_tokens, cap_tokens)))


def check_plugin(state: Mapping[str, Any], borrowed: int, chunk_cap_tokens: int | None = None) -> list[str]:
    """The plugin's own record of the run (``internal_states[0].crossflow`` after it); with
    ``chunk_cap_tokens``, the cap its lease carried."""
    problems = []
    if state.get("disabled"):
        problems.append(f"plugin disabled: {state['disabled']}")
    if chunk_cap_tokens is not None:
        largest = state.get("largest_step_beside_decode_tokens", 0)
        if not state.get("chunk_limited"):
            problems.append("the plugin's lease carries no chunk limits")
        if largest > chunk_cap_tokens:
            problems.append(
                f"a local step computed {largest} tokens beside decodes, over the {chunk_cap_tokens} cap"
            )
    counters = state.get("counters", {})
    for name in ("admitted", "started", "finished"):
        if counters.get(name, 0) != borrowed:
            problems.append(f"plugin {name} {counters.get(name, 0)} borrowed requests, expected {borrowed}")
    if borrowed and counters.get("local_prefill_tokens", 0) <= 0:
        problems.append("plugin computed no prompt token locally")
    for name, value in counters.items():
        if (name.startswith(("rejected_", "lapsed_", "aborted_")) or name == "overspent_tokens") and value:
            problems.append(f"plugin counted {value} {name}")
    if state.get("queued") or state.get("started"):
        problems.append(f"plugin still holds {state.get('queued')} queued and {state.get('started')} started")
    held = state.get("held", {})
    if any(held.values()):
        problems.append(f"plugin lease still held after the run: {held}")
    return problems


def retractions(metrics_text: str) -> float | None:
    """``sglang:num_retracted_requests_total`` summed over its label sets (None when absent)."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith("sglang:num_retracted_requests_total"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def check_retractions(metrics_text: str) -> list[str]:
    n = retractions(metrics_text)
    if n is None:
        return ["sglang:num_retracted_requests_total missing from the decode worker's /metrics"]
    return [] if n == 0 else [f"the decode worker retracted {n:g} requests"]


# ---------------------------------------------------------------- the borrow-all forwarder
class BorrowForwarder:
    """Forwards every ``POST /generate`` to the decode worker with ``do_local_prefill: true`` and the
    prefill worker's bootstrap fields (a fresh room each), streaming the answer back; other requests
    are forwarded as they are. No retries, no fallback: a refusal reaches the client."""

    def __init__(self, decode_url: str, bootstrap_host: str, bootstrap_port: int) -> None:
        import httpx

        client = httpx.Client(base_url=decode_url, timeout=None, trust_env=False)
        rng = random.Random(0)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the answer ends when the connection closes

            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self, method: str, body: bytes | None) -> None:
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                with client.stream(method, self.path, content=body, headers=headers) as resp:
                    self.send_response(resp.status_code)
                    for key in ("content-type",):
                        if key in resp.headers:
                            self.send_header(key, resp.headers[key])
                    self.end_headers()
                    for chunk in resp.iter_raw():
                        self.wfile.write(chunk)
                        self.wfile.flush()

            def do_GET(self) -> None:
                self._relay("GET", None)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/generate":
                    payload = json.loads(body)
                    with lock:
                        room = rng.randrange(2**63)
                    payload.update(
                        do_local_prefill=True,
                        bootstrap_host=bootstrap_host,
                        bootstrap_port=bootstrap_port,
                        bootstrap_room=room,
                    )
                    body = json.dumps(payload).encode()
                self._relay("POST", body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._client = client

    def __enter__(self) -> BorrowForwarder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._client.close()


# ---------------------------------------------------------------- running it
def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=5.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s; see {log}")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(cfg: CheckConfig) -> dict[str, Any]:
    """Run the check (see the module docstring); returns the report (also written to ``report.json``)."""
    import httpx

    from policies.lease import LeaseBudgets
    from serving.gateways import Gateway, GatewaySpec
    from serving.sglang_plugin.wire import INTERNAL_STATE_KEY, lease_update_body

    cfg.out.mkdir(parents=True, exist_ok=True)
    for port in (cfg.prefill_port, cfg.decode_port, cfg.bootstrap_port):
        if not _port_free(port):
            raise RuntimeError(f"port {port} on 127.0.0.1 is taken")
    prefill_url = f"http://127.0.0.1:{cfg.prefill_port}"
    decode_url = f"http://127.0.0.1:{cfg.decode_port}"
    report: dict[str, Any] = {"config": {**asdict(cfg), "out": str(cfg.out)}, "commands": {}, "problems": []}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, (env, argv) in server_commands(cfg).items():
            report["commands"][name] = shell_line(env, argv)
            log = cfg.out / f"{name}.log"
            procs.append(
                subprocess.Popen(
                    argv,
                    env={**os.environ, **env},
                    stdout=log.open("wb"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=REPO,
                )
            )
        for url, proc, name in ((prefill_url, procs[0], "prefill"), (decode_url, procs[1], "decode")):
            _wait_health(url, proc, cfg.startup_timeout_s, cfg.out / f"{name}.log")
        info = httpx.get(f"{decode_url}/server_info", timeout=30.0, trust_env=False).json()
        plugin_state = info["internal_states"][0].get(INTERNAL_STATE_KEY)
        if plugin_state is None:
            raise RuntimeError("the decode worker's /server_info has no crossflow state: plugin not loaded")
        if plugin_state["disabled"]:
            raise RuntimeError(f"the plugin is disabled on the decode worker: {plugin_state['disabled']}")
        body = lease_update_body(
            LeaseBudgets.from_dict(cfg.lease), cfg.lease_ttl_s, uniform_chunk_limits(cfg.chunk_cap_tokens)
        )
        updated = httpx.post(
            f"{decode_url}/set_internal_state", json=body, timeout=30.0, trust_env=False
        ).json()
        if updated != [True] * len(updated) or not updated:
            raise RuntimeError(f"the lease was not installed: /set_internal_state answered {updated}")
        spec = GatewaySpec("smg", prefill=((prefill_url, cfg.bootstrap_port),), decode=(decode_url,))
        with (
            Gateway(spec, log_path=cfg.out / "smg.log").start() as gateway,
            BorrowForwarder(decode_url, "127.0.0.1", cfg.bootstrap_port) as forwarder,
        ):
            runs = {"normal": (gateway.url, 1), "borrowed": (forwarder.url, 2)}
            replays = {}
            for name, (url, seed) in runs.items():
                argv = replay_command(cfg, url, seed, cfg.out / f"replay_{name}.json")
                report["commands"][f"replay_{name}"] = shell_line({}, argv)
                replays[name] = subprocess.Popen(
                    argv, cwd=REPO, stdout=(cfg.out / f"replay_{name}.log").open("wb")
                )
            for name, proc in replays.items():
                if proc.wait(timeout=cfg.replay_timeout_s + 120) != 0:
                    report["problems"].append(f"replay {name} exited with {proc.returncode}")
        results = {n: json.loads((cfg.out / f"replay_{n}.json").read_text()) for n in runs}
        info = httpx.get(f"{decode_url}/server_info", timeout=30.0, trust_env=False).json()
        plugin_state = info["internal_states"][0][INTERNAL_STATE_KEY]
        metrics_text = httpx.get(f"{decode_url}/metrics", timeout=30.0, trust_env=False).text
        (cfg.out / "decode_metrics.txt").write_text(metrics_text)
        for name, result in results.items():
            report["problems"] += check_replay(name, result, cfg.max_requests)
            report[f"replay_{name}"] = result["metrics"]
        report["problems"] += check_plugin(plugin_state, cfg.max_requests, cfg.chunk_cap_tokens)
        report["problems"] += check_retractions(metrics_text)
        report["plugin"] = plugin_state
        report["retractions"] = retractions(metrics_text)
    finally:
        for proc in reversed(procs):
            _stop(proc)
        (cfg.out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def parse_args(argv: Sequence[str] | None = None) -> tuple[CheckConfig, bool]:
    defaults = CheckConfig(model="")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model path on local disk (or a hub id if online)")
    p.add_argument("--out", type=Path, default=defaults.out, help="logs, replays and report.json go here")
    for name in (
        "prefill_gpu",
        "decode_gpu",
        "prefill_port",
        "decode_port",
        "bootstrap_port",
        "max_requests",
        "chunk_cap_tokens",
    ):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("mem_fraction", "load", "startup_timeout_s", "replay_timeout_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    p.add_argument("--transfer-backend", default=defaults.transfer_backend)
    p.add_argument("--trace", default=defaults.trace)
    p.add_argument("--mixed-chunk", action="store_true", help="decode worker with --enable-mixed-chunk")
    p.add_argument("--print-commands", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k != "print_commands"}
    return CheckConfig(**values), args.print_commands


def main(argv: Sequence[str] | None = None) -> int:
    cfg, print_only = parse_args(argv)
    if print_only:
        for name, (env, cmd) in server_commands(cfg).items():
            print(f"# {name} worker\n{shell_line(env, cmd, python='python')}")
        print("# normal path: smg in PD mode; borrowed path: the borrow-all forwarder (see the docstring)")
        for name, seed in (("normal", 1), ("borrowed", 2)):
            cmd = replay_command(cfg, f"<{name} url>", seed, cfg.out / f"replay_{name}.json")
            print(f"# replay, {name} path\n{shell_line({}, cmd, python='python')}")
        return 0
    report = run(cfg)
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    print(f"{len(report['problems'])} problem(s); report: {cfg.out / 'report.json'}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Launch a real SGLang gateway (smg, or the older sglang-router) on loopback over given workers.

Both gateways are Rust binaries behind a thin Python launcher, installed by the ``serving`` extra:

- ``smg`` 1.13.0 (SGLang's current gateway, "Shepherd Model Gateway"): ``python -m smg launch``;
- ``sglang-router`` 0.3.2: ``python -m sglang_router.launch_router``.

They take the same worker flags (read from their launchers' ``router_args.py`` and ``--help``):
regular mode ``--worker-urls URL ...``; PD mode ``--pd-disaggregation --prefill URL [BOOTSTRAP_PORT]
... --decode URL ...``; ``--policy`` (both legs), ``--prefill-policy`` / ``--decode-policy`` (one leg).
Both install a console script named ``smg`` (sglang-router 0.3.2 ships an ``smg`` alias too), so the
launchers are run as modules of the current interpreter, never by script name.

Every gateway runs with a blocked-egress environment: ``HTTP(S)_PROXY`` point at a closed loopback
port, ``NO_PROXY`` lets loopback through, and ``HF_HUB_OFFLINE=1``. sglang-router 0.3.2 tries to
fetch the served model's tokenizer from the Hugging Face hub when a worker registers; blocked, it
logs a warning and routes token-free ``/generate`` requests anyway. Readiness is ``GET /readiness``
answering 200 (both gateways: "ready" once a worker passed its health check); stopping sends SIGTERM
to the gateway's own process id and SIGKILL after a grace period.

    with Gateway(GatewaySpec("smg", workers=("http://127.0.0.1:30001",))) as gw:
        print(gw.url)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import httpx

GatewayKind = Literal["smg", "sglang-router"]

LAUNCHER_MODULE: dict[str, tuple[str, ...]] = {
    "smg": ("smg", "launch"),
    "sglang-router": ("sglang_router.launch_router",),
}
"""``python -m`` arguments that start each gateway's router (no workers of its own)."""

_PACKAGE = {"smg": "smg", "sglang-router": "sglang_router"}

POLICIES: dict[str, tuple[str, ...]] = {
    "smg": (
        "random",
        "round_robin",
        "passthrough",
        "cache_aware",
        "power_of_two",
        "least_load",
        "manual",
        "consistent_hashing",
        "prefix_hash",
    ),
    "sglang-router": ("random", "round_robin", "cache_aware", "power_of_two", "manual"),
}
"""Policies each gateway accepts for ``--policy`` and either PD leg (smg 1.13.0
``router_args.py`` ``COMMON_POLICY_CHOICES``; sglang-router 0.3.2 ``router_args.py`` choices); the
prefill leg also takes ``bucket`` in both."""


@dataclass(frozen=True)
class GatewaySpec:
    """One gateway: which binary, over which workers, with which routing policy.

    Regular mode when ``workers`` is given; PD mode when ``prefill`` and ``decode`` are (each prefill
    worker with its bootstrap port, or None when it has none).
    """

    kind: GatewayKind
    workers: tuple[str, ...] = ()
    prefill: tuple[tuple[str, int | None], ...] = ()
    decode: tuple[str, ...] = ()
    policy: str = "cache_aware"
    """Both legs (regular mode: the only one). Both gateways default to ``cache_aware``."""
    prefill_policy: str | None = None
    decode_policy: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    """0 = a free loopback port chosen at start."""
    extra_args: tuple[str, ...] = ()
    """More flags, passed through verbatim (e.g. ``("--cache-threshold", "0.5")``)."""

    def __post_init__(self) -> None:
        if self.kind not in LAUNCHER_MODULE:
            raise ValueError(f"unknown gateway {self.kind!r}; known: {', '.join(LAUNCHER_MODULE)}")
        pd = bool(self.prefill or self.decode)
        if pd == bool(self.workers):
            raise ValueError("give either workers (regular mode) or prefill and decode workers (PD mode)")
        if pd and not (self.prefill and self.decode):
            raise ValueError("PD mode needs at least one prefill and one decode worker")
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            allowed = POLICIES[self.kind] + (("bucket",) if name == "prefill_policy" else ())
            if value is not None and value not in allowed:
                known = ", ".join(allowed)
                raise ValueError(f"GatewaySpec.{name}: unknown policy {value!r}; known: {known}")

    @property
    def pd(self) -> bool:
        return bool(self.prefill)


def missing_reason(kind: GatewayKind) -> str | None:
    """Why the gateway cannot be launched from this interpreter, or None when it can."""
    package = _PACKAGE[kind]
    if importlib.util.find_spec(package) is None:
        return f"{kind} is not installed (pip install 'crossflow[serving]')"
    return None


def gateway_command(
    spec: GatewaySpec, port: int, python: str = sys.executable, metrics_port: int | None = None
) -> list[str]:
    """The command line that starts ``spec``'s gateway on ``port``; its Prometheus exporter listens on
    ``spec.host`` too, at ``metrics_port`` (default: a free port), never on every interface."""
    cmd = [python, "-m", *LAUNCHER_MODULE[spec.kind], "--host", spec.host, "--port", str(port)]
    cmd += ["--prometheus-host", spec.host]
    cmd += ["--prometheus-port", str(metrics_port if metrics_port is not None else free_loopback_port())]
    cmd += ["--policy", spec.policy]
    if spec.pd:
        cmd.append("--pd-disaggregation")
        for url, bootstrap_port in spec.prefill:
            cmd += ["--prefill", url, "none" if bootstrap_port is None else str(bootstrap_port)]
        for url in spec.decode:
            cmd += ["--decode", url]
        if spec.prefill_policy is not None:
            cmd += ["--prefill-policy", spec.prefill_policy]
        if spec.decode_policy is not None:
            cmd += ["--decode-policy", spec.decode_policy]
    else:
        cmd += ["--worker-urls", *spec.workers]
    return cmd + list(spec.extra_args)


def blocked_egress_env(base: Mapping[str, str], closed_port: int) -> dict[str, str]:
    """``base`` plus proxy variables that send every non-loopback request to a closed loopback port."""
    proxy = f"http://127.0.0.1:{closed_port}"
    env = dict(base)
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[key] = proxy
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def free_loopback_port() -> int:
    """A port nothing listens on right now (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """A running gateway process. ``start()`` returns once it is ready; ``stop()`` ends it by pid."""

    def __init__(
        self, spec: GatewaySpec, *, log_path: str | Path | None = None, stop_grace_s: float = 10.0
    ) -> None:
        """``stop_grace_s``: how long ``stop()`` waits after SIGTERM before SIGKILL (smg 1.13.0 needs
        about 5 s to exit cleanly)."""
        self.spec = spec
        self.stop_grace_s = stop_grace_s
        self.port = spec.port
        self.process: subprocess.Popen[bytes] | None = None
        self._log_path = Path(log_path) if log_path is not None else None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def start(self, timeout_s: float = 60.0) -> Gateway:
        """Launch and wait until ``/readiness`` answers 200; raises ``RuntimeError`` with the log tail
        if the process exits or is not ready within ``timeout_s`` (it is stopped first)."""
        reason = missing_reason(self.spec.kind)
        if reason is not None:
            raise RuntimeError(reason)
        if self.process is not None:
            raise RuntimeError("gateway already started")
        self.port = self.spec.port or free_loopback_port()
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"crossflow-{self.spec.kind}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        self._log = open(self._log_path, "wb")  # closed in stop()
        env = blocked_egress_env(os.environ, free_loopback_port())
        self.process = subprocess.Popen(
            gateway_command(self.spec, self.port),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                assert self.process is not None
                code = self.process.poll()
                if code is not None:
                    raise RuntimeError(f"{self.spec.kind} exited with status {code}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/readiness").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.spec.kind} not ready at {self.url}/readiness after {timeout_s:g} s:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.05)

    def log_tail(self, n_lines: int = 20) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        lines = self._log_path.read_text("utf-8", "replace").splitlines()
        return "\n".join(lines[-n_lines:])

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the gateway's process, SIGKILL it after ``grace_s`` (default ``stop_grace_s``);
        returns its exit status (negative: the signal that ended it)."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        code: int | None = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=10.0)
            code = self.process.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> Gateway:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m serving.gateways KIND --worker-urls URL ...`` (or ``--prefill URL PORT --decode URL``):
    start a gateway on loopback, print its URL and readiness time, stop it on Ctrl-C (or after
    ``--run-s``) and print how long it took to exit."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m serving.gateways", description=main.__doc__)
    parser.add_argument("kind", choices=list(LAUNCHER_MODULE))
    parser.add_argument("--worker-urls", nargs="*", default=[], help="regular mode")
    parser.add_argument("--prefill", nargs=2, action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"))
    parser.add_argument("--decode", action="append", default=[], metavar="URL")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--run-s", type=float, default=None, help="stop after this many seconds")
    args = parser.parse_args(argv)
    prefill = tuple((url, None if port == "none" else int(port)) for url, port in args.prefill)
    try:
        spec = GatewaySpec(
            args.kind, tuple(args.worker_urls), prefill, tuple(args.decode), args.policy, port=args.port
        )
    except ValueError as exc:
        parser.error(str(exc))
    gateway = Gateway(spec)
    t0 = time.monotonic()
    gateway.start()
    print(
        f"{args.kind} ready at {gateway.url} in {time.monotonic() - t0:.2f} s (pid {gateway.pid})", flush=True
    )
    try:
        time.sleep(args.run_s) if args.run_s is not None else signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        t1 = time.monotonic()
        code = gateway.stop()
        print(f"{args.kind} exited with status {code} in {time.monotonic() - t1:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

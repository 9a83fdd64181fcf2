"""An emulated SGLang PD cluster on loopback: prefill and decode workers that a real gateway accepts.

Every worker of the cluster is an HTTP server on its own loopback port, and all of them share one
``envs.live.LiveCluster``: the simulator's own prefill and decode workers, cost model, caches and
admission rules, advanced in scaled wall time. The HTTP side only translates SGLang's protocol to
and from it (the facts it follows are in ``docs/serving.md``, checked against SGLang 0.5.23):

* **Prefill workers** (``disaggregation_mode: prefill``) run the bootstrap server a decode worker
  calls on their own port (``PUT /route`` registers a rank, ``GET /route`` answers the server info,
  503 until every rank registered, or one rank's endpoint; ``POST /register_dp_rank``, ``POST
  /query_dp_ranks``, ``GET /health``). A request must carry ``bootstrap_room`` (else 400, as SGLang).
  It waits for its decode leg, is prefilled by the simulator once that leg pre-allocated, and is
  answered when its KV transfer is done: one token, ``finish_reason {"type": "length", "length":
  0}``.
* **Decode workers** (``disaggregation_mode: decode``) ask the bootstrap server named by
  ``bootstrap_host`` / ``bootstrap_port`` which prefill worker it is (``GET /route``, cached per
  address as SGLang's decode does), join that worker's leg with the same room, pre-allocate, wait for
  the KV and stream every token, the first included. Legs that do not meet within
  ``bootstrap_timeout_s`` (emulated; SGLang's 300 s) are aborted with status 500. A request with
  ``do_local_prefill: true`` is prefilled on the decode worker itself when its node's lease has room
  (``envs.live.LiveCluster.reserve_borrowed``, paid from the lease token bucket), else refused before
  any token with status 503 so its router can send it on the normal path.
* **Both** serve ``/generate`` (``input_ids`` or ``text``), ``/v1/completions`` and
  ``/v1/chat/completions`` (streamed as server-sent events or not), ``/v1/models``, ``/health``,
  ``/health_generate``, ``/ready``, ``/version``, ``/server_info`` and ``/model_info`` (and their
  ``/get_`` names), ``/v1/loads`` (SGLang's load snapshot, which smg's load monitor polls),
  ``/metrics`` (Prometheus, ``sglang:*`` names plus ``crossflow:*`` lag gauges) and ``/flush_cache``.

The emulated model has no vocabulary and no end of sequence: every request generates exactly its
``max_new_tokens`` (as with ``ignore_eos``), each output token is the text ``" tok"`` (id
``OUTPUT_TOKEN_ID``), and text prompts are cut into token ids of ``CHARS_PER_TOKEN`` UTF-8 bytes each
(so equal text prefixes are equal token prefixes). ``/server_info`` reports ``crossflow_time_scale``
(``crossflow replay`` reads it) and ``crossflow_lag`` (the worker's lag behind its schedule; with
``?crossflow_lag_since=UNIX_S``, over that window only).

    live = LiveCluster(ClusterConfig(n_prefill=1, n_decode=2), time_scale=2.0)
    with BackgroundCluster(EmulatedCluster(live)) as cluster:
        print(cluster.prefill_urls, cluster.decode_urls)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import numpy as np

from envs.cluster_config import ClusterConfig
from envs.live import LiveCluster, LiveRequest, WorkerLoad, lag_check
from policies.routing import CacheAwareConfig, OverloadProtection
from serving.gateways import GatewayKind, GatewaySpec
from serving.http import HttpError, HttpRequest, HttpServer, SseStream, send_json, send_text
from serving.replay import LAG_KEY, LAG_SINCE_PARAM, TIME_SCALE_KEY
from serving.sglang_plugin.wire import (
    INTERNAL_STATE_KEY,
    STARTED_BORROWED_KEY,
    is_lease_update,
    parse_lease_update,
)

Role = Literal["prefill", "decode"]

SGLANG_API_VERSION = "0.5.23"
"""The SGLang release whose HTTP API and PD protocol the workers follow."""
OUTPUT_TOKEN_TEXT = " tok"
OUTPUT_TOKEN_ID = 1000
CHARS_PER_TOKEN = 4

_LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def text_token_ids(text: str, vocab_size: int) -> np.ndarray:
    """Token ids of ``text`` for the emulated model: one id per ``CHARS_PER_TOKEN`` UTF-8 bytes, in
    ``[100, vocab_size)``, so a shared text prefix is a shared token prefix (at least one token)."""
    raw = text.encode("utf-8")
    raw += b"\0" * (-len(raw) % CHARS_PER_TOKEN)
    if not raw:
        return np.array([100], dtype=np.int64)
    words = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    return 100 + words % max(1, vocab_size - 100)


def chat_prompt(messages: Any) -> str:
    """The prompt text of an OpenAI chat request (a ChatML-style rendering of every message)."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "field 'messages' must be a non-empty list")
    parts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise HttpError(400, f"messages[{i}] must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{message['role']}\n{content or ''}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


@dataclass
class Generation:
    """One generation request as the workers read it from any of the three APIs."""

    api: Literal["generate", "completions", "chat"]
    token_ids: np.ndarray
    max_new_tokens: int
    stream: bool
    rid: str
    model: str
    include_usage: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    local_prefill: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def _int_field(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"field {key!r} must be an integer, got {value!r}")
    return value


def _token_array(ids: Any, name: str) -> np.ndarray:
    """A non-empty list of integer token ids as an ``int64`` array; ``HttpError(400)`` otherwise."""
    try:
        arr = np.array(ids) if isinstance(ids, list) else None
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or len(arr) == 0 or arr.dtype.kind not in "iu":
        raise HttpError(400, f"field {name!r} must be a non-empty list of integer token ids")
    return arr.astype(np.int64, copy=False)


def _generate_prompt(body: dict[str, Any], vocab_size: int) -> tuple[np.ndarray, int | None]:
    """``/generate``: ``input_ids`` or ``text``, and ``sampling_params.max_new_tokens`` (SGLang: 128)."""
    ids = body.get("input_ids")
    text = body.get("text")
    if ids is not None:
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            raise HttpError(400, "field 'input_ids': batch requests are not supported by the emulation")
        token_ids = _token_array(ids, "input_ids")
    elif isinstance(text, str):
        token_ids = text_token_ids(text, vocab_size)
    elif isinstance(text, list):
        raise HttpError(400, "field 'text': batch requests are not supported by the emulation")
    else:
        raise HttpError(400, "field 'input_ids' or 'text' is required")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise HttpError(400, "field 'sampling_params' must be an object")
    return token_ids, _int_field(params, "max_new_tokens", 128)


def _completions_prompt(body: dict[str, Any], vocab_size: int) -> tuple[np.ndarray, int | None]:
    """``/v1/completions``: one ``prompt`` (text or token ids), ``max_tokens`` (OpenAI's 16)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        token_ids = text_token_ids(prompt, vocab_size)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        token_ids = _token_array(prompt, "prompt")
    else:
        raise HttpError(400, "field 'prompt' must be a string or a list of token ids (one prompt)")
    return token_ids, _int_field(body, "max_tokens", 16)


def _chat_prompt(body: dict[str, Any], vocab_size: int) -> tuple[np.ndarray, int | None]:
    """``/v1/chat/completions``: ``messages``, ``max_completion_tokens`` or ``max_tokens`` (without
    either the emulated model, which has no end of sequence, stops at SGLang's native 128)."""
    token_ids = text_token_ids(chat_prompt(body.get("messages")), vocab_size)
    max_new = _int_field(body, "max_completion_tokens", None)
    return token_ids, max_new if max_new is not None else _int_field(body, "max_tokens", 128)


_PROMPT_READERS = {"generate": _generate_prompt, "completions": _completions_prompt, "chat": _chat_prompt}


def parse_generation(api: str, body: Any, model: str, vocab_size: int) -> Generation:
    """Read a ``/generate``, ``/v1/completions`` or ``/v1/chat/completions`` body; ``HttpError(400)``
    naming the field when it is not one this emulation serves (batches are not)."""
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    token_ids, max_new = _PROMPT_READERS[api](body, vocab_size)
    if max_new is None or max_new < 1:
        raise HttpError(400, f"the emulation generates at least one token; got max_new_tokens={max_new}")
    options = body.get("stream_options") or {}
    room = body.get("bootstrap_room")
    if isinstance(room, list):
        raise HttpError(400, "field 'bootstrap_room': batch requests are not supported by the emulation")
    port = body.get("bootstrap_port")
    return Generation(
        api=api,  # type: ignore[arg-type]
        token_ids=token_ids,
        max_new_tokens=max_new,
        stream=bool(body.get("stream", False)),
        rid=str(body.get("rid") or uuid.uuid4().hex),
        model=str(body.get("model") or model),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        bootstrap_host=body.get("bootstrap_host"),
        bootstrap_port=int(port) if isinstance(port, int | str) and str(port).isdigit() else None,
        bootstrap_room=int(room) if isinstance(room, int) and not isinstance(room, bool) else None,
        local_prefill=bool(body.get("do_local_prefill", False)),
    )


class _Abort(Exception):
    """End the request before (or instead of) its tokens with SGLang's abort: ``status`` and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ------------------------------------------------------------------------------------------------ output
def _finish_reason(gen: Generation, tokens: int, final: bool, prefill_leg: bool) -> Any:
    if not final:
        return None
    length = 0 if prefill_leg else gen.max_new_tokens
    if gen.api == "generate":
        return {"type": "length", "length": length}
    return "length"


def _usage(gen: Generation, tokens: int, cached: int) -> dict[str, Any]:
    n_in = len(gen.token_ids)
    return {
        "prompt_tokens": n_in,
        "completion_tokens": tokens,
        "total_tokens": n_in + tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def render_event(
    gen: Generation, tokens: int, sent: int, cached: int, final: bool, *, prefill_leg: bool, incremental: bool
) -> dict[str, Any]:
    """One streamed event holding tokens ``sent+1 .. tokens`` (``/generate``: SGLang's cumulative text
    and ids unless ``incremental``; OpenAI routes: the new text as a delta)."""
    reason = _finish_reason(gen, tokens, final, prefill_leg)
    if gen.api == "generate":
        shown = tokens - sent if incremental else tokens
        return {
            "text": OUTPUT_TOKEN_TEXT * shown,
            "output_ids": [OUTPUT_TOKEN_ID] * shown,
            "meta_info": {
                "id": gen.rid,
                "finish_reason": reason,
                "prompt_tokens": len(gen.token_ids),
                "completion_tokens": tokens,
                "cached_tokens": cached,
            },
        }
    text = OUTPUT_TOKEN_TEXT * (tokens - sent)
    if gen.api == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    else:
        delta: dict[str, Any] = {"content": text}
        if sent == 0:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    return {"id": gen.rid, "object": kind, "created": gen.created, "model": gen.model, "choices": [choice]}


def render_full(gen: Generation, tokens: int, cached: int, *, prefill_leg: bool) -> dict[str, Any]:
    """The non-streamed answer of a finished request."""
    if gen.api == "generate":
        return render_event(gen, tokens, 0, cached, True, prefill_leg=prefill_leg, incremental=False)
    reason = _finish_reason(gen, tokens, True, prefill_leg)
    text = OUTPUT_TOKEN_TEXT * tokens
    if gen.api == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    else:
        message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion"
    return {
        "id": gen.rid,
        "object": kind,
        "created": gen.created,
        "model": gen.model,
        "choices": [choice],
        "usage": _usage(gen, tokens, cached),
    }


def render_abort(gen: Generation, status: int, message: str) -> dict[str, Any]:
    """SGLang's in-stream abort (``/generate``) or error event (OpenAI routes)."""
    if gen.api == "generate":
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "id": gen.rid,
                "finish_reason": {
                    "type": "abort",
                    "message": message,
                    "status_code": status,
                    "err_type": None,
                },
                "prompt_tokens": len(gen.token_ids),
                "completion_tokens": 0,
            },
        }
    return {"error": {"object": "error", "message": message, "type": "abort", "param": None, "code": status}}


# ------------------------------------------------------------------------------------------------ bootstrap
class BootstrapServer:
    """SGLang's prefill bootstrap server (``disaggregation/common/conn.py``), on its own port: prefill
    ranks register with ``PUT /route``; a decode worker reads the server info (``GET /route`` with
    every rank -1: 503 until all ``expected_ranks`` registered) or one rank's endpoint."""

    _REQUIRED = (
        "attn_tp_size",
        "attn_tp_rank",
        "attn_cp_size",
        "attn_cp_rank",
        "attn_dp_size",
        "attn_dp_rank",
        "pp_size",
        "pp_rank",
        "system_dp_size",
        "system_dp_rank",
        "rank_ip",
        "rank_port",
        "page_size",
        "kv_cache_dtype",
    )

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.http = HttpServer(self._route, host, port)
        self.info: dict[str, Any] = {}
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.room_to_dp_rank: dict[int, int] = {}

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def expected_ranks(self) -> int:
        if not self.info:
            return 1
        return int(
            self.info["dp_size"]
            * self.info["attn_cp_size"]
            * self.info["attn_tp_size"]
            * self.info["pp_size"]
        )

    @property
    def ready(self) -> bool:
        return bool(self.info) and len(self.ranks) >= self.expected_ranks

    async def _route(self, request: HttpRequest, writer: asyncio.StreamWriter) -> None:
        path, method = request.path, request.method
        if path == "/health" and method == "GET":
            await send_text(writer, 200, "OK")
        elif path == "/route" and method == "PUT":
            await self._register(request.json(), writer)
        elif path == "/route" and method == "GET":
            await self._lookup(request.query, writer)
        elif path == "/route":
            await send_text(writer, 405, "Method not allowed")
        elif path == "/register_dp_rank" and method == "POST":
            data = request.json()
            try:
                self.room_to_dp_rank[int(data["bootstrap_room"])] = int(data["dp_rank"])
            except (KeyError, TypeError, ValueError) as exc:
                raise HttpError(400, f"register_dp_rank needs bootstrap_room and dp_rank: {exc}") from None
            await send_text(writer, 200, "OK")
        elif path == "/query_dp_ranks" and method == "POST":
            rooms = request.json().get("bootstrap_rooms")
            if not isinstance(rooms, list):
                raise HttpError(400, "query_dp_ranks needs a list 'bootstrap_rooms'")
            found = {
                str(int(r)): self.room_to_dp_rank[int(r)] for r in rooms if int(r) in self.room_to_dp_rank
            }
            await send_json(writer, 200, found)
        else:
            await send_text(writer, 404, "Not Found")

    async def _register(self, data: Any, writer: asyncio.StreamWriter) -> None:
        missing = [k for k in self._REQUIRED if not isinstance(data, dict) or k not in data]
        if missing:
            raise HttpError(400, f"PUT /route: missing field(s) {', '.join(missing)}")
        if not self.info:
            system_dp = int(data["system_dp_size"])
            self.info = {
                "attn_tp_size": int(data["attn_tp_size"]),
                "attn_cp_size": int(data["attn_cp_size"]),
                "dp_size": int(data["attn_dp_size"]) if system_dp == 1 else system_dp,
                "pp_size": int(data["pp_size"]),
                "page_size": int(data["page_size"]),
                "kv_cache_dtype": data["kv_cache_dtype"],
                "follow_bootstrap_room": data.get("load_balance_method", "follow_bootstrap_room")
                == "follow_bootstrap_room",
                "enable_dsa_cache_layer_split": False,
                "enable_kv_cache_sharding": False,
                "prefill_http_port": data.get("prefill_http_port"),
                "decode_allocation_policy": data.get("decode_allocation_policy", "early"),
            }
        dp_group = (
            int(data["attn_dp_rank"]) if int(data["system_dp_size"]) == 1 else int(data["system_dp_rank"])
        )
        key = (dp_group, int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
        self.ranks[key] = {"rank_ip": str(data["rank_ip"]), "rank_port": int(data["rank_port"])}
        await send_text(writer, 200, "OK")

    async def _lookup(self, query: dict[str, str], writer: asyncio.StreamWriter) -> None:
        names = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(query.get(n) for n in names):
            await send_text(writer, 400, "Missing inputs for bootstrap server.")
            return
        try:
            key = tuple(int(query[n]) for n in names)
        except ValueError:
            await send_text(writer, 400, "Missing inputs for bootstrap server.")
            return
        if not self.ready:
            await send_text(
                writer,
                503,
                f"Prefill server not fully registered yet ({len(self.ranks)} workers registered).",
            )
        elif key == (-1, -1, -1, -1):
            await send_json(writer, 200, self.info)
        elif key in self.ranks:
            await send_json(writer, 200, self.ranks[key])
        else:
            await send_text(
                writer,
                404,
                "Bootstrap info not found for dp_rank={}, cp_rank={} tp_rank={} pp_rank={}".format(*key),
            )


# ------------------------------------------------------------------------------------------------ rooms
@dataclass
class _Room:
    """The two legs of one ``bootstrap_room`` on one prefill worker, until they meet."""

    prefill: tuple[int, Generation] | None = None
    decode: tuple[int, Generation] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    live: LiveRequest | None = None
    error: tuple[int, str] | None = None


# ------------------------------------------------------------------------------------------------ workers
class PDWorker:
    """One emulated SGLang worker of an :class:`EmulatedCluster` (a role, an index, an HTTP port)."""

    def __init__(
        self, cluster: EmulatedCluster, role: Role, idx: int, port: int, bootstrap_port: int | None
    ) -> None:
        self.cluster = cluster
        self.role: Role = role
        self.idx = idx
        # keep-alive as SGLang's uvicorn: a gateway's pooled connections are reused (a stream still
        # ends its connection)
        self.http = HttpServer(self._route, cluster.host, port, keep_alive=True)
        self.bootstrap = BootstrapServer(cluster.host, bootstrap_port or 0) if role == "prefill" else None
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.aborted_total = 0
        self._throughput_mark: tuple[float, int] = (0.0, 0)
        self.gen_throughput = 0.0
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        """The generation handlers running, by request id (``/abort_request`` cancels them)."""
        self._borrowed: dict[str, LiveRequest] = {}
        """The borrowed requests this decode worker holds, by request id (those whose prefill has
        begun are reported in ``/server_info``, as the plugin reports them)."""

    @property
    def name(self) -> str:
        return f"{self.role} {self.idx}"

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def bootstrap_port(self) -> int | None:
        return self.bootstrap.port if self.bootstrap is not None else None

    async def start(self) -> None:
        await self.http.start()
        if self.bootstrap is not None:
            await self.bootstrap.http.start()
            await self._register_ranks()

    async def stop(self) -> None:
        await self.http.stop()
        if self.bootstrap is not None:
            await self.bootstrap.http.stop()

    async def _register_ranks(self) -> None:
        """Register this prefill worker's ranks with its bootstrap server over HTTP, as SGLang's
        prefill ranks do at start (each rank's KV endpoint is this worker's own port here)."""
        assert self.bootstrap is not None
        cm = self.cluster.live.cm
        for rank in range(cm.tp):
            payload = {
                "attn_tp_size": cm.tp, "attn_tp_rank": rank, "attn_cp_size": 1, "attn_cp_rank": 0,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
                "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": self.cluster.host,
                "rank_port": self.http.port, "page_size": self.cluster.live.config.page_tokens,
                "kv_cache_dtype": cm.model.kv_precision, "prefill_http_port": self.http.port,
            }  # fmt: skip
            resp = await self.cluster.client.put(f"{self.bootstrap.http.url}/route", json=payload)
            resp.raise_for_status()

    # ---------------------------------------------------------------- routing
    async def _route(self, request: HttpRequest, writer: asyncio.StreamWriter) -> None:
        path, method = request.path, request.method
        if method == "POST" and path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            api = {"/generate": "generate", "/v1/completions": "completions"}.get(path, "chat")
            await self._generate(api, request, writer)
            return
        if method == "GET":
            answer = self._get(path, request.query)
            if answer is not None:
                status, payload = answer
                if isinstance(payload, str):
                    await send_text(writer, status, payload, "text/plain; version=0.0.4; charset=utf-8")
                else:
                    await send_json(writer, status, payload)
                return
        if path == "/abort_request" and method == "POST":
            await self._abort_request(request.json(), writer)
            return
        if path == "/set_internal_state" and method == "POST":
            await send_json(writer, 200, self._set_internal_state(request.json()))
            return
        if path == "/flush_cache" and method in ("POST", "GET"):
            if self.cluster.live.flush_cache(self.role, self.idx):
                await send_text(writer, 200, "Cache flushed.\n")
            else:
                await send_text(writer, 400, "Cache not flushed: the worker has requests in flight.\n")
            return
        await send_json(writer, 404, {"error": {"message": f"no route {method} {path}", "code": 404}})

    def _get(self, path: str, query: dict[str, str]) -> tuple[int, Any] | None:
        if path in ("/health", "/ready"):
            return 200, {}
        if path == "/health_generate":
            ok = self.cluster.running
            return (
                (200, {})
                if ok
                else (503, {"error": {"message": "the emulation is not running", "code": 503}})
            )
        if path == "/version":
            return 200, {"version": SGLANG_API_VERSION}
        if path in ("/server_info", "/get_server_info"):
            since = query.get(LAG_SINCE_PARAM)
            try:
                since_s = float(since) if since is not None else None
            except ValueError:
                return 400, {"error": {"message": f"{LAG_SINCE_PARAM} must be a Unix time", "code": 400}}
            return 200, self.server_info(since_s)
        if path in ("/model_info", "/get_model_info"):
            return 200, self.cluster.model_info()
        if path == "/v1/models":
            return 200, self.cluster.models()
        if path == "/v1/loads":
            return self._loads(query)
        if path == "/metrics":
            return 200, self.metrics_text()
        return None

    async def _abort_request(self, body: Any, writer: asyncio.StreamWriter) -> None:
        """SGLang's ``POST /abort_request`` (``{"rid": ..., "abort_all": false}``): the named request's
        leg stops now (a leg still waiting for its partner leaves its room; a request already in the
        simulator keeps running there, unobserved, as a real worker's would until its next
        scheduler step)."""
        if not isinstance(body, dict):
            raise HttpError(400, "request body must be a JSON object")
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not isinstance(rid, str):
            raise HttpError(400, "field 'rid' must be a string (or abort_all true)")
        tasks = list(self._tasks.values()) if abort_all else [t for t in [self._tasks.get(str(rid))] if t]
        for task in tasks:
            task.cancel()
        await send_json(writer, 200, {"aborted": len(tasks)})

    def _set_internal_state(self, body: Any) -> list[bool]:
        """SGLang's ``POST /set_internal_state`` as the Crossflow plugin answers a lease update
        (``wire.lease_update_body``): a decode worker whose cluster takes wire leases installs it
        (``LiveCluster.install_lease``); ``HttpError(400)`` naming what is wrong otherwise."""
        args = body.get("server_args") if isinstance(body, dict) else None
        if not isinstance(args, dict):
            raise HttpError(400, "field 'server_args' must be an object")
        if not is_lease_update(args):
            raise HttpError(
                400, "field 'server_args': this emulated worker takes only crossflow_lease_* updates"
            )
        if self.role != "decode" or not self.cluster.live.takes_wire_leases():
            raise HttpError(
                400, "lease update refused: this worker's leases do not come over the wire (a prefill "
                "worker, or a cluster whose decode nodes run their own scheduler)"
            )  # fmt: skip
        try:
            update = parse_lease_update(args)
        except ValueError as exc:
            raise HttpError(400, f"field 'server_args': {exc}") from None
        self.cluster.live.install_lease(
            self.idx,
            update.budgets,
            update.ttl_s,
            chunk_limits=update.chunk_limits,
            pressure_rule=update.pressure_rule,
        )
        return [True]  # SGLang's answer: one boolean per data-parallel rank

    # ---------------------------------------------------------------- reports
    def load(self) -> WorkerLoad:
        return self.cluster.live.load(self.role, self.idx)

    def server_info(self, lag_since_unix_s: float | None = None) -> dict[str, Any]:
        """SGLang's ``/server_info`` keys that describe this worker, plus the emulation's own."""
        c = self.cluster
        cfg, cm = c.live.config, c.live.cm
        info: dict[str, Any] = {
            "model_path": cm.model.name,
            "served_model_name": c.served_model_name,
            "tokenizer_path": cm.model.name,
            "tp_size": cm.tp,
            "dp_size": 1,
            "pp_size": 1,
            "page_size": cfg.page_tokens,
            "chunked_prefill_size": cfg.prefill_chunk_tokens,
            "max_running_requests": cfg.max_running_requests,
            "max_total_num_tokens": cm.kv_capacity_tokens,
            "context_length": cfg.context_window_tokens,
            "num_reserved_decode_tokens": cfg.num_reserved_decode_tokens,
            "disaggregation_mode": self.role,
            "disaggregation_transfer_backend": "crossflow-emulated",
            "disaggregation_decode_enable_radix_cache": cfg.decode_prefix_cache,
            "stream_interval": c.live.stream_interval,
            "incremental_streaming_output": c.incremental_streaming_output,
            "host": c.host,
            "port": self.http.port,
            "version": SGLANG_API_VERSION,
            TIME_SCALE_KEY: c.live.time_scale,
            "crossflow_worker": {
                "role": self.role,
                "index": self.idx,
                "gpu": cm.gpu.name,
                "model": cm.model.name,
            },
            LAG_KEY: c.live.lag_report(self.role, self.idx, lag_since_unix_s),
            "internal_states": [{"last_gen_throughput": self.gen_throughput}],
        }
        if self.role == "decode":  # what the Crossflow plugin adds on a real decode worker (wire.py)
            state = c.live.node_state(self.idx)
            plugin: dict[str, Any] = {"node_state": state.to_dict()}
            if c.live.takes_wire_leases():  # as the plugin, which installs pushed leases
                lease = c.live.sim.scheduler.ledger.lease(self.idx)  # type: ignore[union-attr]
                plugin["lease"] = None if lease is None else lease.to_dict()
            plugin[STARTED_BORROWED_KEY] = sorted(
                rid for rid, live in self._borrowed.items() if c.live.prefill_started(live)
            )
            info["internal_states"][0][INTERNAL_STATE_KEY] = plugin
        if self.bootstrap is not None:
            info["disaggregation_bootstrap_port"] = self.bootstrap.port
        return info

    def _loads(self, query: dict[str, str]) -> tuple[int, Any]:
        include = {s.strip() for s in query["include"].split(",")} if query.get("include") else None
        if include is not None and not include <= _LOAD_SECTIONS:
            bad = include - _LOAD_SECTIONS
            return 400, {
                "detail": f"Invalid include sections: {bad}. Valid options: {sorted(_LOAD_SECTIONS)}"
            }
        snapshot = self.load_snapshot(include)
        if query.get("format") == "prometheus":
            return 200, _prometheus_loads(snapshot)
        cm = self.cluster.live.cm
        return 200, {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": SGLANG_API_VERSION,
            "accelerator": cm.gpu.name,
            "num_accelerators": cm.tp,
            "loads": [snapshot],
        }

    def load_snapshot(self, include: set[str] | None = None) -> dict[str, Any]:
        """SGLang's per-rank ``LoadSnapshot.to_dict`` (``srt/managers/load_snapshot.py``) of this worker."""
        load = self.load()
        live = self.cluster.live
        now = live.now_s()
        mark_s, mark_tokens = self._throughput_mark
        if now - mark_s > 1e-9:
            self.gen_throughput = (load.generated_tokens_total - mark_tokens) / (now - mark_s)
            self._throughput_mark = (now, load.generated_tokens_total)
        busy = load.busy_s / now if now > 0 else 0.0
        snap: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting_requests,
            "num_waiting_uncached_tokens": load.uncached_waiting_tokens,
            "num_used_tokens": load.used_tokens,
            "num_total_tokens": load.used_tokens + load.pending_tokens,
            "num_active_tokens": max(0, load.used_tokens + load.pending_tokens - load.awaiting_kv_tokens),
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": load.capacity_tokens,
            "max_running_requests": live.config.max_running_requests,
            "token_usage": round(load.token_usage, 4),
            "gen_throughput": round(self.gen_throughput, 2),
            "cache_hit_rate": 0.0,
            "utilization": round(min(1.0, busy), 4),
            "total_prefill_uncached_tokens": load.prefill_tokens_total,
            "total_prefill_busy_us": int(load.busy_s * 1e6) if self.role == "prefill" else 0,
            "decode_moments": None,
        }
        everything = include is None or "all" in include
        if include == {"core"}:
            return snap
        cm = live.cm
        sections = {
            "memory": {
                "weight_gb": 0.0,
                "kv_cache_gb": round(cm.kv_capacity_tokens * cm.kv_bytes_per_token / 1e9, 3),
                "graph_gb": 0.0,
                "token_capacity": cm.kv_capacity_tokens,
            },
            "disaggregation": {
                "mode": self.role,
                "prefill_bootstrap_queue_reqs": load.bootstrap,
                "prefill_inflight_queue_reqs": load.inflight,
                "decode_prealloc_queue_reqs": load.prealloc,
                "decode_transfer_queue_reqs": load.transfer,
                "decode_retracted_queue_reqs": load.retracted,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {
                "waiting": load.waiting,
                "grammar": 0,
                "paused": 0,
                "retracted": load.retracted,
                "prealloc_ready": 0,
            },
        }
        names = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}
        for key, section in sections.items():
            if everything or (include is not None and names[key] in include):
                snap[key] = section
        return snap

    def metrics_text(self) -> str:
        """Prometheus exposition: SGLang's scheduler and tokenizer metric names (``sglang:``) for what
        the emulation knows, and the emulation's clock and lag (``crossflow:``)."""
        load = self.load()
        c = self.cluster
        labels = f'model_name="{c.served_model_name}",engine_type="{self.role}",'
        labels += 'tp_rank="0",pp_rank="0",moe_ep_rank="0"'
        lag = c.live.lag_report(self.role, self.idx)
        gauges = [
            ("sglang:num_running_reqs", "The number of running requests.", load.running),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", load.waiting),
            ("sglang:num_used_tokens", "The number of used tokens.", load.used_tokens),
            ("sglang:token_usage", "The token usage.", round(load.token_usage, 6)),
            ("sglang:gen_throughput", "The generation throughput (token/s).", round(self.gen_throughput, 3)),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.", 0.0),
            (
                "sglang:decode_sum_seq_lens",
                "Sum of the running batch's sequence lengths.",
                load.context_tokens,
            ),
            ("sglang:num_retracted_reqs", "The number of retracted requests.", load.retracted),
            (
                "sglang:num_prefill_bootstrap_queue_reqs",
                "Requests in the prefill bootstrap queue.",
                load.bootstrap,
            ),
            (
                "sglang:num_prefill_inflight_queue_reqs",
                "Requests in the prefill inflight queue.",
                load.inflight,
            ),
            (
                "sglang:num_decode_prealloc_queue_reqs",
                "Requests in the decode prealloc queue.",
                load.prealloc,
            ),
            (
                "sglang:num_decode_transfer_queue_reqs",
                "Requests in the decode transfer queue.",
                load.transfer,
            ),
            ("sglang:max_total_num_tokens", "Maximum total number of tokens.", load.capacity_tokens),
            ("sglang:page_size", "KV page size in tokens.", c.live.config.page_tokens),
            ("sglang:context_len", "The model's context length.", c.live.config.context_window_tokens),
            ("crossflow:time_scale", "Wall seconds per emulated second.", c.live.time_scale),
            (
                "crossflow:emulated_time_seconds",
                "Emulated seconds since the cluster started.",
                round(c.live.now_s(), 6),
            ),
            (
                "crossflow:lag_max_seconds",
                "Largest lag of an iteration behind its schedule (wall s).",
                lag["max_s"],
            ),
            (
                "crossflow:lag_mean_seconds",
                "Mean lag of an iteration behind its schedule (wall s).",
                lag["mean_s"],
            ),
        ]
        counters = [
            ("sglang:num_requests_total", "Number of requests processed.", self.requests_total),
            ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", self.prompt_tokens_total),
            (
                "sglang:generation_tokens_total",
                "Number of generation tokens processed.",
                self.generation_tokens_total,
            ),
            ("sglang:cached_tokens_total", "Number of cached prompt tokens.", self.cached_tokens_total),
            ("sglang:num_aborted_requests_total", "Number of requests aborted.", self.aborted_total),
        ]
        lines: list[str] = []
        for kind, rows in (("gauge", gauges), ("counter", counters)):
            for name, doc, value in rows:
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
        return "\n".join(lines) + "\n"

    # ---------------------------------------------------------------- generation
    async def _generate(self, api: str, request: HttpRequest, writer: asyncio.StreamWriter) -> None:
        live = self.cluster.live
        cfg = live.config
        try:
            gen = parse_generation(api, request.json(), self.cluster.served_model_name, live.cm.model.vocab)
        except HttpError as exc:
            await send_json(writer, exc.status, {"error": {"message": exc.message, "code": exc.status}})
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks[gen.rid] = task
        try:
            await self._run_generation(gen, writer, cfg)
        finally:
            if self._tasks.get(gen.rid) is task:
                del self._tasks[gen.rid]

    async def _run_generation(
        self, gen: Generation, writer: asyncio.StreamWriter, cfg: ClusterConfig
    ) -> None:
        live = self.cluster.live
        stream = SseStream(writer) if gen.stream else None
        if stream is not None:
            await stream.start()
        self.requests_total += 1
        self.prompt_tokens_total += len(gen.token_ids)
        try:
            problem = live.context_error(len(gen.token_ids), gen.max_new_tokens)
            if problem is not None:
                raise HttpError(400, problem)
            if self.role == "prefill" and gen.local_prefill:
                raise HttpError(400, "do_local_prefill is for decode workers")
            if gen.bootstrap_room is None and not (self.role == "decode" and gen.local_prefill):
                raise HttpError(
                    400,
                    f"Invalid request: Disaggregated request received without bootstrap room id. {gen.rid=}",
                )
            if self.role == "prefill":
                await self._prefill_leg(gen, stream, writer)
            else:
                await self._decode_leg(gen, stream, writer, cfg)
        except HttpError as exc:  # SGLang: a ValueError before generation starts
            self.aborted_total += 1
            if stream is not None:
                await stream.send(
                    {"error": {"message": exc.message, "type": "BadRequest", "code": exc.status}}
                )
                await stream.done()
            else:
                await send_json(writer, exc.status, {"error": {"message": exc.message, "code": exc.status}})
        except _Abort as exc:
            self.aborted_total += 1
            if stream is not None:
                await stream.send(render_abort(gen, exc.status, exc.message))
                await stream.done()
            else:
                await send_json(writer, exc.status, {"error": {"message": exc.message, "code": exc.status}})

    async def _prefill_leg(
        self, gen: Generation, stream: SseStream | None, writer: asyncio.StreamWriter
    ) -> None:
        assert gen.bootstrap_room is not None
        live = await self.cluster.meet(self.idx, gen.bootstrap_room, "prefill", gen, self.idx)
        await live.kv_landed.wait()
        if live.error is not None and not live.finished:
            raise _Abort(*live.error)
        self.cached_tokens_total += live.cached_tokens
        self.generation_tokens_total += 1
        if stream is not None:
            await stream.send(
                render_event(gen, 1, 0, live.cached_tokens, True, prefill_leg=True, incremental=True)
            )
            await stream.done()
        else:
            await send_json(writer, 200, render_full(gen, 1, live.cached_tokens, prefill_leg=True))

    async def _decode_leg(
        self, gen: Generation, stream: SseStream | None, writer: asyncio.StreamWriter, cfg: ClusterConfig
    ) -> None:
        c = self.cluster
        if gen.local_prefill:
            reservation = c.live.reserve_borrowed(self.idx, len(gen.token_ids), gen.max_new_tokens)
            if reservation is None:
                raise _Abort(503, "no lease on this decode node can take the request's prefill now")
            live = c.live.submit_borrowed(
                gen.token_ids, gen.max_new_tokens, decode_worker=self.idx, reservation_id=reservation
            )
            self._borrowed[gen.rid] = live
        else:
            assert gen.bootstrap_room is not None
            pidx = await c.resolve_bootstrap(gen.bootstrap_host, gen.bootstrap_port)
            live = await c.meet(pidx, gen.bootstrap_room, "decode", gen, self.idx)
        sent = 0
        try:
            while True:
                await live.changed()
                if live.error is not None:
                    if sent == 0:
                        raise _Abort(*live.error)
                    break
                tokens = live.generated
                final = live.finished
                if stream is not None and tokens > sent:
                    event = render_event(
                        gen, tokens, sent, live.cached_tokens, final, prefill_leg=False,
                        incremental=c.incremental_streaming_output,
                    )  # fmt: skip
                    await stream.send(event)
                    sent = tokens
                if final:
                    break
        finally:
            if self._borrowed.get(gen.rid) is live:
                del self._borrowed[gen.rid]
        self.generation_tokens_total += live.generated
        self.cached_tokens_total += live.cached_tokens
        if stream is not None:
            if gen.include_usage and gen.api != "generate":
                kind = "chat.completion.chunk" if gen.api == "chat" else "text_completion"
                usage: dict[str, Any] = {
                    "id": gen.rid, "object": kind, "created": gen.created, "model": gen.model, "choices": [],
                    "usage": _usage(gen, live.generated, live.cached_tokens),
                }  # fmt: skip
                await stream.send(usage)
            await stream.done()
        else:
            await send_json(
                writer, 200, render_full(gen, live.generated, live.cached_tokens, prefill_leg=False)
            )


def _prometheus_loads(snapshot: dict[str, Any]) -> str:
    """``/v1/loads?format=prometheus`` (``srt/entrypoints/v1_loads.py``: ``sglang_<key>`` gauges)."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    lines: list[str] = []
    for key, value in snapshot.items():
        if key == "dp_rank":
            continue
        items: Iterable[tuple[str, Any]] = (
            ((f"{prefixes.get(key, key)}_{k}", v) for k, v in value.items())
            if isinstance(value, dict)
            else [(key, value)]
        )
        for name, v in items:
            if isinstance(v, int | float) and not isinstance(v, bool):
                lines += [f"# TYPE sglang_{name} gauge", f'sglang_{name}{{dp_rank="0"}} {v}']
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ cluster
def gateway_timer_args(kind: str, time_scale: float) -> tuple[str, ...]:
    """Gateway flags that stretch its periodic timers by ``time_scale``, so that in the emulated
    cluster's time they fire as often as on a real one: smg's load monitor (whose polls feed its
    overload protection and load-aware policies) and both gateways' cache-tree eviction. Their
    defaults are the ones ``policies.routing`` models; the flags take whole seconds, so the stretch is
    rounded."""
    monitor_s = max(1, round(OverloadProtection().load_monitor_interval_s * time_scale))
    eviction_s = max(1, round(CacheAwareConfig().eviction_interval_s * time_scale))
    args: tuple[str, ...] = ("--eviction-interval-secs", str(eviction_s))
    if kind == "smg":
        args += ("--load-monitor-interval", str(monitor_s))
    return args


class EmulatedCluster:
    """The HTTP workers of one emulated PD cluster around the ``LiveCluster`` they share (one loop).

    Args:
        live: the cluster's simulator in scaled wall time (shape, cost model, leases, time scale).
        host: every server binds it (loopback by default).
        port: 0 = free ports; else prefill workers listen on ``port, port+1, ...``, then the decode
            workers, then the prefill workers' bootstrap servers.
        incremental_streaming_output: ``/generate`` streams only each event's new tokens (SGLang
            ``--incremental-streaming-output``); by default every event holds the output so far.
        bootstrap_timeout_s: emulated seconds a leg waits for its partner (SGLang's 300 s).
        served_model_name: the model name the workers report (default: the model's).
    """

    def __init__(
        self,
        live: LiveCluster,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        incremental_streaming_output: bool = False,
        bootstrap_timeout_s: float = 300.0,
        served_model_name: str | None = None,
    ) -> None:
        if not bootstrap_timeout_s > 0:
            raise ValueError(f"bootstrap_timeout_s must be > 0, got {bootstrap_timeout_s}")
        self.live = live
        config = live.config
        self.host = host
        self.incremental_streaming_output = incremental_streaming_output
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.served_model_name = served_model_name or self.live.cm.model.name
        n_p, n_d = config.n_prefill, config.n_decode
        ports = (lambda k: 0) if port == 0 else (lambda k: port + k)
        self.prefill = [PDWorker(self, "prefill", i, ports(i), ports(n_p + n_d + i)) for i in range(n_p)]
        self.decode = [PDWorker(self, "decode", j, ports(n_p + j), None) for j in range(n_d)]
        self._rooms: dict[tuple[int, int], _Room] = {}
        self._bootstrap_cache: dict[tuple[str, int], asyncio.Future[int]] = {}
        self._driver: asyncio.Task[None] | None = None
        self.client: httpx.AsyncClient
        self.started_unix_s: float | None = None

    @property
    def workers(self) -> list[PDWorker]:
        return [*self.prefill, *self.decode]

    @property
    def prefill_urls(self) -> list[str]:
        return [w.url for w in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [w.url for w in self.decode]

    @property
    def running(self) -> bool:
        return self._driver is not None and not self._driver.done()

    async def start(self) -> None:
        self.client = httpx.AsyncClient(trust_env=False, timeout=10.0)
        self._driver = asyncio.create_task(self.live.run())
        await asyncio.sleep(0)
        self.started_unix_s = time.time()
        try:
            for w in self.workers:
                await w.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for w in self.workers:
            await w.stop()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        await self.client.aclose()

    def gateway_spec(self, kind: GatewayKind = "smg", **fields: Any) -> GatewaySpec:
        """A real gateway in PD mode over these workers (each prefill worker with its bootstrap port),
        its timers stretched by the time scale (``gateway_timer_args``); ``fields`` go to
        ``GatewaySpec`` (``policy``, ``port``, ``extra_args`` appended after the timer flags)."""
        extra = gateway_timer_args(kind, self.live.time_scale) + tuple(fields.pop("extra_args", ()))
        prefill = tuple((w.url, w.bootstrap_port) for w in self.prefill)
        return GatewaySpec(kind, prefill=prefill, decode=tuple(self.decode_urls), extra_args=extra, **fields)

    def model_info(self) -> dict[str, Any]:
        name = self.live.cm.model.name
        return {
            "model_path": name,
            "tokenizer_path": name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
        }

    def models(self) -> dict[str, Any]:
        created = int(self.started_unix_s or time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "sglang",
                    "root": self.live.cm.model.name,
                    "max_model_len": self.live.config.context_window_tokens,
                }
            ],
        }

    async def resolve_bootstrap(self, host: str | None, port: int | None) -> int:
        """The prefill worker whose bootstrap server is at ``host:port``, asked over HTTP once per
        address (SGLang's decode caches the prefill server info the same way)."""
        if not host or port is None:
            raise _Abort(
                400, "a decode request needs bootstrap_host and bootstrap_port (send it through a PD router)"
            )
        key = (host, port)
        future = self._bootstrap_cache.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._bootstrap_cache[key] = future
            try:
                future.set_result(await self._ask_bootstrap(host, port))
            except _Abort as exc:
                del self._bootstrap_cache[key]
                future.set_exception(exc)
                future.exception()  # retrieved: later callers ask again
                raise
        return await asyncio.shield(future)

    async def _ask_bootstrap(self, host: str, port: int) -> int:
        base = f"http://{host}:{port}/route"
        try:
            resp = await self.client.get(
                base,
                params={
                    "prefill_dp_rank": -1,
                    "prefill_cp_rank": -1,
                    "target_tp_rank": -1,
                    "target_pp_rank": -1,
                },
            )
        except httpx.HTTPError as exc:
            raise _Abort(500, f"Failed to get prefill server info from {host}:{port}: {exc}") from None
        if resp.status_code != 200:
            raise _Abort(
                500, f"Failed to get prefill server info from {host}:{port}: {resp.status_code} {resp.text}"
            )
        http_port = resp.json().get("prefill_http_port")
        for w in self.prefill:
            if w.http.port == http_port and host in (self.host, "localhost"):
                return w.idx
        raise _Abort(
            500, f"the bootstrap server at {host}:{port} is not a prefill worker of this emulated cluster"
        )

    async def meet(
        self, pidx: int, room: int, leg: Literal["prefill", "decode"], gen: Generation, worker: int
    ) -> LiveRequest:
        """Join the two legs of ``room`` on prefill worker ``pidx``: the first waits for the second (at
        most ``bootstrap_timeout_s`` emulated), which submits the request; both get it."""
        key = (pidx, room)
        entry = self._rooms.get(key)
        if entry is None:
            entry = self._rooms[key] = _Room()
        if getattr(entry, leg) is not None:
            raise _Abort(400, f"bootstrap room {room} already has a {leg} leg on prefill worker {pidx}")
        setattr(entry, leg, (worker, gen))
        if entry.prefill is not None and entry.decode is not None:
            del self._rooms[key]
            (p_idx, p_gen), (d_idx, d_gen) = entry.prefill, entry.decode
            if len(p_gen.token_ids) != len(d_gen.token_ids) or p_gen.max_new_tokens != d_gen.max_new_tokens:
                entry.error = (
                    400,
                    f"the prefill and decode legs of bootstrap room {room} ask for different requests",
                )
            else:
                entry.live = self.live.submit(
                    d_gen.token_ids, d_gen.max_new_tokens, prefill_worker=p_idx, decode_worker=d_idx
                )
            entry.ready.set()
        else:
            timeout_wall_s = self.bootstrap_timeout_s * self.live.time_scale
            try:
                await asyncio.wait_for(entry.ready.wait(), timeout=timeout_wall_s)
            except (TimeoutError, asyncio.CancelledError) as exc:
                if self._rooms.get(key) is entry and not entry.ready.is_set():
                    setattr(entry, leg, None)
                    if entry.prefill is None and entry.decode is None:
                        del self._rooms[key]
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise _Abort(
                    500,
                    f"Request {room} timed out after {self.bootstrap_timeout_s:g}s in KVPoll.Bootstrapping",
                ) from None
        if entry.error is not None:
            raise _Abort(*entry.error)
        assert entry.live is not None
        return entry.live

    def lag_reports(self, since_unix_s: float | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Every worker's lag report (``LiveCluster.lag_report``)."""
        return [(w.name, self.live.lag_report(w.role, w.idx, since_unix_s)) for w in self.workers]

    def lag_failure(self, duration_s: float, since_unix_s: float | None = None) -> str | None:
        """Why a run of ``duration_s`` wall seconds did not keep its schedule on some worker, or None."""
        worst = max(self.lag_reports(since_unix_s), key=lambda item: item[1]["max_s"])
        problem = lag_check(worst[1]["max_s"], duration_s)
        return None if problem is None else f"{worst[0]}: {problem}"


class BackgroundCluster:
    """Run an :class:`EmulatedCluster` on its own event loop in a daemon thread (tests, scripts)."""

    def __init__(self, cluster: EmulatedCluster) -> None:
        self.cluster = cluster
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="emulated-cluster")

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the cluster's loop and return its result."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.cluster.start(), self.loop).result(timeout=30)
        except BaseException:
            self._shutdown()
            raise
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.cluster.stop(), self.loop).result(timeout=30)
        self._shutdown()

    def _shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


__all__ = [
    "BackgroundCluster",
    "BootstrapServer",
    "EmulatedCluster",
    "Generation",
    "PDWorker",
    "chat_prompt",
    "gateway_timer_args",
    "parse_generation",
    "render_event",
    "text_token_ids",
]

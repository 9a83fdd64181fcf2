"""The SGLang 0.5.23 hook-point snapshot: the committed one satisfies the plugin's contract, the
extractor reads a hand-written source tree right, and (slow) the wheel still yields the committed file."""

from __future__ import annotations

import ast
import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from serving.sglang_plugin.contract import CLASSES, RELIED
from serving.sglang_plugin.snapshot import (
    CALLED,
    HOOK_POINTS,
    TARGETS,
    _find,
    _own_members,
    build_snapshot,
    check_hook_points,
    dumps,
    load_snapshot,
)


def test_committed_snapshot_satisfies_the_plugin_contract() -> None:
    snap = load_snapshot()
    assert snap["sglang_version"] == "0.5.23"
    assert snap["source"]["wheel"].startswith("sglang-0.5.23-")
    assert check_hook_points(snap) == []
    for rel, qualname in TARGETS:
        entry = snap["functions"][rel[:-3].replace("/", ".").removesuffix(".__init__") + "." + qualname]
        assert entry["file"] == rel and entry["lineno"] > 0
        assert ("self" in entry) == ("." in qualname)
    framework = snap["plugin_framework"]
    assert framework["entry_point_group"] == "sglang.srt.plugins"
    assert framework["selection_env"]["name"] == "SGLANG_PLUGINS"
    intake = snap["functions"]["sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"]
    assert {"disaggregation_mode", "disagg_decode_prealloc_queue", "waiting_queue"} <= set(
        intake["self"]["reads"]
    )
    assert "disagg_decode_prealloc_queue.add" in intake["self"]["calls"]
    assert intake["params"][2] == {
        "name": "is_retracted",
        "kind": "positional_or_keyword",
        "annotation": "bool",
        "default": "False",
    }
    assert dumps(snap) == dumps(copy.deepcopy(snap))


def test_check_reports_what_breaks_the_contract() -> None:
    snap = copy.deepcopy(load_snapshot())
    target = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
    snap["functions"][target]["params"][1]["name"] = "request"
    del snap["functions"]["sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"]
    snap["plugin_framework"]["entry_point_group"] = "sglang.plugins"
    snap["classes"]["sglang.srt.managers.scheduler.Scheduler"]["overrides_from_decode_mixin"] = [
        "get_next_disagg_decode_batch_to_run"
    ]
    del snap["members"]["sglang.srt.managers.scheduler.Scheduler"]["chunked_req"]
    snap["marker_carrier"]["sglang.srt.managers.scheduler.Scheduler._handle_generate_request"] = []
    prepare = snap["functions"]["sglang.srt.disaggregation.utils.prepare_abort"]
    prepare["params"] = [p for p in prepare["params"] if p["name"] != "status_code"]
    budget = snap["functions"][
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._allocatable_token_budgets"
    ]
    budget["params"][2]["default"] = "False"
    problems = check_hook_points(snap)
    assert any("Scheduler.chunked_req: not defined" in p for p in problems)
    assert any("_handle_generate_request no longer passes routing_key" in p for p in problems)
    assert any("prepare_abort: no parameter 'status_code'" in p for p in problems)
    assert any("_allocatable_token_budgets: parameters" in p and "'False'" in p for p in problems)
    assert any(target in p and "request" in p for p in problems)
    assert any("get_new_batch_prefill: missing" in p for p in problems)
    assert any("entry-point group" in p for p in problems)
    assert any("overrides get_next_disagg_decode_batch_to_run" in p for p in problems)
    assert set(HOOK_POINTS) <= set(load_snapshot()["functions"])


_MINI = {
    "sglang/version.py": '__version__ = "9.9.9"\n',
    "sglang/srt/environ.py": """
        class Envs:
            SGLANG_PLATFORM = EnvStr("")
            SGLANG_PLUGINS = EnvStr("")
        """,
    "sglang/srt/plugins/__init__.py": """
        PLATFORM_PLUGINS_GROUP = "sglang.srt.platforms"
        GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"
        def load_plugins_by_group(group, excluded_dists=None):
            return {}
        def load_plugins():
            pass
        """,
    "sglang/srt/plugins/hook_registry.py": """
        class HookType(Enum):
            BEFORE = "before"
            AFTER = "after"
            AROUND = "around"
            REPLACE = "replace"
        class HookRegistry:
            @classmethod
            def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
                cls._hooks[target].append(hook)
            @classmethod
            def apply_hooks(cls):
                pass
        def plugin_hook(target, type=HookType.AFTER):
            pass
        """,
    "sglang/srt/managers/scheduler.py": """
        class Scheduler(SchedulerDisaggregationDecodeMixin, OtherMixin):
            def _add_request_to_queue(self, req: Req, is_retracted: bool = False):
                if self.disaggregation_mode == 2:
                    self.disagg_decode_prealloc_queue.add(req, is_retracted=is_retracted)
                self.waiting_queue.append(req)
                self.last_seen = req
                self.model_config.num_key_value_heads
            def get_new_batch_prefill(self, running_batch: ScheduleBatch) -> NextBatchPlan:
                return self._raw(running_batch)
            def handle(self, req):
                self._add_request_to_queue(req)
            def _handle_generate_request(self, recv_req):
                return Req(recv_req.rid, routing_key=recv_req.routing_key)
        def run_scheduler_process(*args):
            load_plugins()
        """,
    "sglang/srt/disaggregation/decode.py": """
        class DecodePreallocQueue(Base):
            def add(self, req, is_retracted=False, *, is_rebootstrap=False):
                self.pending_reqs.append(req)
            def _allocatable_token_budgets(
                self, retractable_tokens=None, count_retracted=True, extra_reserved_reqs=0,
                reserved_tokens=None, hicache_reserved_tokens=0,
            ) -> int:
                if self.scheduler.enable_hisparse and self.scheduler.last_batch.forward_mode.is_prebuilt():
                    return self.token_to_kv_pool_allocator.available_size()
                return 0
            def _swa_tail_allocatable_token_budget(
                self, retractable_tokens=None, retractable_swa_tokens=None, count_retracted=True,
                n_active=None, reserved_tokens=None, extra_reserved_reqs=0,
            ):
                return 0
            def pop_preallocated(self):
                return self._allocatable_token_budgets()
        class SchedulerDisaggregationDecodeMixin:
            @torch.no_grad()
            def event_loop_normal_disagg_decode(self: Scheduler):
                plan = self.get_next_disagg_decode_batch_to_run(self.running_batch)
            @scheduler_stage_method(STAGE)
            def get_next_disagg_decode_batch_to_run(self: Scheduler, running_batch: Batch) -> Plan:
                return self.update_running_batch(running_batch)
        class Unrelated:
            def go(self):
                self.add(1)
                self.queue.add(2)
        """,
    "sglang/srt/managers/batch_mixin.py": """
        class BatchMixin:
            def is_empty(self):
                self.batch_is_full = False
        """,
    "sglang/srt/managers/schedule_batch.py": """
        from sglang.srt.managers.batch_mixin import BatchMixin
        class Req:
            def __init__(self, rid, routing_key=None):
                self.rid = rid
                self.routing_key = routing_key
        class ScheduleBatch(BatchMixin):
            reqs: list = None
        """,
    "sglang/srt/managers/tokenizer_manager.py": """
        class TokenizerManager:
            def _create_tokenized_object(self, obj):
                return Tokenized(routing_key=obj.routing_key, rid=obj.rid)
        """,
}


_DEFINED_IN_BASES = {"ScheduleBatch": ("is_empty", "batch_is_full")}
"""Relied-on names the hand-written tree defines in a base class (no stub in the class itself)."""


def _stub_def(name: str, params: list[str], indent: str) -> str:
    return f"{indent}def {name}({', '.join(params)}):\n{indent}    return None\n"


def _mini_tree(root: Path) -> Path:
    """The hand-written tree, completed with stubs for every other target and relied-on class (with
    the parameters the plugin's contract expects), so the whole extractor runs on it."""
    texts = {rel: textwrap.dedent(text).lstrip("\n") for rel, text in _MINI.items()}
    wanted: dict[str, dict[str, list[str]]] = {}  # file -> class ("" for module level) -> stub lines
    for rel, qualname in TARGETS:
        cls, _, name = qualname.rpartition(".")
        target = f"{rel[:-3].replace('/', '.').removesuffix('.__init__')}.{qualname}"
        if target in HOOK_POINTS:
            params = [n if d is None else f"{n}={d}" for n, d in HOOK_POINTS[target]]
        elif target in CALLED:
            n_positional, keywords = CALLED[target]
            params = [*(["self"] if cls else []), *(f"a{i}" for i in range(n_positional))]
            params += [f"{k}=None" for k in keywords]
        else:
            params = ["self"] if cls else []
        wanted.setdefault(rel, {}).setdefault(cls, []).append(_stub_def(name, params, "    " if cls else ""))
    for cls_name, rel in CLASSES.items():
        in_bases = _DEFINED_IN_BASES.get(cls_name, ())
        fields = [f"    {name}: int = 0\n" for name in RELIED[cls_name] if name not in in_bases]
        wanted.setdefault(rel, {}).setdefault(cls_name, []).extend(fields)
    for rel, by_class in wanted.items():
        text = texts.get(rel, "")
        for cls, stubs in by_class.items():
            for stub in stubs:
                name = stub.strip().removeprefix("def ").split("(")[0].split(":")[0]
                tree = ast.parse(text)
                lines = text.splitlines(keepends=True)
                if not cls:
                    if not isinstance(_find(tree, name), ast.FunctionDef):
                        lines.append(stub)
                else:
                    node = _find(tree, cls)
                    if node is None:
                        lines += [f"class {cls}:\n", stub]
                    elif name not in _own_members(node, rel):
                        lines[node.lineno : node.lineno] = [stub]  # right after the class line
                text = "".join(lines)
        texts[rel] = text
    for rel, text in texts.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_extractor_on_a_hand_written_source_tree(tmp_path: Path) -> None:
    snap = build_snapshot(_mini_tree(tmp_path / "src"))
    assert snap["sglang_version"] == "9.9.9" and snap["source"] == {"directory": "src"}
    f = snap["functions"]
    intake = f["sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"]
    assert [p["name"] for p in intake["params"]] == ["self", "req", "is_retracted"]
    assert intake["self"] == {
        "reads": [
            "disagg_decode_prealloc_queue",
            "disaggregation_mode",
            "model_config.num_key_value_heads",
            "waiting_queue",
        ],
        "writes": ["last_seen"],
        "calls": ["disagg_decode_prealloc_queue.add", "waiting_queue.append"],
    }
    assert intake["called_from"] == ["sglang.srt.managers.scheduler:Scheduler.handle"]
    budget = f["sglang.srt.disaggregation.decode.DecodePreallocQueue._allocatable_token_budgets"]
    assert budget["returns"] == "int"
    assert budget["self"]["reads"] == [
        "scheduler.enable_hisparse",
        "scheduler.last_batch",
        "token_to_kv_pool_allocator",
    ]
    assert budget["self"]["calls"] == ["token_to_kv_pool_allocator.available_size"]
    assert budget["called_from"] == ["sglang.srt.disaggregation.decode:DecodePreallocQueue.pop_preallocated"]
    add = f["sglang.srt.disaggregation.decode.DecodePreallocQueue.add"]
    assert add["params"][3] == {
        "name": "is_rebootstrap",
        "kind": "keyword_only",
        "annotation": None,
        "default": "False",
    }
    assert add["called_from"] == ["sglang.srt.managers.scheduler:Scheduler._add_request_to_queue"], (
        "not Unrelated.go"
    )
    select = f[
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run"
    ]
    assert select["decorators"] == ["scheduler_stage_method(STAGE)"]
    assert select["params"][0]["annotation"] == "Scheduler"
    assert select["called_from"] == [
        "sglang.srt.disaggregation.decode:SchedulerDisaggregationDecodeMixin.event_loop_normal_disagg_decode"
    ]
    register = f["sglang.srt.plugins.hook_registry.HookRegistry.register"]
    assert [p["kind"] for p in register["params"]][-1] == "keyword_only"
    assert register["self"]["reads"] == ["_hooks"]
    fw = snap["plugin_framework"]
    assert fw["load_plugins_called_from"] == ["sglang.srt.managers.scheduler:run_scheduler_process"]
    assert fw["selection_env"]["lineno"] == 3
    batch = snap["members"]["sglang.srt.managers.schedule_batch.ScheduleBatch"]
    assert batch["is_empty"] == {
        "kind": "method",
        "file": "sglang/srt/managers/batch_mixin.py",
        "lineno": 2,
        "class": "BatchMixin",
    }, "found in the base class, through the module's import"
    assert batch["batch_is_full"]["kind"] == "attribute" and batch["batch_is_full"]["class"] == "BatchMixin"
    assert snap["members"]["sglang.srt.managers.schedule_batch.Req"]["routing_key"]["kind"] == "attribute"
    assert snap["marker_carrier"] == {
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object": [
            "obj.routing_key"
        ],
        "sglang.srt.managers.scheduler.Scheduler._handle_generate_request": ["recv_req.routing_key"],
        "sglang.srt.managers.schedule_batch.Req.__init__": ["routing_key"],
    }
    assert check_hook_points(snap) == []


def test_extractor_names_a_missing_target(tmp_path: Path) -> None:
    root = _mini_tree(tmp_path / "src")
    decode = root / "sglang/srt/disaggregation/decode.py"
    decode.write_text(decode.read_text().replace("def _allocatable_token_budgets", "def _budgets"))
    with pytest.raises(KeyError, match=r"DecodePreallocQueue\._allocatable_token_budgets"):
        build_snapshot(root)
    run = subprocess.run(
        [sys.executable, "-m", "serving.sglang_plugin.snapshot", str(root)], capture_output=True, text=True
    )
    assert run.returncode == 2 and "_allocatable_token_budgets" in run.stderr
    with pytest.raises(FileNotFoundError, match="not an SGLang wheel"):
        build_snapshot(tmp_path)


@pytest.mark.slow
def test_snapshot_rederived_from_the_wheel(tmp_path: Path) -> None:
    wheel = os.environ.get("CROSSFLOW_SGLANG_WHEEL")
    if not wheel:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "sglang==0.5.23",
                "--no-deps",
                "-q",
                "-d",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wheels = sorted(tmp_path.glob("sglang-0.5.23-*.whl"))
        if run.returncode != 0 or not wheels:
            pytest.skip(f"cannot download the sglang 0.5.23 wheel (offline?): {run.stderr.strip()[-300:]}")
        wheel = str(wheels[0])
    derived = build_snapshot(wheel)
    committed = load_snapshot()
    # another platform's build of 0.5.23 has another file name and hash but the same Python source
    derived_source, committed_source = derived.pop("source"), committed.pop("source")
    assert dumps(derived) == dumps(committed)
    if derived_source["wheel"] == committed_source["wheel"]:
        assert derived_source["sha256"] == committed_source["sha256"]

"""Extract the SGLang hook points the Crossflow plugin relies on from an SGLang wheel, without importing it.

The plugin (decode-local prefill on a decode-mode SGLang worker) wraps a few scheduler methods through
SGLang's plugin framework. SGLang needs CUDA and never installs in CI, so what the plugin assumes is
checked against a snapshot instead: this script parses the wheel's source with :mod:`ast` and records,
for every hooked or relied-on function, its signature, decorators, the attributes it reads and writes
on ``self``, the ``self`` methods it calls and where in the scheduler it is called from; plus the plugin
framework's facts (entry-point group, the ``SGLANG_PLUGINS`` variable, hook types, where the
scheduler process loads plugins). The committed snapshot is ``sglang_0.5.23_hooks.json`` beside this
file; :func:`check_hook_points` says what in a snapshot breaks the plugin's assumptions.

    pip download sglang==0.5.23 --no-deps -d /tmp/sglang
    python -m serving.sglang_plugin.snapshot /tmp/sglang/sglang-0.5.23-*.whl \
        --out serving/sglang_plugin/sglang_0.5.23_hooks.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

SNAPSHOT_FILE = "sglang_0.5.23_hooks.json"
SNAPSHOT_FORMAT = 1

SCHEDULER = "sglang/srt/managers/scheduler.py"
DECODE = "sglang/srt/disaggregation/decode.py"
HOOK_REGISTRY = "sglang/srt/plugins/hook_registry.py"
PLUGINS = "sglang/srt/plugins/__init__.py"
ENVIRON = "sglang/srt/environ.py"

TARGETS: tuple[tuple[str, str], ...] = (
    (SCHEDULER, "Scheduler._add_request_to_queue"),
    (SCHEDULER, "Scheduler.get_new_batch_prefill"),
    (DECODE, "SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run"),
    (DECODE, "SchedulerDisaggregationDecodeMixin.event_loop_normal_disagg_decode"),
    (DECODE, "DecodePreallocQueue.add"),
    (DECODE, "DecodePreallocQueue._allocatable_token_budgets"),
    (DECODE, "DecodePreallocQueue._swa_tail_allocatable_token_budget"),
    (HOOK_REGISTRY, "HookRegistry.register"),
    (HOOK_REGISTRY, "HookRegistry.apply_hooks"),
    (HOOK_REGISTRY, "plugin_hook"),
    (PLUGINS, "load_plugins"),
    (PLUGINS, "load_plugins_by_group"),
)
"""(source file, qualified name) of every function recorded: the three hook points, what they hand
work to (``DecodePreallocQueue.add``, the SWA twin of the KV budget, the decode event loop that calls
batch selection) and the framework's entry points."""

CALLER_DIRS: tuple[str, ...] = ("sglang/srt/managers", "sglang/srt/disaggregation")
"""Where call sites of the recorded scheduler-side methods are looked for."""

RECEIVERS: dict[str, tuple[str, ...]] = {
    "Scheduler": ("scheduler",),
    "SchedulerDisaggregationDecodeMixin": ("scheduler",),
    "DecodePreallocQueue": ("disagg_decode_prealloc_queue", "prealloc_queue"),
}
"""Class -> the attribute names its instances are called through from other objects (calls on
``self`` count inside the class itself and, for the scheduler, inside its mixins)."""

_MIXIN = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin"

HOOK_POINTS: dict[str, tuple[str, ...]] = {
    "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue": ("self", "req", "is_retracted"),
    f"{_MIXIN}.get_next_disagg_decode_batch_to_run": ("self", "running_batch"),
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._allocatable_token_budgets": (
        "self",
        "retractable_tokens",
        "count_retracted",
        "extra_reserved_reqs",
        "reserved_tokens",
        "hicache_reserved_tokens",
    ),
    "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill": ("self", "running_batch"),
}
"""The plugin's contract with SGLang: hook target -> the parameters, in order, its wrapper passes on."""


@dataclass(frozen=True)
class _Source:
    """A wheel or a directory holding ``sglang/``: read files by package-relative path."""

    root: Path
    prefix: str = ""
    zip_names: frozenset[str] | None = None

    @classmethod
    def open(cls, path: str | Path) -> _Source:
        p = Path(path)
        if p.is_file() and zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                return cls(p, "", frozenset(z.namelist()))
        for prefix in ("", "python/"):
            if (p / prefix / SCHEDULER).is_file():
                return cls(p, prefix)
        raise FileNotFoundError(f"{p}: not an SGLang wheel nor a directory holding {SCHEDULER}")

    def read(self, rel: str) -> str:
        if self.zip_names is not None:
            if rel not in self.zip_names:
                raise FileNotFoundError(f"{self.root}: no {rel} in the wheel")
            with zipfile.ZipFile(self.root) as z:
                return z.read(rel).decode("utf-8")
        path = self.root / self.prefix / rel
        if not path.is_file():
            raise FileNotFoundError(f"{self.root}: no {rel}")
        return path.read_text("utf-8")

    def list_py(self, folder: str) -> list[str]:
        if self.zip_names is not None:
            return sorted(n for n in self.zip_names if n.startswith(folder + "/") and n.endswith(".py"))
        base = self.root / self.prefix
        return sorted(
            str(p.relative_to(base)).replace(os.sep, "/")
            for p in (base / folder).rglob("*.py")
            if p.is_file()
        )

    def version(self) -> str:
        if self.zip_names is not None:
            for name in sorted(self.zip_names):
                if name.endswith(".dist-info/METADATA"):
                    with zipfile.ZipFile(self.root) as z:
                        for line in z.read(name).decode("utf-8").splitlines():
                            if line.startswith("Version:"):
                                return line.split(":", 1)[1].strip()
        for rel in ("sglang/version.py", "sglang/_version.py"):
            try:
                tree = ast.parse(self.read(rel))
            except FileNotFoundError:
                continue
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets
                ):
                    if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                        return node.value.value
        return "unknown"

    def describe(self) -> dict[str, str]:
        if self.zip_names is not None:
            digest = hashlib.sha256(self.root.read_bytes()).hexdigest()
            return {"wheel": self.root.name, "sha256": digest}
        return {"directory": self.root.name}


def _module_name(rel: str) -> str:
    return rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None:
    body: Sequence[ast.stmt] = tree.body
    node: Any = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        body = node.body
    return node


def _unparse(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[dict[str, Any]]:
    a = fn.args
    out: list[dict[str, Any]] = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = "positional_only" if i < len(a.posonlyargs) else "positional_or_keyword"
        out.append(
            {
                "name": arg.arg,
                "kind": kind,
                "annotation": _unparse(arg.annotation),
                "default": _unparse(default),
            }
        )
    if a.vararg is not None:
        out.append(
            {"name": a.vararg.arg, "kind": "var_positional", "annotation": _unparse(a.vararg.annotation)}
        )
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(
            {
                "name": arg.arg,
                "kind": "keyword_only",
                "annotation": _unparse(arg.annotation),
                "default": _unparse(kw_default),
            }
        )
    if a.kwarg is not None:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword", "annotation": _unparse(a.kwarg.annotation)})
    return out


def _self_chain(node: ast.AST, self_name: str) -> list[str] | None:
    """``self.a.b.c`` -> ``["a", "b", "c"]``; None for anything not rooted at ``self``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == self_name and parts:
        return parts[::-1]
    return None


def _self_usage(fn: ast.FunctionDef | ast.AsyncFunctionDef, self_name: str) -> dict[str, list[str]]:
    """What a method does with ``self``: attribute chains read and written (cut at two levels:
    ``scheduler.last_batch``), and methods called (``_pre_alloc``, ``disagg_decode_prealloc_queue.add``).

    Needs ``_annotate_parents`` on the tree. Only the outermost attribute of each chain is looked at; a
    call of a chain longer than two levels counts as reading its first two.
    """
    reads: set[str] = set()
    writes: set[str] = set()
    calls: set[str] = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Attribute):
            continue
        parent = getattr(node, "_parent", None)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            continue  # an inner link of a longer chain
        chain = _self_chain(node, self_name)
        if chain is None:
            continue
        head = ".".join(chain[:2])
        if isinstance(parent, ast.Call) and parent.func is node and len(chain) <= 2:
            calls.add(head)
            if len(chain) == 2:
                reads.add(chain[0])
        elif isinstance(node.ctx, ast.Store | ast.Del):
            writes.add(head)
            if len(chain) > 1:
                reads.add(chain[0])
        else:
            reads.add(head)
    return {"reads": sorted(reads), "writes": sorted(writes), "calls": sorted(calls)}


def _annotate_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child._parent = node  # type: ignore[attr-defined]


def _defs(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function with its qualified name (methods as ``Class.method``; nested ones skipped)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", item


def _receiver_name(node: ast.AST) -> str | None:
    """``self`` for ``self.f()``, ``queue`` for ``self.x.queue.f()``: the name a method is called on."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _call_sites(
    src: _Source, methods: dict[str, tuple[tuple[str, ...], frozenset[str]]]
) -> dict[str, set[str]]:
    """method name -> ``module:qualname`` of every function under :data:`CALLER_DIRS` that calls it on
    one of the receiver names given for it: an attribute that holds the object, or ``self`` inside one
    of the given classes."""
    sites: dict[str, set[str]] = {name: set() for name in methods}
    for folder in CALLER_DIRS:
        for rel in src.list_py(folder):
            tree = ast.parse(src.read(rel))
            for qualname, fn in _defs(tree):
                for node in ast.walk(fn):
                    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                        continue
                    name = node.func.attr
                    if name not in sites:
                        continue
                    receivers, self_classes = methods[name]
                    receiver = _receiver_name(node.func.value)
                    caller_class = qualname.partition(".")[0] if "." in qualname else ""
                    if receiver in receivers or (receiver == "self" and caller_class in self_classes):
                        sites[name].add(f"{_module_name(rel)}:{qualname}")
    return sites


def _class_facts(tree: ast.Module, name: str) -> dict[str, Any]:
    cls = _find(tree, name)
    if not isinstance(cls, ast.ClassDef):
        raise KeyError(name)
    methods = sorted(n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    return {"bases": [ast.unparse(b) for b in cls.bases], "lineno": cls.lineno, "methods": methods}


def _module_constant(tree: ast.Module, name: str) -> Any:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise KeyError(name)


def _class_assignment(tree: ast.Module, cls_name: str, attr: str) -> tuple[str, int]:
    cls = _find(tree, cls_name)
    if isinstance(cls, ast.ClassDef):
        for node in cls.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == attr for t in node.targets
            ):
                return ast.unparse(node.value), node.lineno
    raise KeyError(f"{cls_name}.{attr}")


def _enum_members(tree: ast.Module, cls_name: str) -> dict[str, Any]:
    cls = _find(tree, cls_name)
    if not isinstance(cls, ast.ClassDef):
        raise KeyError(cls_name)
    return {
        t.id: ast.literal_eval(n.value)
        for n in cls.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }


def _callers_of(tree: ast.Module, rel: str, func_name: str) -> list[str]:
    return sorted(
        f"{_module_name(rel)}:{qualname}"
        for qualname, fn in _defs(tree)
        if any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == func_name
            for n in ast.walk(fn)
        )
    )


def build_snapshot(source: str | Path) -> dict[str, Any]:
    """The snapshot of an SGLang wheel (``.whl``) or source directory. Raises ``KeyError`` naming a
    target that the source does not define, ``FileNotFoundError`` for a missing module."""
    src = _Source.open(source)
    trees: dict[str, ast.Module] = {}

    def tree(rel: str) -> ast.Module:
        if rel not in trees:
            trees[rel] = ast.parse(src.read(rel), filename=rel)
            _annotate_parents(trees[rel])
        return trees[rel]

    functions: dict[str, Any] = {}
    for rel, qualname in TARGETS:
        fn = _find(tree(rel), qualname)
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            raise KeyError(f"{rel}: no function {qualname}")
        params = _params(fn)
        is_method = "." in qualname
        self_name = params[0]["name"] if is_method and params else ""
        entry: dict[str, Any] = {
            "file": rel,
            "lineno": fn.lineno,
            "async": isinstance(fn, ast.AsyncFunctionDef),
            "decorators": [ast.unparse(d) for d in fn.decorator_list],
            "params": params,
            "returns": _unparse(fn.returns),
        }
        if is_method:
            entry["self"] = _self_usage(fn, self_name)
        functions[f"{_module_name(rel)}.{qualname}"] = entry
    scheduler_classes = frozenset({"Scheduler", *_class_facts(tree(SCHEDULER), "Scheduler")["bases"]})
    self_classes = {"DecodePreallocQueue": frozenset({"DecodePreallocQueue"})}
    scheduler_side = [q.split(".") for _, q in TARGETS if q.split(".")[0] in RECEIVERS]
    sites = _call_sites(
        src,
        {m: (RECEIVERS[c], self_classes.get(c, scheduler_classes)) for c, m in scheduler_side},
    )
    for rel, qualname in TARGETS:
        cls, _, method = qualname.rpartition(".")
        if cls in RECEIVERS:
            functions[f"{_module_name(rel)}.{qualname}"]["called_from"] = sorted(sites[method])

    sched, decode = tree(SCHEDULER), tree(DECODE)
    scheduler_cls = _class_facts(sched, "Scheduler")
    mixin = _class_facts(decode, "SchedulerDisaggregationDecodeMixin")
    env_value, env_line = _class_assignment(tree(ENVIRON), "Envs", "SGLANG_PLUGINS")
    return {
        "format": SNAPSHOT_FORMAT,
        "sglang_version": src.version(),
        "source": src.describe(),
        "functions": functions,
        "classes": {
            "sglang.srt.managers.scheduler.Scheduler": {
                "bases": scheduler_cls["bases"],
                "lineno": scheduler_cls["lineno"],
                "overrides_from_decode_mixin": sorted(set(scheduler_cls["methods"]) & set(mixin["methods"])),
            },
            "sglang.srt.disaggregation.decode.DecodePreallocQueue": {
                k: v for k, v in _class_facts(decode, "DecodePreallocQueue").items() if k != "methods"
            },
        },
        "plugin_framework": {
            "entry_point_group": _module_constant(tree(PLUGINS), "GENERAL_PLUGINS_GROUP"),
            "platform_entry_point_group": _module_constant(tree(PLUGINS), "PLATFORM_PLUGINS_GROUP"),
            "selection_env": {
                "name": "SGLANG_PLUGINS",
                "declared": env_value,
                "file": ENVIRON,
                "lineno": env_line,
            },
            "hook_types": _enum_members(tree(HOOK_REGISTRY), "HookType"),
            "load_plugins_called_from": _callers_of(sched, SCHEDULER, "load_plugins"),
        },
    }


def check_hook_points(snapshot: dict[str, Any]) -> list[str]:
    """What in ``snapshot`` breaks the plugin's assumptions (empty when nothing does)."""
    problems: list[str] = []
    functions = snapshot.get("functions", {})
    for target, expected in HOOK_POINTS.items():
        entry = functions.get(target)
        if entry is None:
            problems.append(f"{target}: missing")
            continue
        names = tuple(p["name"] for p in entry["params"])
        if names != expected:
            problems.append(f"{target}: parameters {names}, the plugin passes {expected}")
    framework = snapshot.get("plugin_framework", {})
    if framework.get("entry_point_group") != "sglang.srt.plugins":
        problems.append(
            f"entry-point group is {framework.get('entry_point_group')!r}, not 'sglang.srt.plugins'"
        )
    if not {"BEFORE", "AFTER", "AROUND", "REPLACE"} <= set(framework.get("hook_types", {})):
        problems.append(
            f"hook types {sorted(framework.get('hook_types', {}))} lack one of BEFORE/AFTER/AROUND/REPLACE"
        )
    if not any(c.endswith(":run_scheduler_process") for c in framework.get("load_plugins_called_from", [])):
        problems.append(
            "load_plugins() is not called in run_scheduler_process: hooks would not reach the scheduler"
        )
    scheduler = snapshot.get("classes", {}).get("sglang.srt.managers.scheduler.Scheduler", {})
    if "SchedulerDisaggregationDecodeMixin" not in scheduler.get("bases", []):
        problems.append("Scheduler no longer inherits SchedulerDisaggregationDecodeMixin")
    if "get_next_disagg_decode_batch_to_run" in scheduler.get("overrides_from_decode_mixin", []):
        problems.append(
            "Scheduler overrides get_next_disagg_decode_batch_to_run: hook the Scheduler's method"
        )
    return problems


def load_snapshot() -> dict[str, Any]:
    """The committed snapshot of SGLang 0.5.23."""
    text = resources.files("serving.sglang_plugin").joinpath(SNAPSHOT_FILE).read_text("utf-8")
    return json.loads(text)


def dumps(snapshot: dict[str, Any]) -> str:
    """The snapshot's canonical text (sorted keys: byte-identical for the same source)."""
    return json.dumps(snapshot, indent=1, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serving.sglang_plugin.snapshot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("source", help="an SGLang wheel (.whl) or a directory holding sglang/")
    parser.add_argument("--out", default=None, help="write the snapshot here (default: print it)")
    args = parser.parse_args(argv)
    try:
        snapshot = build_snapshot(args.source)
    except (FileNotFoundError, KeyError, SyntaxError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    text = dumps(snapshot)
    if args.out is None:
        print(text, end="")
    else:
        out = Path(args.out)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    for problem in check_hook_points(snapshot):
        print(f"warning: {problem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
import inspect
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

SNAPSHOT_FILE = "sglang_0.5.23_hooks.json"
SNAPSHOT_FORMAT = 2

SCHEDULER = "sglang/srt/managers/scheduler.py"
DECODE = "sglang/srt/disaggregation/decode.py"
HOOK_REGISTRY = "sglang/srt/plugins/hook_registry.py"
PLUGINS = "sglang/srt/plugins/__init__.py"
ENVIRON = "sglang/srt/environ.py"

SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
TOKENIZER = "sglang/srt/managers/tokenizer_manager.py"
DISAGG_UTILS = "sglang/srt/disaggregation/utils.py"
TIME_STATS = "sglang/srt/observability/req_time_stats.py"
OUTPUT_STREAMER = "sglang/srt/managers/scheduler_components/output_streamer.py"

TARGETS: tuple[tuple[str, str], ...] = (
    (SCHEDULER, "Scheduler._add_request_to_queue"),
    (SCHEDULER, "Scheduler.get_new_batch_prefill"),
    (SCHEDULER, "Scheduler._get_new_batch_prefill_raw"),
    (SCHEDULER, "Scheduler.get_next_batch_to_run"),
    (SCHEDULER, "Scheduler._handle_generate_request"),
    (SCHEDULER, "Scheduler.abort_request"),
    (SCHEDULER, "Scheduler.is_fully_idle"),
    (SCHEDULER, "Scheduler.set_internal_state"),
    (SCHEDULER, "Scheduler.get_internal_state"),
    (SCHEDULER, "Scheduler.stash_chunked_request"),
    (SCHEDULER, "Scheduler.process_pending_chunked_abort"),
    (SCHEDULER, "Scheduler._release_aborted_request"),
    (DECODE, "SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run"),
    (DECODE, "SchedulerDisaggregationDecodeMixin.event_loop_normal_disagg_decode"),
    (DECODE, "SchedulerDisaggregationDecodeMixin.process_decode_queue"),
    (DECODE, "DecodePreallocQueue.add"),
    (DECODE, "DecodePreallocQueue._active_req_count"),
    (DECODE, "DecodePreallocQueue._allocatable_token_budgets"),
    (DECODE, "DecodePreallocQueue._swa_tail_allocatable_token_budget"),
    (DECODE, "DecodePreallocQueue._swa_aware_allocatable_token_budgets"),
    (DECODE, "DecodePreallocQueue.pop_preallocated"),
    (DECODE, "DecodePreallocQueue.resume_retracted_reqs"),
    (SCHEDULE_BATCH, "Req.__init__"),
    (SCHEDULE_BATCH, "ScheduleBatch.filter_batch"),
    (SCHEDULE_BATCH, "ScheduleBatch.merge_batch"),
    (SCHEDULE_BATCH, "FINISH_ABORT.__init__"),
    (TOKENIZER, "TokenizerManager.generate_request"),
    (TOKENIZER, "TokenizerManager._create_tokenized_object"),
    (OUTPUT_STREAMER, "SchedulerOutputStreamer.stream_output"),
    (DISAGG_UTILS, "prepare_abort"),
    (TIME_STATS, "set_schedule_time_batch"),
    (HOOK_REGISTRY, "HookRegistry.register"),
    (HOOK_REGISTRY, "HookRegistry.apply_hooks"),
    (HOOK_REGISTRY, "_wrap_fn"),
    (HOOK_REGISTRY, "plugin_hook"),
    (PLUGINS, "load_plugins"),
    (PLUGINS, "load_plugins_by_group"),
)
"""(source file, qualified name) of every function recorded: the hook points, what the plugin calls
(``get_new_batch_prefill``, the chunked-request helpers, the abort path), what hands work to them
(the decode event loop and queue, the pre-allocation and retraction callers of the KV budget), where
the marker travels (``_create_tokenized_object`` -> ``_handle_generate_request`` -> ``Req``) and the
plugin framework's entry points."""

CALLER_DIRS: tuple[str, ...] = ("sglang/srt/managers", "sglang/srt/disaggregation")
"""Where call sites of the recorded scheduler-side methods are looked for."""

RECEIVERS: dict[str, tuple[str, ...]] = {
    "Scheduler": ("scheduler",),
    "SchedulerDisaggregationDecodeMixin": ("scheduler",),
    "DecodePreallocQueue": ("disagg_decode_prealloc_queue", "prealloc_queue"),
}
"""Class -> the attribute names its instances are called through from other objects (calls on
``self`` count inside the class itself and, for the scheduler, inside its mixins)."""


def _hook_points() -> dict[str, tuple[tuple[str, str | None], ...]]:
    """Hook target -> the parameters (name, default or None) its hook takes after the original
    function or its result: SGLang's parameters, ``self`` first, as the hook must receive them."""
    from serving.sglang_plugin.hooks import HOOKS

    points = {}
    for target, _, hook in HOOKS:
        params = list(inspect.signature(hook).parameters.values())[1:]
        points[target] = tuple(
            ("self" if i == 0 else p.name, None if p.default is p.empty else repr(p.default))
            for i, p in enumerate(params)
        )
    return points


HOOK_POINTS: dict[str, tuple[tuple[str, str | None], ...]] = _hook_points()
"""The plugin's contract with SGLang: hook target -> its parameters (name, default), derived from the
hooks themselves (``serving.sglang_plugin.hooks.HOOKS``)."""

CALLED: dict[str, tuple[int, tuple[str, ...]]] = {
    "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill": (1, ()),
    "sglang.srt.managers.scheduler.Scheduler.stash_chunked_request": (1, ()),
    "sglang.srt.managers.scheduler.Scheduler.process_pending_chunked_abort": (0, ()),
    "sglang.srt.managers.scheduler.Scheduler._release_aborted_request": (1, ()),
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._active_req_count": (0, ()),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.filter_batch": (0, ("reqs_to_exclude",)),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.merge_batch": (1, ()),
    "sglang.srt.managers.schedule_batch.FINISH_ABORT.__init__": (2, ()),
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output": (2, ()),
    "sglang.srt.disaggregation.utils.prepare_abort": (2, ("status_code",)),
    "sglang.srt.observability.req_time_stats.set_schedule_time_batch": (1, ()),
}
"""What the plugin calls: function -> (positional arguments after ``self``, keyword arguments)."""

MARKER_CARRIER: tuple[tuple[str, str], ...] = (
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object", "obj.routing_key"),
    ("sglang.srt.managers.scheduler.Scheduler._handle_generate_request", "recv_req.routing_key"),
)
"""Where ``routing_key`` must be handed on unchanged for the marker to reach ``Req``: function ->
the value it passes as ``routing_key=`` (then ``Req.__init__`` keeps it as ``self.routing_key``)."""


@dataclass(frozen=True)
class _Source:
    """A wheel or a directory holding ``sglang/``: read files by package-relative path."""

    root: Path
    prefix: str = ""
    zip_names: frozenset[str] | None = None
    _texts: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Files read so far (a wheel's central directory is read once, not once per file)."""

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

    def exists(self, rel: str) -> bool:
        if self.zip_names is not None:
            return rel in self.zip_names
        return (self.root / self.prefix / rel).is_file()

    def read(self, rel: str) -> str:
        if rel in self._texts:
            return self._texts[rel]
        if not self.exists(rel):
            raise FileNotFoundError(f"{self.root}: no {rel}" + (" in the wheel" if self.zip_names else ""))
        if self.zip_names is not None:
            wanted = {rel, *(n for n in self.zip_names if n.endswith(".py") and n not in self._texts)}
            with zipfile.ZipFile(self.root) as z:  # every Python file at once: one directory read
                self._texts.update((n, z.read(n).decode("utf-8")) for n in wanted)
        else:
            self._texts[rel] = (self.root / self.prefix / rel).read_text("utf-8")
        return self._texts[rel]

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


def _module_file(src: _Source, module: str) -> str | None:
    """``a.b.c`` -> ``a/b/c.py`` or ``a/b/c/__init__.py``, whichever the source has (else None)."""
    base = module.replace(".", "/")
    return next((rel for rel in (f"{base}.py", f"{base}/__init__.py") if src.exists(rel)), None)


def _imported_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Name bound by ``from X import Y [as Z]`` anywhere in a module -> (module X, name Y)."""
    out: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def _own_members(cls: ast.ClassDef, rel: str) -> dict[str, dict[str, Any]]:
    """Names a class body defines: methods, class-level fields and ``self.<name>`` assignments in its
    methods (name -> kind, file, first line, class)."""
    own: dict[str, dict[str, Any]] = {}

    def note(name: str, kind: str, line: int) -> None:
        if name not in own or line < own[name]["lineno"]:
            own[name] = {"kind": kind, "file": rel, "lineno": line, "class": cls.name}

    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            note(node.name, "method", node.lineno)
            if not node.args.args:
                continue
            self_name = node.args.args[0].arg
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    chain = _self_chain(sub, self_name)
                    if chain is not None and len(chain) == 1:
                        note(chain[0], "attribute", sub.lineno)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            note(node.target.id, "field", node.lineno)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    note(target.id, "field", node.lineno)
    return own


def _sglang_bases(src: _Source, module: ast.Module, rel: str, cls: ast.ClassDef) -> list[tuple[str, str]]:
    """(file, class name) of each base of ``cls`` that SGLang defines: in the same module, or
    imported from an ``sglang.`` module."""
    imported = _imported_names(module)
    out = []
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue
        if isinstance(_find(module, base.id), ast.ClassDef):
            out.append((rel, base.id))
        elif base.id in imported and imported[base.id][0].startswith("sglang."):
            mod, name = imported[base.id]
            base_rel = _module_file(src, mod)
            if base_rel is not None:
                out.append((base_rel, name))
    return out


def _class_members(
    src: _Source, tree: Callable[[str], ast.Module], rel: str, cls_name: str
) -> dict[str, dict[str, Any]]:
    """Every name an instance of ``cls_name`` (defined in ``rel``) has by SGLang's source: its own
    (``_own_members``) and, where it does not define a name, its SGLang bases' (breadth first)."""
    members: dict[str, dict[str, Any]] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(rel, cls_name)]
    while todo:
        rel_i, name_i = todo.pop(0)
        if (rel_i, name_i) in seen:
            continue
        seen.add((rel_i, name_i))
        module = tree(rel_i)
        cls = _find(module, name_i)
        if not isinstance(cls, ast.ClassDef):
            raise KeyError(f"{rel_i}: no class {name_i}")
        for name, where in _own_members(cls, rel_i).items():
            members.setdefault(name, where)
        todo.extend(_sglang_bases(src, module, rel_i, cls))
    return members


def _keyword_values(fn: ast.FunctionDef | ast.AsyncFunctionDef, keyword: str) -> list[str]:
    """The values (unparsed) passed as ``keyword=`` in any call inside ``fn``."""
    return sorted(
        {
            ast.unparse(kw.value)
            for node in ast.walk(fn)
            if isinstance(node, ast.Call)
            for kw in node.keywords
            if kw.arg == keyword
        }
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

    from serving.sglang_plugin.contract import CLASSES, RELIED

    members: dict[str, Any] = {}
    for cls_name, cls_rel in sorted(CLASSES.items()):
        found = _class_members(src, tree, cls_rel, cls_name)
        members[f"{_module_name(cls_rel)}.{cls_name}"] = {
            name: found[name] for name in sorted(RELIED.get(cls_name, ())) if name in found
        }
    carrier: dict[str, Any] = {}
    for target, _ in MARKER_CARRIER:
        rel = next(r for r, q in TARGETS if f"{_module_name(r)}.{q}" == target)
        fn = _find(tree(rel), target[len(_module_name(rel)) + 1 :])
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        carrier[target] = _keyword_values(fn, "routing_key")
    req_init = _find(tree(SCHEDULE_BATCH), "Req.__init__")
    assert isinstance(req_init, ast.FunctionDef)
    carrier["sglang.srt.managers.schedule_batch.Req.__init__"] = [
        ast.unparse(node.value)
        for node in ast.walk(req_init)
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == "self.routing_key" for t in node.targets)
    ]

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
        "members": members,
        "marker_carrier": carrier,
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


def _check_hooks(functions: dict[str, Any]) -> list[str]:
    problems = []
    for target, expected in HOOK_POINTS.items():
        entry = functions.get(target)
        if entry is None:
            problems.append(f"{target}: missing")
            continue
        found = tuple((p["name"], p.get("default")) for p in entry["params"])
        if found != expected:
            problems.append(f"{target}: parameters {found}, the plugin's hook takes {expected}")
    return problems


def _check_called(functions: dict[str, Any]) -> list[str]:
    problems = []
    for target, (n_positional, keywords) in CALLED.items():
        entry = functions.get(target)
        if entry is None:
            problems.append(f"{target}: missing (the plugin calls it)")
            continue
        params = entry["params"][1:] if "self" in entry else entry["params"]
        positional = [p for p in params if p["kind"] in ("positional_only", "positional_or_keyword")]
        if len(positional) < n_positional and not any(p["kind"] == "var_positional" for p in params):
            problems.append(
                f"{target}: takes {len(positional)} positional arguments, the plugin passes {n_positional}"
            )
        required = [p["name"] for p in positional[n_positional:] if p.get("default") is None]
        if required:
            problems.append(f"{target}: requires {required}, which the plugin does not pass")
        names = {p["name"] for p in params}
        problems += [
            f"{target}: no parameter {k!r} (the plugin passes it)" for k in keywords if k not in names
        ]
    return problems


def _check_members(snapshot: dict[str, Any]) -> list[str]:
    from serving.sglang_plugin.contract import CLASSES, RELIED

    problems = []
    members = snapshot.get("members", {})
    for cls_name, cls_rel in CLASSES.items():
        have = members.get(f"{_module_name(cls_rel)}.{cls_name}", {})
        problems += [
            f"{cls_name}.{name}: not defined in SGLang (the plugin uses it)"
            for name in RELIED.get(cls_name, ())
            if name not in have
        ]
    carrier = snapshot.get("marker_carrier", {})
    for target, value in MARKER_CARRIER:
        if value not in carrier.get(target, []):
            problems.append(f"{target} no longer passes routing_key={value}: the marker would be lost")
    if "routing_key" not in carrier.get("sglang.srt.managers.schedule_batch.Req.__init__", []):
        problems.append("Req.__init__ no longer keeps routing_key: the marker would be lost")
    return problems


def _check_framework(snapshot: dict[str, Any]) -> list[str]:
    problems = []
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


def check_hook_points(snapshot: dict[str, Any]) -> list[str]:
    """What in ``snapshot`` breaks the plugin's assumptions (empty when nothing does): the hooks'
    parameters, what the plugin calls and uses (``contract.RELIED``), the marker's carrier, the plugin
    framework."""
    functions = snapshot.get("functions", {})
    return [
        *_check_hooks(functions),
        *_check_called(functions),
        *_check_members(snapshot),
        *_check_framework(snapshot),
    ]


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

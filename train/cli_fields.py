"""Command-line flags whose defaults come from a frozen config dataclass (one home per default).

``add_field(parser, GridSpec, "seeds", "--seeds", help=...)`` registers ``--seeds`` with ``dest``
``seeds``, the dataclass field's default as argparse default, and ``(default: N)`` appended to its help,
so ``--help`` always shows what a run without the flag does. A field whose default depends on another
flag (``--full``) passes ``alt=("--full", FULL_VALUE)``: the argparse default is then None, and
``resolve`` picks the dataclass default or the alternative.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass field ``name`` of ``cls`` (``KeyError`` for an unknown or required one)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def show(value: Any) -> str:
    """How a default reads in ``--help``: lists comma-separated, floats in ``%g``, None as ``none``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple | list):
        return ",".join(show(v) for v in value)
    return str(value)


def add_field(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    name: str,
    *flags: str,
    help: str,
    alt: tuple[str, Any] | None = None,
    default_text: str | None = None,
    **kwargs: Any,
) -> argparse.Action:
    """Register ``flags`` for field ``name`` of ``cls`` (see the module docstring).

    ``default_text`` replaces the shown default where the value alone would not say what runs (a
    default that depends on the trace, say). ``kwargs`` go to ``add_argument`` (``type``, ``metavar``,
    ``choices``, ``action``).
    """
    default = field_default(cls, name)
    shown = default_text if default_text is not None else show(default)
    if alt is not None:
        shown += f"; {alt[0]}: {show(alt[1])}"
    if kwargs.get("action") in ("store_true", "store_false"):
        return parser.add_argument(*flags, dest=name, default=default, help=help, **kwargs)
    return parser.add_argument(
        *flags,
        dest=name,
        default=None if alt is not None else default,
        help=f"{help} (default: {shown})",
        **kwargs,
    )


def resolve(args: argparse.Namespace, cls: type, name: str, alt_value: Any, use_alt: bool) -> Any:
    """The value of an ``alt`` field: the flag if given, else the alternative or the field default."""
    value = getattr(args, name)
    if value is not None:
        return value
    return alt_value if use_alt else field_default(cls, name)


__all__ = ["add_field", "field_default", "resolve", "show"]

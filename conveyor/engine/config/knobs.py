"""A knob's one declaration: its rule, its LLM(...) keyword and its CLI flag ride on
the config field itself (`Annotated[int, at_least(1, kwarg=True, flag=True)]`), so a
new knob is written once and the keyword map, the CLI options and the error texts
are derived from the structs (see `knob_table`)."""
from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec


def _any(_: Any) -> bool:
    return True


@dataclass(frozen=True)
class Knob:
    expect: str  # what a valid value is, as error messages say it
    ok: Callable[[Any], bool] = _any  # run after msgspec has checked the type
    kwarg: str | bool = False  # flat LLM(...) keyword: True = the field's name
    flag: str | bool = False  # CLI option: True = --field-name
    help: str = ""  # the CLI's help text (default: `expect`)
    cli_group: str | None = None  # "engine" or "serve" options (default: "serve" for the serve section)


def knob(expect: str, ok: Callable[[Any], bool] = _any, **kw: Any) -> Knob:
    return Knob(expect, ok, **kw)


def one_of(choices: tuple[Any, ...], **kw: Any) -> Knob:
    return Knob(f"one of {'/'.join(map(str, choices))}", lambda v: v in choices, **kw)


def at_least(lo: int, typ: str = "int", nullable: bool = False, **kw: Any) -> Knob:
    text = f"{typ} >= {lo}" + (" or null" if nullable else "")
    return Knob(text, lambda v: (v is None and nullable) or (v is not None and v >= lo), **kw)


def int_in(lo: int, hi: int, nullable: bool = False, **kw: Any) -> Knob:
    text = (f"null or an int in {lo}..{hi}" if nullable else f"int in {lo}..{hi}")
    return Knob(text, lambda v: (v is None and nullable) or (v is not None and lo <= v <= hi), **kw)


def finite_in(lo: float, hi: float, **kw: Any) -> Knob:
    # NaN fails both comparisons, so it is rejected with everything else.
    return Knob(f"float in [{lo:g}, {hi:g}]", lambda v: lo <= v <= hi, **kw)


@dataclass(frozen=True)
class KnobInfo:
    key: str  # "section.field"
    knob: Knob
    base_type: type  # int, float, str, bool or another (list, ...): what the CLI parses

    @property
    def kwarg(self) -> str | None:
        k = self.knob.kwarg
        return self.key.split(".")[1] if k is True else (k or None)

    @property
    def cli_group(self) -> str:
        return self.knob.cli_group or ("serve" if self.key.startswith("serve.") else "engine")

    @property
    def flag(self) -> str | None:
        f = self.knob.flag
        return "--" + self.key.split(".")[1].replace("_", "-") if f is True else (f or None)


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and args:
        hint = args[0]
    return hint if isinstance(hint, type) else object


def knob_table(root: type[msgspec.Struct]) -> dict[str, KnobInfo]:
    """Every annotated field of every section of `root`, keyed "section.field"."""
    out: dict[str, KnobInfo] = {}
    for section, sec_hint in typing.get_type_hints(root).items():
        for name, hint in typing.get_type_hints(sec_hint, include_extras=True).items():
            meta = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Knob)]
            if meta:
                key = f"{section}.{name}"
                out[key] = KnobInfo(key, meta[0], _base_type(typing.get_args(hint)[0]))
    return out

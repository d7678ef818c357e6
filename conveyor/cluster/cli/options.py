"""Command-line options that override engine config keys, shared by the
`conveyor` CLI and `python -m conveyor.cluster.batch`.

The options are derived from the config fields that declare a flag, so a knob
is declared once. Every option names the config key it overrides in its --help line, and every
override reaches the config as a dotted key path (`scheduler.max_num_seqs`),
which `conveyor.engine.config.load_config(path, **overrides)` merges over the file
before validation: an override is checked exactly like the file's own value.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from conveyor.engine.config import cli_knobs


@dataclass(frozen=True)
class Override:
    flag: str
    key: str  # dotted config key path
    type: Callable[[str], Any]
    help: str


def _bool(text: str) -> bool:
    v = yaml.safe_load(text)
    if not isinstance(v, bool):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return v


def _parser(base: type) -> Callable[[str], Any]:
    return {bool: _bool, int: int, float: float}.get(base, str)


def _overrides(serve: bool) -> tuple[Override, ...]:
    """The options of the config fields that declare a CLI flag (conveyor/engine/config/sections.py)."""
    return tuple(Override(str(i.flag), i.key, _parser(i.base_type), i.knob.help or i.knob.expect)
                 for i in cli_knobs() if (i.cli_group == "serve") == serve)


ENGINE_OVERRIDES: tuple[Override, ...] = _overrides(serve=False)
SERVE_OVERRIDES: tuple[Override, ...] = _overrides(serve=True)


def _dest(o: Override) -> str:
    return "ov_" + o.key.replace(".", "__")


def add_override_options(parser: argparse.ArgumentParser,
                         overrides: tuple[Override, ...] = ENGINE_OVERRIDES,
                         title: str = "engine config overrides") -> None:
    group = parser.add_argument_group(title)
    for o in overrides:
        metavar = o.flag.lstrip("-").split("-")[-1].upper()
        group.add_argument(o.flag, dest=_dest(o), type=o.type, default=None, metavar=metavar,
                           help=f"{o.help}; overrides {o.key}")


def add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="set_values", action="append", default=[],
                        metavar="KEY.PATH=VALUE",
                        help="override any config key, e.g. --set scheduler.max_num_seqs=64 "
                             "(VALUE is parsed as YAML; repeatable; applied after the options above)")


def parse_set(items: list[str]) -> dict[str, Any]:
    """["scheduler.max_num_seqs=64", "model.path=x"] -> {"scheduler.max_num_seqs": 64, ...}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or "." not in key or not key.replace(".", "").replace("_", "").isalnum():
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. scheduler.max_num_seqs=64")
        try:
            out[key] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            out[key] = text
    return out


def collect_overrides(args: argparse.Namespace,
                      overrides: tuple[Override, ...] = ENGINE_OVERRIDES) -> dict[str, Any]:
    """Dotted key -> value for every option that was given, then --set."""
    out = {o.key: getattr(args, _dest(o)) for o in overrides
           if getattr(args, _dest(o), None) is not None}
    out.update(parse_set(getattr(args, "set_values", []) or []))
    return out

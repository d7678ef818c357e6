"""Bounds on any JSON-shaped value a client sends, checked once at the edge.

A value that passes can cross every boundary inside: msgpack encodes it (no
integer past int64, no string that is not UTF-8), json.dumps, jinja's tojson
and the grammar compiler walk it without running out of stack (bounded
nesting). Python's json module accepts all three (`\\udc00` escapes decode to
lone surrogates, integers are unbounded, nesting goes to the recursion limit),
so the check is ours. It is iterative: it never recurses itself.
"""
from __future__ import annotations

from typing import Any

# Containers (objects and arrays) inside one value: far beyond any sensible
# schema or tool argument, far below the interpreter's recursion limit that
# json.dumps / tojson / pydantic reach at about 500-1000.
MAX_JSON_DEPTH = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class JSONLimitError(ValueError):
    """A value out of bounds; `path` names where (e.g. `stop[0]`)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


def utf8_problem(s: str) -> str | None:
    """Why `s` cannot be sent as UTF-8 (a lone surrogate), else None."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate (U+{ord(s[e.start]):04X}) at character {e.start}: not valid Unicode"
    return None


def check_json_value(value: Any, path: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise JSONLimitError for the first string or key that is not valid
    Unicode, integer outside int64, or container nested past max_depth.
    Paths are built only on an error (a 100k-token id list costs one pass)."""
    # (value, depth, parent node, key): the node chain names the path lazily.
    stack: list[tuple[Any, int, Any, Any]] = [(value, 0, None, path)]
    while stack:
        node = stack.pop()
        v, depth = node[0], node[1]
        if isinstance(v, str):
            problem = utf8_problem(v)
            if problem is not None:
                raise JSONLimitError(_path(node), f"string {problem}")
        elif isinstance(v, bool) or v is None or isinstance(v, float):
            continue
        elif isinstance(v, int):
            if not INT64_MIN <= v <= INT64_MAX:
                raise JSONLimitError(_path(node), f"integer {_short(v)} is outside the 64-bit range")
        elif isinstance(v, (dict, list, tuple)):
            if depth >= max_depth:
                raise JSONLimitError(_path(node), f"nested deeper than {max_depth} levels")
            if not isinstance(v, dict) and v and _flat_ints_ok(v):
                continue  # token ids: one pass in C
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str) and utf8_problem(k) is not None:
                    raise JSONLimitError(_path(node), f"key {utf8_problem(k)}")
                stack.append((item, depth + 1, node, k))


def _flat_ints_ok(v: list[Any] | tuple[Any, ...]) -> bool:
    """A list of plain ints, all in int64 (else the slow walk names the bad one)."""
    if not all(type(x) is int for x in v):
        return False
    return INT64_MIN <= min(v) and max(v) <= INT64_MAX


def _path(node: tuple[Any, int, Any, Any]) -> str:
    keys: list[Any] = []
    while node[2] is not None:
        keys.append(node[3])
        node = node[2]
    out = str(node[3])
    for k in reversed(keys[-8:] if len(keys) > 8 else keys):  # the outermost few name it
        out += f"[{k}]" if isinstance(k, int) else f".{k}"
    return out


def _short(v: int) -> str:
    return str(v) if v.bit_length() < 200 else f"of {v.bit_length()} bits"

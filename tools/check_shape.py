"""The code-shape gate of `make lint`: fails on any product file over
MAX_FILE_LINES lines, any function over MAX_FUNC_LINES lines, and any import
cycle between product modules. Every import counts, a function-local one
too: deferring an import hides a circle from Python, not from the reader.
Only imports under `if TYPE_CHECKING:` (never executed) do not count.

Standard library only, one pass of `ast` over the product packages (well
under a second). Usage: python tools/check_shape.py [--root DIR]. Entries of
tools/shape_allowlist.txt (one offence per line, as this script prints it)
are reported but do not fail; an entry that no longer matches is reported
as stale (remove it).
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = ("conveyor",)
MAX_FILE_LINES = 500
MAX_FUNC_LINES = 60
ALLOWLIST = Path(__file__).with_name("shape_allowlist.txt")

Graph = dict[str, set[str]]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def long_functions(rel: str, tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNC_LINES:
                out.append(f"function {rel}:{node.name} ({n} lines)")
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import in these statements, nested ones included, except the
    bodies of `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            out += _imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                part = getattr(node, field, None)
                if isinstance(part, list):
                    out += _imports([x for x in part if isinstance(x, ast.stmt)] +
                                    [s for h in part if isinstance(h, (ast.ExceptHandler, ast.match_case))
                                     for s in h.body])
    return out


def _targets(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        # `from pkg import sub` imports the submodule pkg.sub when there is one.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:  # `import a.b.c` of a non-module attribute
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def import_graph(root: Path, trees: dict[Path, ast.Module]) -> Graph:
    names = {p: module_name(root, p) for p in trees}
    known = set(names.values())
    graph: Graph = {}
    for path, tree in trees.items():
        mod = names[path]
        edges: set[str] = set()
        for node in _imports(tree.body):
            edges |= _targets(mod, path.name == "__init__.py", node, known)
        graph[mod] = edges - {mod}
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module
    (Tarjan), as a path that returns to its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(_path_within(graph, set(comp), min(comp)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path_within(graph: Graph, comp: set[str], start: str) -> list[str]:
    """The shortest cycle through `start` inside its component (BFS)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start, start]


def offences(root: Path) -> list[str]:
    trees: dict[Path, ast.Module] = {}
    out: list[str] = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = path.relative_to(root).as_posix()
            n = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
            if n > MAX_FILE_LINES:
                out.append(f"file {rel} ({n} lines)")
            trees[path] = tree = ast.parse(text, filename=rel)
            out += long_functions(rel, tree)
    out += ["cycle " + " -> ".join(c) for c in cycles(import_graph(root, trees))]
    return out


def _key(offence: str) -> str:
    """The part of an offence that names it (without its current size)."""
    return offence.split(" (")[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--allowlist", default=str(ALLOWLIST))
    args = ap.parse_args(argv)
    allow_path = Path(args.allowlist)
    allowed = set()
    if allow_path.is_file():
        allowed = {ln.split("#")[0].strip() for ln in allow_path.read_text().splitlines()}
        allowed.discard("")
    found = offences(Path(args.root))
    keys = {_key(o) for o in found}
    failing = [o for o in found if _key(o) not in allowed]
    stale = sorted(a for a in allowed if a not in keys)
    for o in found:
        print(("allowed: " if _key(o) in allowed else "") + o)
    for a in stale:
        print(f"stale allowlist entry (no longer found: remove it from {allow_path.name}): {a}")
    if failing:
        print(f"check_shape: {len(failing)} offence(s) (files <= {MAX_FILE_LINES} lines, "
              f"functions <= {MAX_FUNC_LINES}, no import cycle)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The suite's own layout stays true: tests/cpu/unit/ starts no Ray and builds no
model (`make test-fast` relies on it), and every entry of tests/conftest.py's
SLOW_TESTS names a test that exists (a renamed test would lose its mark)."""
from __future__ import annotations

import ast
import re

from repo_paths import ROOT

TESTS = ROOT / "tests"


def _slow_tests() -> set[str]:
    tree = ast.parse((TESTS / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SLOW_TESTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/conftest.py: no SLOW_TESTS")


def _test_functions(path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")}


def test_every_slow_entry_names_an_existing_test():
    entries = _slow_tests()
    assert len(entries) >= 20
    for entry in sorted(entries):
        base, name = entry.split("::")
        files = [p for p in TESTS.rglob(base) if "gpu" not in p.parts]
        assert len(files) == 1, f"{entry}: {len(files)} files named {base}"
        assert name.split("[")[0] in _test_functions(files[0]), f"{entry}: no such test in {files[0]}"


def test_unit_tests_start_no_ray_and_build_no_model():
    ray = re.compile(r"^\s*(?:import ray\b|from ray\b)|\bray_local\b|\bstart_node\(", re.M)
    model = re.compile(r"\bmake_checkpoint\(|\bmake_tiny_model\(|\btiny_(?:llama|mistral|qwen)|\bLLM\(|AsyncLLM\(\w+\)")
    files = sorted(f for f in (TESTS / "cpu" / "unit").glob("test_*.py") if f.name != "test_suite_layout.py")
    assert len(files) >= 20
    offenders = [(f.name, m.group(0)) for f in files for rx in (ray, model) for m in [rx.search(f.read_text())] if m]
    assert offenders == []

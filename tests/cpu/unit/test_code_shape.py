"""tools/check_shape.py (run by `make lint`): it finds long files, long
functions and import cycles, and the product tree passes it."""
from __future__ import annotations

import importlib.util

from repo_paths import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location("check_shape", ROOT / "tools" / "check_shape.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_checker_reports_long_files_long_functions_and_cycles(tmp_path):
    cs = _tool()
    (tmp_path / "conveyor").mkdir()
    (tmp_path / "conveyor" / "__init__.py").write_text("")
    pkg = tmp_path / "conveyor" / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from conveyor.engine import b\n\n\ndef f():\n" + "    x = 1\n" * 60)
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nfrom conveyor.engine.c import y\n"
                              "if TYPE_CHECKING:\n    from conveyor.engine import d\n")
    (pkg / "c.py").write_text("import conveyor.engine.a\ny = 1\n" + "\n" * 500)
    (pkg / "d.py").write_text("from conveyor.engine import b\n")  # b -> d only under TYPE_CHECKING
    (pkg / "e.py").write_text("def g():\n    from conveyor.engine import a\n")  # lazy: no edge
    found = cs.offences(tmp_path)
    assert "function conveyor/engine/a.py:f (61 lines)" in found
    assert "file conveyor/engine/c.py (502 lines)" in found
    assert "cycle conveyor.engine.a -> conveyor.engine.b -> conveyor.engine.c -> conveyor.engine.a" in found
    assert len(found) == 3, found


def test_the_product_tree_passes():
    assert _tool().main([]) == 0

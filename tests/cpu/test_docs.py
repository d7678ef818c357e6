"""The maps stay true: every repository path README.md, ARCHITECTURE.md and
docs/*.md name exists (a moved or deleted file fails here, not in a reader's
hands)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOPS = ("conveyor", "tests", "bench", "docs", "configs", ".ci", "tools")
_TOP = "|".join(re.escape(t) for t in TOPS)
PATH = re.compile(rf"(?<![\w/.-])((?:{_TOP})/[\w./-]*[\w/])")
EXAMPLES = {"configs/x.yaml"}  # README's example of a config with a mistake


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if doc.name == "benchmarks-history.md":  # the record of past rounds: paths as they were then
            continue
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                path = m.group(1).rstrip("/.")
                if path in EXAMPLES or any(c in path for c in "*{<"):
                    continue
                if not (ROOT / path).exists():
                    missing.append(f"{doc.name}:{i}: {path}")
    assert not missing, missing

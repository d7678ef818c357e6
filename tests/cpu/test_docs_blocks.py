"""Every fenced code block of README.md, BENCHMARKS.md and docs/*.md is run or checked, so
none goes stale (docs/benchmarks-history.md is the record of past rounds, not instructions:
left out); so is every command BENCHMARKS.md's tables give inline.

- python: every block compiles. The offline examples (no `OpenAI(` / `client.`) run, page by
  page in one namespace, in a directory holding the demo model as `demo_model/` and the
  repository's `configs/`. `LLM` there is the real class behind a pool that keeps one engine
  per distinct set of arguments, so examples with the same arguments share one model load
  (their `shutdown()` waits for the end of the module). Examples that talk to a server are
  compiled, and the routes their client calls are looked up in the app.
- sh / bash: every command is checked: `conveyor ...` and `python -m conveyor...` through the
  CLI's own argparse parsers, then its config with the command's overrides through the config
  loader; `make` targets in the Makefile; curl routes (and JSON bodies) in the app's route
  table; scripts exist and take the flags given; pip pins match constraints.txt; a heredoc'd
  batch file reads as batch input.
- yaml: an engine config loads through the config loader, a Serve config passes `conveyor config
  validate`, a KubeRay manifest or Ray cluster file parses. json parses. text: its `$ ` lines parse.
- A block that cannot run here (it needs a cluster, a cloud account, adapters on disk) carries
  `<!-- not run: REASON -->` on the line before its fence; the reason is required, and the
  commands of such a block that can be checked still are.
- Any other language fails.

The checks are in tests/cpu/docs_blocks_check.py; the last tests feed them known mistakes.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from docs_blocks_check import ROOT, Block, check_block, check_command, find_blocks, is_client_block, shell_commands

DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks-history.md")]
BLOCKS = [b for doc in DOCS for b in find_blocks(doc)]
MAX_MODEL_LOADS = 2  # the offline examples' engines, all pages together (~3 s each on 2 cores)


def _runnable(b: Block) -> bool:
    return b.lang == "python" and b.not_run is None and not is_client_block(b.text)


def _pages() -> list[str]:
    """Pages with offline examples, those that open the same engine next to each other."""
    pages: dict[str, str] = {}
    for b in filter(_runnable, BLOCKS):
        first_llm = next((ln.split("#")[0].strip() for ln in b.text.splitlines() if "LLM(" in ln or "LLM.from" in ln),
                         "")
        pages.setdefault(b.doc, first_llm)
    return sorted(pages, key=lambda d: (pages[d], d))


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.where}-{b.lang or 'none'}" for b in BLOCKS])
def test_block(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to the repository root
    problems = check_block(block)
    assert not problems, f"{block.where} ({block.lang} block): " + "; ".join(problems)


class EnginePool:
    """The `LLM` the examples see: the real class, one engine per distinct set of
    arguments, kept while the next example asks for the same (only one in-process
    engine may live at a time, so another set of arguments replaces it)."""

    def __init__(self, real: Any) -> None:
        self.real, self.key, self.llm, self.loads = real, None, None, 0
        pool = self

        class DocsLLM:
            def __init__(self, model: str | None = None, **kwargs: Any) -> None:
                self._llm = pool.get(("LLM", model, repr(sorted(kwargs.items()))),
                                     lambda: pool.real(model, **kwargs))

            @classmethod
            def from_config(cls, path: str, **overrides: Any) -> DocsLLM:
                obj = cls.__new__(cls)
                obj._llm = pool.get(("from_config", path, repr(sorted(overrides.items()))),
                                    lambda: pool.real.from_config(path, **overrides))
                return obj

            def __getattr__(self, name: str) -> Any:
                return getattr(self._llm, name)

            def shutdown(self) -> None:  # the pool's to do
                pass

            def __enter__(self) -> DocsLLM:
                return self

            def __exit__(self, *exc: Any) -> None:
                pass

        self.llm_class = DocsLLM

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        if key != self.key:
            self.close()
            self.llm, self.key = make(), key
            self.loads += 1
        return self.llm

    def close(self) -> None:
        llm, self.llm, self.key = self.llm, None, None
        if llm is not None:
            llm.shutdown()


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    import conveyor
    import conveyor.engine
    from conveyor.cluster.demo_model import ensure_demo_model

    work = tmp_path_factory.mktemp("docs_examples")
    ensure_demo_model(str(work / "demo_model"))  # the committed demo checkpoint, as `make run` puts it
    (work / "configs").symlink_to(ROOT / "configs")
    pool = EnginePool(conveyor.engine.LLM)
    mp = pytest.MonkeyPatch()
    for module in (conveyor, conveyor.engine):
        mp.setattr(module, "LLM", pool.llm_class, raising=False)
    mp.chdir(work)
    try:
        yield pool
    finally:
        mp.undo()
        pool.close()


@pytest.mark.parametrize("page", _pages())
def test_offline_examples_run(page: str, examples: EnginePool) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    for b in filter(_runnable, BLOCKS):
        if b.doc == page:
            try:
                exec(compile(b.text, b.where, "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{b.where}: the example fails: {type(e).__name__}: {e}") from e


def test_examples_load_few_models(examples: EnginePool) -> None:
    """Examples that need an engine share one where they can: write new ones with the
    arguments an earlier example already uses."""
    assert examples.loads <= MAX_MODEL_LOADS, f"the examples loaded {examples.loads} engines"


def test_blocks_not_run_say_why() -> None:
    skipped = [b for b in BLOCKS if b.not_run is not None]
    for b in skipped:
        print(f"not run: {b.where} ({b.lang}): {b.not_run}")
    assert all(b.not_run for b in skipped), [b.where for b in skipped if not b.not_run]


def test_benchmark_commands_name_real_scripts_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """BENCHMARKS.md's tables give each number's command inline: each must still run a real
    script with options it has."""
    monkeypatch.chdir(ROOT)
    problems, seen = [], 0
    prose = re.sub(r"^```.*?^```", "", (ROOT / "BENCHMARKS.md").read_text(), flags=re.M | re.S)  # blocks: test_block
    for span in re.findall(r"`([^`\n]+)`", prose):
        cmds, _ = shell_commands(span) if re.search(r"\bbench/\S+\.py\b|-m bench\.", span) else ([], [])
        for _, argv in cmds:
            found = check_command(argv)
            if found is not None:
                seen += 1
                problems += [f"`{span}`: {p}" for p in found]
    assert not problems, "\n".join(problems)
    assert seen >= 20, f"only {seen} commands found: is the table still read right?"


def test_configuration_reference_lists_every_key_with_its_default() -> None:
    import msgspec
    import yaml

    from conveyor.engine.config import EngineConfig, build_config

    block = next(b for b in find_blocks(ROOT / "docs" / "configuration.md")
                 if b.lang == "yaml" and b.text.startswith("# every key"))
    tree = yaml.safe_load(block.text)
    keys = {f"{s.name}.{f.name}" for s in msgspec.structs.fields(EngineConfig)
            for f in msgspec.structs.fields(s.type)}
    listed = {f"{section}.{key}" for section, fields in tree.items() for key in fields}
    assert listed == keys, {"missing": sorted(keys - listed), "not keys": sorted(listed - keys)}
    assert build_config(tree, source=block.where) == build_config({}), "a default differs from the code's"


# ---- the checks catch mistakes ------------------------------------------------------------------

MISTAKES = {
    "misspelled flag": ("sh", "conveyor serve configs/tiny-cpu.yaml --max-num-sqs 64"),
    "unknown subcommand": ("sh", "conveyor srve configs/tiny-cpu.yaml"),
    "unknown config key in --set": ("sh", "conveyor serve configs/tiny-cpu.yaml --set scheduler.max_num_seq=4"),
    "missing config file": ("sh", "conveyor generate configs/no-such.yaml --prompt hi"),
    "batch flag": ("sh", "python -m conveyor.cluster.batch --config configs/tiny-cpu.yaml --input i --output o "
                         "--data-paralel 2"),
    "missing module": ("sh", "python -m conveyor.cluster.no_such_module"),
    "make target": ("sh", "make tset"),
    "curl route": ("sh", "curl http://127.0.0.1:8000/v1/chat/complete -d '{}'"),
    "curl body": ("sh", "curl http://127.0.0.1:8000/v1/completions -d '{\"model\": \"tiny\", \"max_tokens\": \"many\"}'"),
    "script flag": ("sh", ".venv/bin/python bench/scheduler.py --no-such-flag"),
    "pin": ("sh", "pip install -c constraints.txt torch==0.0.1"),
    "unmarked cluster command": ("sh", "ray up configs/cluster/aws-gpu.yaml"),
    "batch line route": ("sh", "cat > in.jsonl <<'EOF'\n"
                               '{"custom_id": "a", "method": "POST", "url": "/v1/nope", "body": {}}\nEOF'),
    "config value": ("yaml", "scheduler: {max_num_seqs: ten}"),
    "config section": ("yaml", "schedular: {max_num_seqs: 1}"),
    "python syntax": ("python", "print("),
    "client base_url": ("python", "from openai import OpenAI\nclient = OpenAI(base_url=\"http://127.0.0.1:8000\")"),
    "unknown language": ("toml", "a = 1"),
    "transcript command": ("text", "$ conveyor config validat configs/x.yaml\nerror ..."),
    "json": ("json", "{'a': 1}"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_the_checks_catch_mistakes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    lang, text = MISTAKES[name]
    assert check_block(Block("x.md", 1, lang, text + "\n", None)), f"{name}: not caught"


def test_a_not_run_marker_needs_a_reason() -> None:
    assert check_block(Block("x.md", 1, "sh", "kubectl apply -f x.yaml\n", ""))
    assert not check_block(Block("x.md", 1, "sh", "kubectl apply -f x.yaml\n", "needs a cluster"))


def test_the_checks_pass_good_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    good = [("sh", "conveyor serve configs/tiny-cpu.yaml --max-num-seqs 64 --set serve.port=8001  # ok"),
            ("sh", "CI=true make test && curl http://127.0.0.1:8000/v1/models"),
            ("yaml", "scheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}"),
            ("text", "$ conveyor config validate configs/x.yaml\nerror ...")]
    for lang, text in good:
        assert not check_block(Block("x.md", 1, lang, text + "\n", None)), text
    assert re.search(r"\bnot run\b", (ROOT / "docs" / "cluster.md").read_text())  # the marker is in use

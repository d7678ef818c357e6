"""The checks behind tests/cpu/test_docs_blocks.py: find the fenced code blocks of a
markdown file, and check a shell, YAML, JSON or text block against the code as it is.

Each `check_*` returns a list of problems (empty: the block is fine). Nothing here
starts an engine, Ray or a server: commands are parsed with the CLI's own argparse
parsers, configs are loaded with the config loader, routes are looked up in the
app's route table (built over a stub server).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import io
import json
import re
import shlex
import tempfile
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[2]
LANGS = ("python", "sh", "bash", "shell", "yaml", "json", "text")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^`\s]*)\s*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run\b:?(?P<reason>.*?)-->\s*$")


@dataclass
class Block:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None  # the marker's reason ("" when the marker gives none); None: no marker

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def find_blocks(path: Path) -> list[Block]:
    """Every fenced block, with the `<!-- not run: REASON -->` marker of the line before its fence."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, start = m.group("indent"), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{path.name}:{start + 1}: the code block is never closed")
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = _NOT_RUN.match(prev)
        out.append(Block(str(path.relative_to(ROOT)), start + 1, m.group("lang"), "\n".join(body) + "\n",
                         marker.group("reason").strip() if marker else None))
        i += 1
    return out


# ---- the app's routes, the Makefile's targets, the project's pins -------------------------------

@functools.cache
def app_routes() -> list[tuple[str, re.Pattern[str], Any]]:
    """(method, path pattern, body model or None) of every route of the OpenAI app."""
    from types import SimpleNamespace

    from pydantic import BaseModel

    from conveyor.cluster.openai.app import build_api
    from conveyor.engine.config import build_config

    app = build_api(SimpleNamespace(config=build_config({})), api_key=None)  # type: ignore[arg-type]
    out = []
    for r in app.routes:
        pattern = re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", r.path) + "$")
        hints = typing.get_type_hints(r.endpoint) if inspect.isfunction(getattr(r, "endpoint", None)) else {}
        model = next((t for t in hints.values() if inspect.isclass(t) and issubclass(t, BaseModel)), None)
        for method in getattr(r, "methods", None) or ():
            out.append((method, pattern, model))
    return out


def check_route(method: str, url: str, body: Any = None) -> list[str]:
    path = urlparse(url).path if "://" in url else url
    hits = [model for m, pattern, model in app_routes() if m == method and pattern.match(path)]
    if not hits:
        return [f"{method} {path}: the app has no such route"]
    if body is not None and hits[0] is not None:
        try:
            hits[0].model_validate(body)
        except Exception as e:  # pydantic's ValidationError
            return [f"{method} {path}: the body does not validate: {e}"]
    return []


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


@functools.cache
def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            out[name.strip().lower()] = version.strip()
    return out


@functools.cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---- argparse parsers, run without exiting --------------------------------------------------

def _parse(parser: Any, argv: list[str]) -> tuple[Any, list[str]]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv), []
    except SystemExit as e:
        msg = err.getvalue().strip().splitlines()
        return None, [f"{' '.join(argv)}: {msg[-1] if msg else f'exit {e.code}'}"]


def _config_problems(load: Any) -> list[str]:
    from conveyor.engine.config import ConfigError

    try:
        load()
    except (ConfigError, ValueError) as e:
        return [str(e)]
    return []


def check_conveyor(argv: list[str], load_configs: bool = True) -> list[str]:
    """`conveyor ARGS`: the subcommand and its flags exist; the config (with the
    command's overrides) loads."""
    from conveyor.cluster.cli import main as cli
    from conveyor.cluster.cli.options import ENGINE_OVERRIDES, SERVE_OVERRIDES, collect_overrides
    from conveyor.engine.config import load_config

    args, bad = _parse(cli.build_parser(), argv)
    if bad or not load_configs:
        return bad
    if args.command in ("serve", "generate"):
        keys = SERVE_OVERRIDES + ENGINE_OVERRIDES if args.command == "serve" else ENGINE_OVERRIDES
        return _config_problems(lambda: load_config(args.config, **collect_overrides(args, keys)))
    if args.command == "batch":
        return check_batch_args(argv[1:])
    if args.command == "config":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.cmd_config_validate(args)
        return [f"conveyor config validate: {out.getvalue().strip()}"] if rc else []
    if args.command == "bench":
        return check_script(cli.BENCHES[args.name], args.args)
    return []


def check_batch_args(argv: list[str]) -> list[str]:
    from conveyor.cluster.batch import job
    from conveyor.cluster.cli.options import collect_overrides
    from conveyor.engine.config import load_config

    args, bad = _parse(job.build_parser(), argv)
    if bad:
        return bad
    return _config_problems(lambda: load_config(args.config, **collect_overrides(args, job.ENGINE_AND_NAME)))


def check_script(path: str, argv: list[str]) -> list[str]:
    """A script of the checkout: it exists, and every --flag passed is spelled in its
    source or in a module of the checkout it imports (`from bench.lib import ...`)."""
    f = ROOT / path
    if not f.is_file():
        return [f"{path}: no such script"]
    source = "".join(p.read_text() for p in _with_local_imports(f))
    return [f"{path}: no option {a.split('=')[0]!r} in its source" for a in argv
            if a.startswith("--") and f'"{a.split("=")[0]}"' not in source]


def _with_local_imports(f: Path) -> list[Path]:
    import ast

    out = [f]
    for node in ast.walk(ast.parse(f.read_text())):
        names = ([node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            base = ROOT.joinpath(*name.split("."))
            out += [p for p in (base.with_suffix(".py"), base / "__init__.py") if name and p.is_file()]
    return out


def check_python_m(module: str, argv: list[str]) -> list[str]:
    if importlib.util.find_spec(module) is None:
        return [f"python -m {module}: no such module"]
    if module.split(".")[0] in ("bench", "tools"):  # the checkout's scripts, run as modules
        base = ROOT.joinpath(*module.split("."))
        main = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__main__.py"
        return check_script(str(main.relative_to(ROOT)), argv)
    if module in ("conveyor.cluster.cli", "conveyor.cluster.cli.main"):
        return check_conveyor(argv)
    if module == "conveyor.cluster.batch":
        return check_batch_args(argv)
    if module == "conveyor.cluster.demo":
        from conveyor.cluster.demo import run

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                run._parse(argv)
        except SystemExit:
            return [f"python -m {module} {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1:]}"]
    return []


# ---- shell blocks ---------------------------------------------------------------------------

PYTHONS = ("python", "python3", ".venv/bin/python")
PLAIN = ("cd", "export", "source", "git", "echo", "cat", "mkdir", "cp", "ls")  # nothing to check
_SEPARATORS = ("&&", "||", ";", "|", "&")
_REDIRECTS = (">", ">>", "<", "2>", "&>")


def shell_commands(text: str) -> tuple[list[tuple[int, list[str]]], list[tuple[str, str]]]:
    """(line, argv) of each simple command, with comments, `NAME=value` prefixes and
    redirections removed and continuation lines joined; and each heredoc as (file, content)."""
    lines = text.splitlines()
    cmds: list[tuple[int, list[str]]] = []
    heredocs: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i]
        i += 1
        here = re.search(r"<<-?\s*(['\"]?)(\w+)\1", line)
        if here:
            end = next((j for j in range(i, len(lines)) if lines[j].strip() == here.group(2)), None)
            if end is None:
                raise ValueError(f"heredoc {here.group(2)} is never closed")
            target = re.search(r">\s*(\S+)", line[:here.start()])
            heredocs.append((target.group(1) if target else "", "\n".join(lines[i:end]) + "\n"))
            line, i = line[:here.start()], end + 1
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        argv: list[str] = []
        for tok in [*lex, ";"]:
            if tok not in _SEPARATORS:
                argv.append(tok)
                continue
            while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                argv.pop(0)  # NAME=value before the command
            argv = [a for k, a in enumerate(argv) if a not in _REDIRECTS and (k == 0 or argv[k - 1] not in _REDIRECTS)]
            if argv:
                cmds.append((start + 1, argv))
            argv = []
    return cmds, heredocs


def check_command(argv: list[str], parse_only: bool = False) -> list[str] | None:
    """Problems of one command; None when this checker does not know the command."""
    cmd, rest = argv[0], argv[1:]
    if cmd in ("conveyor", ".venv/bin/conveyor"):
        return check_conveyor(rest, load_configs=not parse_only)
    if cmd in PYTHONS:
        if rest[:1] == ["-m"] and len(rest) > 1:
            return check_python_m(rest[1], rest[2:])
        return check_script(rest[0], rest[1:]) if rest and rest[0].endswith(".py") else None
    if cmd == "make":
        return [f"make {t}: no such target in the Makefile" for t in rest
                if not t.startswith("-") and "=" not in t and t not in make_targets()]
    if cmd == "curl":
        return check_curl(rest)
    if cmd == "serve" and rest[:1] == ["run"] and len(rest) > 1:  # Ray Serve's CLI
        return check_conveyor(["config", "validate", rest[1]])
    if cmd == "bash" and rest:
        return [] if (ROOT / rest[0]).is_file() else [f"bash {rest[0]}: no such file"]
    if cmd in ("pip", ".venv/bin/pip"):
        return check_pip(rest)
    return [] if cmd in PLAIN else None


def check_curl(argv: list[str]) -> list[str]:
    method, data, url = None, None, None
    it = iter(argv)
    for a in it:
        if a in ("-X", "--request"):
            method = next(it, "")
        elif a in ("-d", "--data", "--data-raw", "--json"):
            data = next(it, "")
        elif a in ("-H", "--header", "-o", "--output"):
            next(it, None)
        elif a.startswith("http"):
            url = a
    if url is None:
        return ["curl: no URL"]
    try:
        body = json.loads(data) if data else None
    except ValueError as e:
        return [f"curl {url}: the body is not JSON: {e}"]
    return check_route(method or ("POST" if data is not None else "GET"), url, body)


def check_pip(argv: list[str]) -> list[str]:
    if argv[:1] != ["install"]:
        return [] if argv[:1] == ["wheel"] else [f"pip {' '.join(argv)}: not a command these docs use"]
    out, constrained, it = [], False, iter(argv[1:])
    version = pyproject()["project"]["version"]
    extras = pyproject()["project"].get("optional-dependencies", {})
    for a in it:
        if a == "-c":
            f = next(it, "")
            constrained = True
            out += [] if (ROOT / f).is_file() else [f"pip install -c {f}: no such file"]
        elif a == "-e":
            wanted = re.findall(r"\[(.*)\]", next(it, ""))
            out += [f"pip install -e: no extra {x!r} in pyproject.toml"
                    for x in (wanted[0].split(",") if wanted else ()) if x not in extras]
        elif a.endswith(".whl"):
            m = re.match(r".*conveyor-([^-]+)-", a)
            out += [] if m and m.group(1) == version else [f"{a}: the project's version is {version}"]
        elif "==" in a and constrained:
            name, _, v = a.partition("==")
            if pins().get(name.lower()) != v:
                out.append(f"{a}: constraints.txt pins {name}=={pins().get(name.lower())}")
    return out


def check_heredoc(name: str, content: str) -> list[str]:
    if name.endswith(".jsonl"):  # an OpenAI Batch input file
        from conveyor.cluster.batch.job import BatchInputError, read_batch_input

        with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
            f.write(content)
            f.flush()
            try:
                lines = read_batch_input(f.name)
            except BatchInputError as e:
                return [str(e)]
        return [p for ln in lines for p in check_route(ln.obj.get("method", "POST"), ln.obj.get("url", ""),
                                                       ln.obj.get("body"))]
    if name.endswith((".yaml", ".yml")):
        return check_yaml(content, name)
    return []


def check_shell(text: str, not_run: bool) -> list[str]:
    try:
        cmds, heredocs = shell_commands(text)
    except ValueError as e:
        return [str(e)]
    out = [p for name, content in heredocs for p in check_heredoc(name, content)]
    for line, argv in cmds:
        problems = check_command(argv)
        if problems is None and not not_run:
            out.append(f"line {line}: `{argv[0]}` is no command this test can check: mark the block "
                       "<!-- not run: REASON --> if it needs something CI does not have")
        out += [f"line {line}: {p}" for p in problems or ()]
    return out


# ---- YAML, JSON, text and Python blocks --------------------------------------------------------

def check_yaml(text: str, where: str) -> list[str]:
    """A Conveyor engine config loads through the config loader; a Serve config passes
    `conveyor config validate`; a Kubernetes / KubeRay manifest or a Ray cluster file only parses."""
    import yaml

    from conveyor.engine.config import build_config

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"not YAML: {e}"]
    if not isinstance(doc, dict):
        return [f"expected a mapping, got {type(doc).__name__}"]
    if {"apiVersion", "kind", "cluster_name"} & doc.keys():
        return []
    if "applications" in doc:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:  # its config paths: from the cwd
            f.write(text)
            f.flush()
            return check_conveyor(["config", "validate", f.name])
    return _config_problems(lambda: build_config(doc, source=where))


def check_text(text: str) -> list[str]:
    """Output shown as text; its `$ command` lines must still parse."""
    out = []
    for line in text.splitlines():
        if line.startswith("$ "):
            cmds, _ = shell_commands(line[2:])
            out += [p for _, argv in cmds for p in check_command(argv, parse_only=True) or ()]
    return out


def check_json(text: str) -> list[str]:
    try:
        json.loads(text)
    except ValueError as e:
        return [f"not JSON: {e}"]
    return []


_CLIENT_CALLS = {  # the OpenAI client's methods -> the route each one calls
    r"client\.chat\.completions\.(create|parse|stream)\(": ("POST", "/v1/chat/completions"),
    r"client\.completions\.create\(": ("POST", "/v1/completions"),
    r"client\.responses\.create\(": ("POST", "/v1/responses"),
    r"client\.responses\.retrieve\(": ("GET", "/v1/responses/x"),
    r"client\.responses\.delete\(": ("DELETE", "/v1/responses/x"),
    r"client\.models\.list\(": ("GET", "/v1/models"),
}


def is_client_block(text: str) -> bool:
    """An example that talks to a running server (compiled and its routes checked, not run)."""
    return "OpenAI(" in text or re.search(r"\bclient\.", text) is not None


def check_client_calls(text: str) -> list[str]:
    out = [p for pattern, (method, path) in _CLIENT_CALLS.items() if re.search(pattern, text)
           for p in check_route(method, path)]
    for base in re.findall(r"base_url=\"([^\"]+)\"", text):
        out += [] if base.rstrip("/").endswith("/v1") else [f"base_url {base}: the API is under /v1"]
    return out


def check_block(b: Block) -> list[str]:
    """Every check of one block that needs no engine (Python blocks: compiled here, run by the test)."""
    if b.lang not in LANGS:
        return [f"unknown language {b.lang!r} (known: {', '.join(LANGS)}): add a check for it"]
    if b.not_run == "":
        return ["a <!-- not run --> marker must say why: <!-- not run: REASON -->"]
    if b.lang == "python":
        try:
            compile(b.text, b.where, "exec")
        except SyntaxError as e:
            return [f"does not compile: {e}"]
        return check_client_calls(b.text) if is_client_block(b.text) else []
    if b.lang in ("sh", "bash", "shell"):
        return check_shell(b.text, not_run=b.not_run is not None)
    if b.not_run is not None:
        return []
    return {"yaml": check_yaml, "json": lambda t, w: check_json(t),
            "text": lambda t, w: check_text(t)}[b.lang](b.text, b.where)

"""Offline batch inference over an OpenAI Batch JSONL file.

    python -m conveyor.cluster.batch --config configs/X.yaml --input in.jsonl --output out.jsonl
    conveyor batch --config configs/X.yaml --input in.jsonl --output out.jsonl
    ray job submit --working-dir . -- python -m conveyor.cluster.batch --config configs/X.yaml \\
        --input /data/in.jsonl --output /data/out.jsonl [--data-parallel 2]

Input lines: {"custom_id", "method": "POST", "url": "/v1/completions" |
"/v1/chat/completions", "body": {...}}. Output lines, in completion order:
{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}
with the HTTP API's own response bodies (each line runs through the same
OpenAIServer request handling as a POST to the URL, in process).

Invariants:
- The whole input is checked before any work: unparseable JSON, a line that is
  not an object, a missing/empty `custom_id` or a duplicate one fails the job
  with the line number. Everything else wrong with a line (url, method, body,
  sampling params, context length) becomes that line's error record.
- The output file only ever grows by complete lines: one write of a whole line,
  then fsync. A run killed mid-write leaves at most a trailing partial line,
  which the next run truncates; custom_ids already in the file are skipped, so
  a killed job resumes without repeating or losing a line.
- A dead engine fails the job (nothing is written for the lines in flight);
  it never turns into per-line error records that a rerun would skip.
- At most `max_in_flight` lines per engine are in the engine at once
  (default 2 × scheduler.max_num_seqs): memory stays bounded on big files.

Two ways to run N engines, never both at once (refused):
- `--data-parallel N`: N independent jobs in one, each engine an actor with its
  own placement group and its own share of the lines. No router, no
  migration: the right tool for throughput over a big file on a cluster,
  where each engine can land on any node.
- `parallel.data_parallel_size: N` in the config: N engines behind one
  frontend and the router (prefix-aware routing, requests migrate off a lost
  engine). The right tool when lines share long prefixes (few-shot
  templates) or when one host runs every engine.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from conveyor.cluster.batch.engines import ActorEngine, Engine, LineRunner, LocalEngine
from conveyor.cluster.batch.token_journal import LineJournal, journal_path, merge_journals
from conveyor.cluster.cli.options import (
    ENGINE_OVERRIDES,
    SERVE_OVERRIDES,
    add_override_options,
    add_set_option,
    collect_overrides,
)
from conveyor.engine.config import ConfigError, EngineConfig, check_cluster_fits, load_config
from conveyor.engine.errors import EngineDeadError

log = logging.getLogger("conveyor.batch")

BATCH_SERVE_OVERRIDES = tuple(o for o in SERVE_OVERRIDES if o.key == "serve.served_model_name")
ENGINE_AND_NAME = ENGINE_OVERRIDES + BATCH_SERVE_OVERRIDES


class BatchInputError(ValueError):
    """The job cannot start: bad input file (with the line number) or output file."""


# ---- input ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchLine:
    lineno: int
    custom_id: str
    obj: dict[str, Any]


def read_batch_input(path: str) -> list[BatchLine]:
    """All request lines of `path` (blank lines skipped), or BatchInputError."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BatchInputError(f"{path}: cannot read the input: {e.strerror}") from None
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise BatchInputError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise BatchInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise BatchInputError(f"{where}: missing custom_id (a non-empty string is required)")
        if cid in seen:
            raise BatchInputError(f"{where}: duplicate custom_id {cid!r} (first on line {seen[cid]})")
        seen[cid] = lineno
        lines.append(BatchLine(lineno, cid, obj))
    return lines


# ---- output --------------------------------------------------------------------------

class OutputLog:
    """Append-only JSONL output, durable one complete line at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1

    def open(self) -> set[str]:
        """Open for appending after dropping a trailing partial line (a write
        cut short by a kill); returns the custom_ids already written."""
        existed = os.path.exists(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        with open(self.path, "rb") as f:
            data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            log.warning("%s: dropping a partial last line (%d bytes) from an interrupted run",
                        self.path, len(data) - keep)
            os.ftruncate(fd, keep)
            os.fsync(fd)
        if not existed:  # make the new directory entry durable too
            dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._fd = fd
        return self.done_ids(self.path, data[:keep])

    @staticmethod
    def done_ids(path: str, data: bytes | None = None) -> set[str]:
        """custom_ids of the complete lines of an output file (read-only)."""
        if data is None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return set()
            data = data[:data.rfind(b"\n") + 1]
        done: set[str] = set()
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                cid = json.loads(raw)["custom_id"]
            except (ValueError, KeyError, TypeError):
                raise BatchInputError(f"{path}:{lineno}: not a batch output line; the output "
                                      f"file must be new or one this job wrote") from None
            done.add(cid)
        return done

    def append(self, record: dict[str, Any]) -> None:
        # backslashreplace: a lone surrogate (a custom_id the input's JSON
        # escaped as \udc00) is written as that same JSON escape, so the line
        # is valid UTF-8 JSON and a rerun reads the same custom_id back.
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        data = memoryview(text.encode("utf-8", "backslashreplace"))
        while data:  # O_APPEND: every write lands at the end
            n = os.write(self._fd, data)
            data = data[n:]
        os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ---- progress and summary --------------------------------------------------------------

@dataclass
class Summary:
    total: int
    skipped: int = 0
    ok: int = 0
    errors: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.elapsed, 1e-9)

    def add(self, record: dict[str, Any]) -> None:
        if record["error"] is None:
            self.ok += 1
            usage = record["response"]["body"].get("usage") or {}
            self.completion_tokens += int(usage.get("completion_tokens", 0))
        else:
            self.errors += 1

    def line(self, output: str) -> str:
        return (f"batch: {self.ok} ok, {self.errors} errors, {self.skipped} already done "
                f"(of {self.total}) in {self.elapsed:.1f}s; {self.completion_tokens} tokens generated "
                f"({self.tokens_per_s:.1f} tok/s) -> {output}")


class Progress:
    """tqdm bar: lines done (ETA from tqdm's rate) and generated tokens/s."""

    def __init__(self, summary: Summary, enabled: bool) -> None:
        self.summary = summary
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=summary.total, initial=summary.skipped, unit="line",
                            desc="batch", dynamic_ncols=True, file=sys.stderr,
                            mininterval=0.5 if sys.stderr.isatty() else 5.0)

    def update(self, record: dict[str, Any]) -> None:
        self.summary.add(record)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.summary.tokens_per_s:.0f} tok/s, "
                                     f"{self.summary.errors} errors", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- driving ------------------------------------------------------------------------------

async def drive(engines: list[Engine], lines: list[BatchLine], out: OutputLog,
                progress: Progress) -> None:
    """Deal lines to engines through one queue (a free lane takes the next
    line, so a fast engine takes more); each engine has max_in_flight lanes."""
    queue = collections.deque(lines)

    async def lane(engine: Engine) -> None:
        while queue:
            line = queue.popleft()
            record = await engine.run(line.obj)
            out.append(record)
            progress.update(record)

    tasks = [asyncio.create_task(lane(e)) for e in engines for _ in range(max(1, e.max_in_flight))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def absolute_paths(config: EngineConfig) -> EngineConfig:
    """Engines may run in other processes and directories (Ray actors, a job's
    working-dir copy): pin relative checkpoint paths to this directory."""
    m = config.model
    model = msgspec.structs.replace(
        m, path=os.path.abspath(m.path) if m.path else m.path,
        tokenizer=os.path.abspath(m.tokenizer) if m.tokenizer else m.tokenizer)
    return msgspec.structs.replace(config, model=model)


def init_ray(address: str | None, local_cpus: int = 1) -> bool:
    """Connect to Ray (address, RAY_ADDRESS) or start a local instance; True
    if started. A local instance gets at least `local_cpus` logical CPUs, so
    the engines' CPU bundles fit on a small machine (they oversubscribe)."""
    import ray

    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, include_dashboard=False)
        return False
    ray.init(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, local_cpus))
    return True


async def _start_engines(config: EngineConfig, data_parallel: int, max_in_flight: int,
                         journal: str | None = None) -> list[Engine]:
    if data_parallel == 1:
        runner = await asyncio.get_running_loop().run_in_executor(None, LineRunner.start, config, journal)
        return [LocalEngine(runner, max_in_flight)]
    engines = [ActorEngine(config, i, max_in_flight, journal) for i in range(data_parallel)]
    try:
        await asyncio.gather(*(e.ready() for e in engines))
    except BaseException:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        raise
    return list(engines)


async def run_batch(config: EngineConfig, input_path: str, output_path: str, *,
                    data_parallel: int = 1, max_in_flight: int | None = None,
                    progress: bool = True) -> Summary:
    """The whole job; BatchInputError before any work if the files are bad."""
    if os.path.abspath(input_path) == os.path.abspath(output_path):
        raise BatchInputError(f"{output_path}: the output must not be the input file")
    lines = read_batch_input(input_path)
    out = OutputLog(output_path)
    done = out.open()
    try:
        pending = [ln for ln in lines if ln.custom_id not in done]
        summary = Summary(total=len(lines), skipped=len(lines) - len(pending))
        if not pending:
            return summary
        jpath = journal_path(output_path)
        if data_parallel > 1:  # one merged journal for every engine to resume from
            written = {LineJournal.line_id(ln.obj) for ln in lines if ln.custom_id in done}
            kept = merge_journals(jpath, lambda k: LineJournal.line_of(k) not in written)
            if kept:
                log.info("%s: %d tokens of unfinished lines journaled by an earlier run", jpath, kept)
        engines = await _start_engines(config, data_parallel,
                                       max_in_flight or 2 * config.scheduler.max_num_seqs, jpath)
        journal = getattr(engines[0], "runner", None) and engines[0].runner.journal
        if journal is not None:  # written lines need no tokens kept (conveyor/cluster/batch/token_journal.py)
            journal.forget_lines([ln.obj for ln in lines if ln.custom_id in done])
        bar = Progress(summary, progress)
        summary.started = time.monotonic()  # engine start-up is not in the rate
        try:
            await drive(engines, pending, out, bar)
        finally:
            bar.close()
            await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        if data_parallel > 1:  # every line written: the merged journal is done with
            merge_journals(jpath, lambda k: False)
        return summary
    finally:
        out.close()


# ---- command line -----------------------------------------------------------------------

def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="engine config YAML (see configs/)")
    p.add_argument("--input", required=True, help="OpenAI Batch JSONL input file")
    p.add_argument("--output", required=True,
                   help="JSONL output file; rerunning with the same file resumes (skips done custom_ids)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N engines (Ray actors, one placement group each) sharing the lines")
    p.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                   help="lines in flight per engine (default: 2 × scheduler.max_num_seqs)")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: $RAY_ADDRESS, else a new local instance); "
                        "used with executor ray or --data-parallel > 1")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_override_options(p)
    add_override_options(p, BATCH_SERVE_OVERRIDES, "response overrides")
    add_set_option(p)


def build_parser(prog: str = "python -m conveyor.cluster.batch") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_batch_arguments(p)
    return p


def run_from_args(args: argparse.Namespace) -> int:
    """Exit codes: 0 done, 1 the engine/job failed, 2 bad config or input."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.data_parallel < 1:
            raise BatchInputError(f"--data-parallel: expected an int >= 1, got {args.data_parallel}")
        overrides = collect_overrides(args, ENGINE_AND_NAME)
        config = absolute_paths(load_config(args.config, **overrides))
        if args.data_parallel > 1 and config.parallel.data_parallel_size > 1:
            raise BatchInputError(
                f"--data-parallel {args.data_parallel} with parallel.data_parallel_size "
                f"{config.parallel.data_parallel_size}: choose one (--data-parallel: independent engines, "
                "each with its share of the lines; data_parallel_size: engines behind one router)")
        # Fail on a bad file before starting Ray; start nothing if all is done.
        if os.path.abspath(args.input) == os.path.abspath(args.output):
            raise BatchInputError(f"{args.output}: the output must not be the input file")
        lines = read_batch_input(args.input)
        done = OutputLog.done_ids(args.output)
    except ValueError as e:  # ConfigError, BatchInputError, a malformed --set
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = any(ln.custom_id not in done for ln in lines)
    needs_ray = work and (config.core_in_actor() or config.parallel.executor == "ray" or args.data_parallel > 1)
    started = False
    try:
        if needs_ray:
            import ray

            per_engine = 1 + (config.world_size if config.parallel.executor == "ray" else 0)
            started = init_ray(args.address, local_cpus=args.data_parallel * per_engine)
            check_cluster_fits(config, ray.cluster_resources().get("GPU", 0),
                               copies=args.data_parallel, source=args.config)
        summary = asyncio.run(run_batch(config, args.input, args.output,
                                        data_parallel=args.data_parallel,
                                        max_in_flight=args.max_in_flight,
                                        progress=not args.no_progress))
    except (ConfigError, BatchInputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineDeadError as e:
        print(f"error: {e}; rerun the same command to resume from {args.output}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the job failed; finished lines are kept
        log.exception("batch job failed")
        print(f"error: batch job failed ({type(e).__name__}: {e}); rerun the same command to "
              f"resume from {args.output}", file=sys.stderr)
        return 1
    finally:
        if started:
            import ray

            ray.shutdown()
    print(summary.line(args.output), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))

"""A long-lived engine process that times one generate() per request, and
the line protocol between it and the benchmark driving it: the child warms
up, prints READY, then for each stdin line "I [SIDE]" times run I and prints
"RESULT <json>", until "quit". Ours and vLLM's sides speak the same protocol
(bench/spec_decode.py, bench/peers/spec_decode_peer.py), so engines start
once (a vLLM engine takes about a minute here) and calls interleave.

Standard library only: the peer's Python imports it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any


def serve_loop(call: Callable[[int, str], dict[str, Any]]) -> None:
    """The child's side: READY, then one RESULT line per request line."""
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        i, _, side = line.partition(" ")
        print("RESULT " + json.dumps(call(int(i), side.strip())), flush=True)


def spec_result(wall: float, outs: list[Any], counters: dict[str, float], prefix: str) -> dict[str, Any]:
    """tok/s, speculative acceptance and a digest of the tokens of one
    generate() call; ``counters`` are the call's increments of the engine's
    spec_decode_* counters, named under ``prefix`` ("conveyor:", "vllm:")."""
    drafts = counters.get(prefix + "spec_decode_num_draft_tokens", 0.0)
    acc = counters.get(prefix + "spec_decode_num_accepted_tokens", 0.0)
    steps = counters.get(prefix + "spec_decode_num_drafts", 0.0)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(wall_s=wall, output_tokens=n_out, tok_s=n_out / wall, draft_tokens=drafts,
                accepted_tokens=acc, acceptance_rate=acc / drafts if drafts else 0.0,
                mean_acceptance_length=1.0 + acc / steps if steps else 1.0,
                digest=hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) & 0xFFFFFFFF)


class SideProcess:
    """The driver's handle on one child: ``argv`` + the config JSON's path;
    idle, the child blocks on its stdin."""

    def __init__(self, argv: list[str], cfg: dict[str, Any], env: dict[str, str]) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        cfg_path = os.path.join(self._tmp.name, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        self._err = open(os.path.join(self._tmp.name, "stderr.txt"), "w+")
        self.cmd = [*argv, cfg_path]
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, env={**os.environ, **env})

    def wait_ready(self) -> None:
        """Block until the child has warmed up (READY)."""
        self._read("READY")

    def run(self, i: int, side: str = "") -> dict[str, Any]:
        """Time run i in the child (``side`` goes along: "plain" or "")."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{i} {side}\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # vLLM logs to stdout too: skip other lines
            if line.startswith(prefix):
                return line[len(prefix):]
        self._err.seek(0)
        raise RuntimeError(f"side exited (rc {self.proc.wait()}): {' '.join(self.cmd)}\n"
                           f"{self._err.read()[-3000:]}")

    def close(self) -> None:
        """Ask the child to quit and wait for it; remove its files."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        self._err.close()
        self._tmp.cleanup()

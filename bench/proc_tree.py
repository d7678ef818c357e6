"""A process and everything below it, read from /proc (stdlib only: the vLLM
peer's venv imports it too, from bench/vllm_offline_peer.py)."""
from __future__ import annotations

import os
import re

# vLLM's native kernel builds: _C (AVX-512 + bf16), _C_AVX512, _C_AVX2.
_VLLM_LIB = re.compile(r"/vllm/(_C\w*)\.[\w.-]*so")


def descendants(root: int) -> list[int]:
    """root and every process below it (by /proc parent links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def vllm_libs(root: int) -> list[str]:
    """vLLM's kernel libraries mapped by root and the processes below it (its
    engine core, the core's worker): which build a run really used."""
    found: set[str] = set()
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/maps") as f:
                found.update(_VLLM_LIB.findall(f.read()))
        except OSError:
            continue
    return sorted(found)

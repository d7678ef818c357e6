"""Processes read from /proc: a process and everything below it, the Ray
processes of a served app, their memory and CPU time, and the vLLM kernel
libraries a peer mapped. Standard library only: the vLLM peer's venv imports
it too (bench/peers/vllm_offline_peer.py).
"""
from __future__ import annotations

import os
import re

# vLLM's native kernel builds: _C (AVX-512 + bf16), _C_AVX512, _C_AVX2.
_VLLM_LIB = re.compile(r"/vllm/(_C\w*)\.[\w.-]*so")
# The Ray processes that make up a served Conveyor app, by process title.
SERVER_TITLES = (b"ServeReplica", b"EngineCoreActor", b"ProxyActor", b"ServeController")


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def parent_of(pid: int) -> int | None:
    """The parent's pid (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> bytes:
    """The raw command line (arguments NUL-separated; b"" when gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(root: int) -> list[int]:
    """root and every process below it (by /proc parent links)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        ppid = parent_of(pid)
        if ppid is not None:
            children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def worker_pids(title: bytes = b"ray::RayWorkerActor") -> list[int]:
    """Processes below this one whose title starts with ``title``: the Ray
    worker ranks of an engine this process started (what a kill fault picks
    from). Another process's Ray instance is never included."""
    mine = set(descendants(os.getpid()))
    return sorted(p for p in mine if cmdline(p).startswith(title))


def ray_server_pids(titles: tuple[bytes, ...] = SERVER_TITLES) -> dict[int, str]:
    """pid -> title of the Ray processes of a served app (replica, engine
    actor, proxy, controller) on this machine."""
    out = {}
    for pid in _pids():
        cmd = cmdline(pid)
        if cmd.startswith(b"ray::") and any(t in cmd for t in titles):
            out[pid] = cmd.split(b"\0")[0].decode(errors="replace")
    return out


def rss_kib(pids: list[int] | dict[int, str]) -> dict[int, int]:
    """Resident set size of each process in KiB (0 when it is gone, which a
    growth check will not hide)."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                out[pid] = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            out[pid] = 0
    return out


def cpu_seconds(pid: int) -> tuple[str, float] | None:
    """(process title, user + system CPU seconds) of one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    title = cmdline(pid).replace(b"\0", b" ").decode(errors="replace").strip()
    return title[:60], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def short_title(title: str) -> str:
    """A process title shortened for a table (Ray's ``ray::Name`` as is)."""
    words = title.split()
    if not words or "::" in words[0]:
        return words[0] if words else "?"
    return " ".join(os.path.basename(w) for w in words[:3])


def cpu_snapshot(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (title, CPU seconds) of root and everything below it."""
    snap = {}
    for pid in descendants(root):
        v = cpu_seconds(pid)
        if v is not None:
            snap[pid] = v
    return snap


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
              wall_s: float) -> list[tuple[str, float]]:
    """Share of one core per process between two snapshots, busiest first (> 2%)."""
    rows = [(title, (cpu - before.get(pid, (title, 0.0))[1]) / wall_s)
            for pid, (title, cpu) in after.items()]
    return sorted((r for r in rows if r[1] > 0.02), key=lambda r: -r[1])


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

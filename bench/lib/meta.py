"""What a result file records about its run (command, machine, software,
time), the same fields in every benchmark's JSON so results can be told
apart and compared later.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_rev(paths: tuple[str, ...] = ()) -> str | None:
    """HEAD's short hash, with the files of ``paths`` that differ from it."""
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip() or None
        if rev and paths:
            out = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", *paths],
                                 capture_output=True, text=True, timeout=10).stdout.split("\n")
            dirty = [ln[3:] for ln in out if ln.strip()]
            if dirty:
                rev += f" (local changes in {', '.join(dirty)})"
        return rev
    except (OSError, subprocess.SubprocessError):
        return None


def run_meta(**extra: Any) -> dict[str, Any]:
    """The command, machine and time of this run, plus ``extra``."""
    return {"argv": sys.argv, "git": git_rev(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "loadavg": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **extra}


def emit_report(report: dict[str, Any], path: str | None) -> None:
    """Print a benchmark's results (without its "meta") and, with ``path``, write all of it as JSON."""
    print(json.dumps({k: v for k, v in report.items() if k != "meta"}, indent=2))
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, val = line.partition(":")
                info.setdefault(key.strip(), val.strip())
    except OSError:
        pass
    return info


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def hardware_info() -> dict[str, Any]:
    """The CPU, memory and kernel, for results that compare machines."""
    info = _cpuinfo()
    try:
        affinity: list[int] | None = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return dict(
        nproc=os.cpu_count(), cpu_affinity=affinity, cpu_model=info.get("model name"),
        cpu_vendor=info.get("vendor_id"),
        cpu_family_model_stepping=[info.get("cpu family"), info.get("model"), info.get("stepping")],
        cpu_mhz=float(info["cpu MHz"]) if "cpu MHz" in info else None,
        hypervisor="hypervisor" in info.get("flags", "").split(), mem_total_gib=_mem_gib(),
        machine=platform.machine(), kernel=platform.release(), python=platform.python_version(),
        python_impl=platform.python_implementation())

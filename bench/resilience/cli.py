"""The command line of the resilience driver: pick a scenario, override any
of its settings, run it, print and write what it measured; exit 1 when a
check fails.

  python -m bench.resilience --list
  python -m bench.resilience --scenario worker-kill                       # 3 minutes, a kill every 30 s
  python -m bench.resilience --scenario worker-kill --duration 60 --every 20
  python -m bench.resilience --scenario engine-kill-drain --duration 40 --every 10
  python -m bench.resilience --scenario soak --duration 600               # the full soak
  python -m bench.resilience --scenario hostile --duration 20 --param fault.bombs=8
  python -m bench.resilience --scenario soak --param load.concurrency=16 --param check.max_rss_growth=0.1
  python -m bench.resilience --scenario worker-kill --param target.config.parallel.tensor_parallel_size=1

Results: bench/out/resilience/SCENARIO.json (and .png for the poisson
loads: output tokens/s over time, faults marked). Loopback only.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Any

from bench.lib.launch import parse_sets
from bench.lib.meta import run_meta
from bench.lib.sse import run
from bench.resilience import report
from bench.resilience.checks import CHECKS
from bench.resilience.faults import FAULTS
from bench.resilience.load import LOADS
from bench.resilience.scenarios import OUT, SCENARIOS, Scenario
from bench.resilience.targets import TARGETS, System

# Shortcut flags -> (section, key) of the scenario's params.
SHORTCUTS = {"duration": ("load", "duration_s"), "every": ("fault", "every_s"), "load": ("load", "load"),
             "concurrency": ("load", "concurrency"), "seed": ("load", "seed"), "port": ("target", "port")}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="which scenario to run")
    p.add_argument("--list", action="store_true", help="list the scenarios and their settings")
    p.add_argument("--duration", type=float, help="seconds of load (load.duration_s)")
    p.add_argument("--every", type=float, help="seconds between periodic faults (fault.every_s)")
    p.add_argument("--load", type=float, help="fraction of the saturated request rate (load.load)")
    p.add_argument("--concurrency", type=int, help="requests in flight (load.concurrency)")
    p.add_argument("--seed", type=int, help="load.seed")
    p.add_argument("--port", type=int, help="target.port")
    p.add_argument("--param", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="any setting of the scenario (sections target, load, fault, check); YAML values")
    p.add_argument("--out-json", help="default bench/out/resilience/SCENARIO.json")
    p.add_argument("--out-png", help="default bench/out/resilience/SCENARIO.png (poisson loads)")
    a = p.parse_args(argv)
    if not a.list and not a.scenario:
        p.error("--scenario NAME (or --list)")
    return a


def params_of(scn: Scenario, a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The scenario's settings with the command line's overrides; an unknown key is an error."""
    params = copy.deepcopy(scn.params)
    overrides = {f"{sec}.{key}": getattr(a, flag) for flag, (sec, key) in SHORTCUTS.items()
                 if getattr(a, flag) is not None}
    overrides.update(parse_sets(a.param))
    for dotted, value in overrides.items():
        *path, key = dotted.split(".")
        node: Any = params
        for part in path:  # into nested settings too: target.config.parallel.tensor_parallel_size
            node = node.get(part) if isinstance(node, dict) else None
        if not path or not isinstance(node, dict) or key not in node:
            known = ", ".join(f"{s}.{k}" for s, d in params.items() for k in d)
            raise SystemExit(f"{scn.name} has no setting {dotted!r}; it has: {known} (and the keys "
                             "inside a config, e.g. target.config.parallel.tensor_parallel_size)")
        node[key] = value
    return params


async def drive(scn: Scenario, params: dict[str, dict[str, Any]], system: System
                ) -> tuple[dict[str, Any], dict[str, bool]]:
    """Load with the fault, summarize and check, all while the system is up."""
    async with system.session():
        res = await LOADS[scn.load](system, params["load"], FAULTS[scn.fault], params.get("fault", {}))
        summary = report.SUMMARIES[scn.load](res, system)
        checks = dict(CHECKS[c](summary, system, params.get("check", {})) for c in scn.checks)
    return summary, checks


def run_scenario(scn: Scenario, params: dict[str, dict[str, Any]], out_json: str, out_png: str) -> int:
    """Bring the target up, drive it, take it down; print, write; 0 when every check passed."""
    print(f"{scn.name} (was {scn.replaces}): {scn.summary}", flush=True)
    with TARGETS[scn.target](params["target"]) as system:
        summary, checks = run(drive(scn, params, system))
    report.show(scn.load, summary)
    for label, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {label}")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump({"meta": run_meta(), "scenario": scn.name, "replaces": scn.replaces, "params": params,
                   "summary": summary, "checks": checks}, f, indent=1, default=str)
    written = [out_json]
    if scn.load == "poisson":
        report.plot(out_png, scn.name, summary)
        written.append(out_png)
    print(f"wrote {' and '.join(written)}")
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    """--list, or run the --scenario with the overrides; its exit status."""
    a = _args(argv)
    if a.list:
        for s in SCENARIOS.values():
            print(f"{s.name}: {s.summary} (was {s.replaces})\n  target {s.target}, load {s.load}, "
                  f"fault {s.fault}, checks {', '.join(s.checks)}")
            for sec, d in s.params.items():
                print(f"  {sec}: " + ", ".join(f"{k}={json.dumps(v) if isinstance(v, dict) else v}"
                                               for k, v in d.items()))
        return 0
    scn = SCENARIOS[a.scenario]
    base = os.path.join(OUT, "resilience", scn.name)
    return run_scenario(scn, params_of(scn, a), a.out_json or base + ".json", a.out_png or base + ".png")


if __name__ == "__main__":
    sys.exit(main())

"""The resilience scenarios, as data: what system is brought up (target),
what load it gets, what fault is injected, and what must hold afterwards.
bench/resilience/cli.py runs one; every value here can be overridden on the
command line (``--param load.duration_s=60``).

Each scenario keeps every fault and check of the script it replaces:

- ``worker-kill`` (was bench/chaos.py, issue 13): our Serve app on the demo
  model with executor ray, TP=2; Poisson load at half the saturated rate; a
  random worker rank SIGKILLed every 30 s. No request fails, every output
  equals an undisturbed run's, one engine restart per kill; recovery time per
  kill and the engine's rebuild time reported, throughput plotted.
- ``engine-kill-drain`` (was bench/migration_chaos.py, issue 26): 2 engines
  in this process (data_parallel_size 2, max_restarts 0); Poisson load at 0.8
  of saturation; every 30 s an engine is killed (its requests move, a new
  engine replaces it) or drained (paced handover, then undrained), alternating,
  on alternating engines. No request fails, every output equals the reference.
- ``soak`` (was bench/soak.py): our Serve app (configs/tiny-cpu.yaml) at
  saturation (64 in flight) for 10 minutes, 20% of the streams dropped by the
  client mid-way and 5% invalid requests. No failure, every accepted request
  ended, the engine idle afterwards, server RSS growth under 5% after warm-up.
- ``hostile`` (was bench/hardening.py, issue 31): one AsyncLLM behind uvicorn
  (no Ray); plain streams' TPOT alone, then while attackers flood grammar bombs,
  2 MB-class and 18k-character prompts. Attack/baseline median TPOT <= 1.2.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from bench.lib.models import MODELS_ROOT

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "bench", "out")

# The engine config of worker-kill (a whole config: nothing else from a file).
_RAY_TP2 = {"model": {"max_model_len": 1024},
            "parallel": {"executor": "ray", "tensor_parallel_size": 2,
                         # a kill every 30 s: more restarts than the default budget (3 per 600 s)
                         "max_restarts": 100, "restart_window_s": 600.0},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
            "cache": {"num_gpu_blocks": 1024},
            "serve": {"host": "127.0.0.1", "served_model_name": "tiny", "metrics_public": True}}


@dataclass(frozen=True)
class Scenario:
    """One resilience run. ``target``, ``load`` and ``fault`` name the
    implementations in targets.py, load.py and faults.py; ``checks`` name
    those of checks.py; ``params`` holds their settings by section
    ("target", "load", "fault", "check")."""
    name: str
    replaces: str
    summary: str
    target: str
    load: str
    fault: str
    checks: tuple[str, ...]
    params: dict[str, dict[str, Any]] = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "worker-kill", "bench/chaos.py",
        "Serve + executor ray TP=2; a random worker SIGKILLed every 30 s under half-saturated load",
        target="serve", load="poisson", fault="kill_worker",
        checks=("no_failures", "same_as_reference", "restart_per_kill"),
        params={"target": {"config": _RAY_TP2, "port": 8931,
                           "model": os.path.join(OUT, "demo_model")},
                "load": {"duration_s": 180.0, "load": 0.5, "unique": 64, "input_len": 32,
                         "output_len": 64, "seed": 0},
                "fault": {"every_s": 30.0}}),
    Scenario(
        "engine-kill-drain", "bench/migration_chaos.py",
        "2 in-process engines; one killed or drained every 30 s, alternating, under 0.8 x saturated load",
        target="engines", load="poisson", fault="kill_or_drain",
        checks=("no_failures", "same_as_reference"),
        params={"target": {"engines": 2, "max_num_seqs": 128, "blocks_per_seq": 20,
                           "model": os.path.join(MODELS_ROOT, "llama30m_v512")},
                "load": {"duration_s": 180.0, "load": 0.8, "unique": 48, "output_len": 64, "seed": 0},
                "fault": {"every_s": 30.0}}),
    Scenario(
        "soak", "bench/soak.py",
        "Serve (configs/tiny-cpu.yaml) at saturation for 10 min with client disconnects and invalid requests",
        target="serve", load="closed", fault="hostile_requests",
        checks=("no_failures", "every_accepted_ended", "engine_idle", "rss_growth"),
        params={"target": {"config": os.path.join(REPO, "configs", "tiny-cpu.yaml"), "port": 18556,
                           "model": os.path.join(OUT, "demo_model")},
                "load": {"duration_s": 600.0, "concurrency": 64, "max_requests": 2_000_000,
                         "warmup_fraction": 0.2, "seed": 0},
                "fault": {"disconnect_fraction": 0.20, "invalid_fraction": 0.05},
                "check": {"max_rss_growth": 0.05}}),
    Scenario(
        "hostile", "bench/hardening.py",
        "uvicorn + one AsyncLLM: plain streams' TPOT alone, then under grammar bombs and huge prompts",
        target="uvicorn", load="phases", fault="attackers",
        checks=("tpot_ratio",),
        params={"target": {"model": os.path.join(OUT, "tiny-llama"),
                           "engine": {"model": {"max_model_len": 1024},
                                      "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
                                      "serve": {"served_model_name": "tiny"}}},
                "load": {"duration_s": 20.0, "clients": 4, "tokens": 32},
                "fault": {"bombs": 8, "big": 2, "interval_s": 1.0},
                "check": {"max_tpot_ratio": 1.2}}),
)}

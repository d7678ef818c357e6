"""One resilience driver: load + faults + checks, with the scenarios as data
(scenarios.py). It replaces bench/chaos.py, bench/soak.py, bench/hardening.py
and bench/migration_chaos.py, one scenario each, every fault and check kept.

  python -m bench.resilience --list
  python -m bench.resilience --scenario worker-kill --duration 60 --every 20
  python bench/resilience --scenario soak --duration 120        # the same, by path

Parts: targets.py (the system under test), load.py (the loads), faults.py
(the faults), checks.py (what must hold), report.py (summaries, JSON, PNG),
cli.py (the command line).
"""

"""Conveyor's benchmarks: scripts that measure the engine against its goals
and its peers (vLLM's CPU build, Ray Serve LLM, Hugging Face).

Every script runs from the repository root both ways,
``python bench/X.py`` and ``python -m bench.X`` (each puts the root on
sys.path first). Results go to bench/out/ (ignored by git).

- bench/lib/: the one copy of what several scripts share: the streaming
  OpenAI client (sse), the server launchers, ours and the peers' (launch),
  percentiles and rate series (stats), the random-weight checkpoints (models),
  prompts (prompts), PNG charts (png_plot), process trees (proc_tree), run
  metadata (meta) and the long-lived engine side process (side_process).
- bench/peers/: what runs inside the peers' own venvs (vLLM, Ray Serve LLM).
- bench/routing/: the router benchmarks (simulated engines, live servers).
- bench/resilience/: one driver for load + faults + checks, scenarios as data
  (``python -m bench.resilience --list``).

This package and bench/lib/__init__.py import nothing: the peer scripts load
bench.lib.proc_tree and bench.lib.prompts under the peers' Pythons, which
have neither Conveyor nor its dependencies.
"""

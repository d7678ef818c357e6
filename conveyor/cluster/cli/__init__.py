"""The `conveyor` command (main.py; `python -m conveyor.cluster.cli`), its
config-override flags (options.py, shared with `python -m conveyor.cluster.batch`) and
the setup checks run before serving (setup_checks.py)."""

"""The `conveyor` command (main.py; `python -m cluster.cli`), its
config-override flags (options.py, shared with `python -m cluster.batch`) and
the setup checks run before serving (setup_checks.py)."""

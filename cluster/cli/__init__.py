"""The `conveyor` command (main.py), its config-override flags (options.py,
shared with `python -m cluster.batch`) and the setup checks run before serving."""
from cluster.cli.main import main

__all__ = ["main"]

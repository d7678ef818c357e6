"""`python -m cluster.cli`: the `conveyor` command."""
import os
import sys

from cluster.cli.main import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.exit(main())

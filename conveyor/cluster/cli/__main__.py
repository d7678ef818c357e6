"""`python -m conveyor.cluster.cli`: the `conveyor` command."""
import os
import sys

from conveyor.cluster.cli.main import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.exit(main())

"""`python -m bench.resilience` and `python bench/resilience`: see cli.py."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.resilience.cli import main  # noqa: E402

sys.exit(main())

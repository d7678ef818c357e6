"""Where tests find the repository and this folder, whichever folder under
tests/cpu (unit/, integration/) a test module sits in: this folder holds the
shared helpers and the scripts tests start as processes (wheel_probe.py,
node_loss_driver.py)."""
from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/cpu
ROOT = SUPPORT.parents[1]  # the repository

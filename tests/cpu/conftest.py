"""Shared test setup. TRITON_INTERPRET must be set before any kernel module is
imported, so it is set here, at collection time."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_sessionstart(session: object) -> None:
    """Build the CPU attention kernel once, before any test forks workers: every
    engine process then loads the cached build instead of waiting on the compile."""
    from kernels import cpu_attention

    cpu_attention.available()

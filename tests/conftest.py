"""Setup shared by tests/cpu and tests/compat."""
from __future__ import annotations

import os
import tempfile

# Under pytest-xdist (make test runs two workers) each worker's Ray instances
# live in a temp root of their own, inherited by the processes it starts: a
# `ray.init()` that joins "the latest cluster on this machine" (conveyor
# serve, the demo) then only ever finds its own worker's.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and "RAY_TMPDIR" not in os.environ:
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"ray-{_worker}-", dir="/tmp")

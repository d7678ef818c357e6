"""Ray nodes of a test's own, started with `ray start --block` on 127.0.0.1 in
their own sessions and stopped by their pid (never `ray stop`, which stops
every Ray on the machine). Ray 2.60 `ray start` clusters authenticate with a
token: every process of such a cluster gets the same one (token_env)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conveyor.parallel.ports import free_port  # noqa: F401  (the tests' free_port: one definition)

BIN = os.path.dirname(sys.executable)
RAY = os.path.join(BIN, "ray")


def token_env(token: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without its RAY_* settings, plus the cluster's token,
    the venv's bin first on PATH and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PATH=f"{BIN}:{env.get('PATH', '')}",
               PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def _agent_ports() -> list[str]:
    """Free ports for a node's agents: two nodes on one machine must not share them."""
    flags = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port", "--metrics-export-port")
    return [x for f in flags for x in (f, str(free_port()))]


def start_node(env: dict[str, str], args: list[str], cwd: str | None = None) -> subprocess.Popen:
    """`ray start --block ... args` in a session of its own (output discarded)."""
    cmd = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
           *_agent_ports(), *args]
    return subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_node(proc: subprocess.Popen) -> None:
    """Stop exactly the node `proc` started: `ray start --block` stops its own
    processes on SIGTERM; past a minute, SIGKILL its session."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only its processes
            proc.wait(timeout=30)


def raylet_pid(proc: subprocess.Popen) -> int:
    """The raylet among the processes of the node that `proc` started (its session)."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if os.getsid(int(p)) != proc.pid:
                continue
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except (OSError, ProcessLookupError):
            continue
        if argv0.endswith(b"/raylet"):
            return int(p)
    raise AssertionError(f"no raylet among the processes of `ray start` pid {proc.pid}")


def wait_nodes(address: str, env: dict[str, str], n: int, procs: list[subprocess.Popen],
               timeout_s: float = 120) -> None:
    """Until the cluster has n active nodes (asked with `ray status`, from outside)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a `ray start` exited"
        r = subprocess.run([RAY, "status", "--address", address], env=env,
                           capture_output=True, text=True, timeout=60)
        active = r.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if r.returncode == 0 else ""
        if active.count("node_") == n:
            return
        time.sleep(1)  # `ray status` has no wait-for-n-nodes; poll it
    raise AssertionError(f"{n} Ray nodes did not come up")


def engine_actor_pids() -> set[int]:
    """Pids of the EngineCoreActor processes of this test process's Ray
    instances: under pytest-xdist every worker has its own RAY_TMPDIR, which
    the Ray processes it starts inherit, so another worker's actors are not
    counted."""
    mine = os.environ.get("RAY_TMPDIR", "").encode()
    pids = set()
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"ray::EngineCoreActor" not in f.read():
                    continue
            if mine:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if b"RAY_TMPDIR=" + mine + b"\0" not in f.read() + b"\0":
                        continue
            pids.add(int(p))
        except (OSError, ValueError):
            continue
    return pids


def worker_actor_pids() -> list[int]:
    """Pids of the RayWorkerActor processes (an executor "ray" engine's
    ranks) of the Ray instance this test process started: descendants of
    this process, so another worker's or another test run's are not counted."""
    me, parent, workers = os.getpid(), {}, []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RayWorkerActor"):
                    workers.append(int(p))
        except (OSError, ValueError, IndexError):
            continue

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == me:
                return True
            pid = parent.get(pid, 0)
        return False
    return sorted(p for p in workers if ours(p))

"""Node loss (issue 13, item 4): two Ray nodes on one machine, a head started
with `ray start --head` and a second raylet joined with `ray start --address`.
The worker group (TP=2) is placed on the second node; that node (its raylet
and the processes the raylet started, the workers among them) is SIGKILLed by
pid mid-generation; the engine rebuilds the group on the head, in a new
placement group, and every request finishes with the tokens of an undisturbed
run.

Placement is steered without an engine knob: while the engine starts, a
placement group holding all of the head's CPUs leaves Ray only the second node
for the workers; it is removed before the second node is stopped, so the head
has room for the rebuilt group. The engine core runs in the driver process
(InProcCoreClient over a RayExecutor, tests/cpu/node_loss_driver.py), on the
head: this test is about the workers' node, not the engine actor's."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from engine import LLM
from llm_utils import make_checkpoint
from node_loss_case import PARAMS, PROMPTS

BIN = os.path.dirname(sys.executable)
HERE = os.path.dirname(os.path.abspath(__file__))
# The head's GCS declares a silent node dead after about 3 s, not Ray's default 15 s.
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_timeout_ms": "1000"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_env() -> dict[str, str]:
    """Ray 2.60 `ray start` clusters authenticate with a token: every process of
    this test's cluster (both nodes, the driver) gets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(FAST_HEALTH, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               PATH=f"{BIN}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    return env


def _agent_ports() -> list[str]:
    flags = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port", "--metrics-export-port")
    return [x for f in flags for x in (f, str(_free_port()))]


def _start_node(env: dict[str, str], args: list[str]) -> subprocess.Popen:
    cmd = [os.path.join(BIN, "ray"), "start", "--block", "--node-ip-address", "127.0.0.1",
           "--disable-usage-stats", *_agent_ports(), *args]
    return subprocess.Popen(cmd, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_node(proc: subprocess.Popen) -> None:
    """Stop exactly the node we started (`ray start --block` stops its own
    processes on SIGTERM; `ray stop` would stop every Ray on the machine)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only its processes
            proc.wait(timeout=30)


def _raylet_pid(proc: subprocess.Popen) -> int:
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
    raise AssertionError("no raylet found for the second node")


def _wait_nodes(address: str, env: dict[str, str], n: int, procs: list[subprocess.Popen],
                timeout_s: float = 120) -> None:
    """Until the cluster has n active nodes (asked with `ray status`, from outside)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a `ray start` exited"
        r = subprocess.run([os.path.join(BIN, "ray"), "status", "--address", address], env=env,
                           capture_output=True, text=True, timeout=60)
        active = r.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if r.returncode == 0 else ""
        if active.count("node_") == n:
            return
        time.sleep(1)
    raise AssertionError(f"{n} Ray nodes did not come up")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama", str(tmp_path_factory.mktemp("node") / "llama"))


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(model=ckpt, max_num_batched_tokens=64, max_model_len=512)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture
def two_nodes():
    """(GCS address, the cluster's env, the second node's `ray start` process)."""
    env = _ray_env()
    temp_dir = tempfile.mkdtemp(prefix="cvnode", dir="/tmp")  # short: Unix socket paths
    port = _free_port()
    address = f"127.0.0.1:{port}"
    head = _start_node(env, ["--head", "--port", str(port), "--num-cpus", "2",
                             "--resources", '{"head_cpu": 2}', "--include-dashboard", "false",
                             "--ray-client-server-port", str(_free_port()), "--temp-dir", temp_dir])
    procs = [head]
    try:
        _wait_nodes(address, env, 1, procs)
        second = _start_node(env, ["--address", address, "--num-cpus", "2",
                                   "--resources", '{"second_cpu": 2}'])
        procs.append(second)
        _wait_nodes(address, env, 2, procs)
        yield address, env, second
    finally:
        for p in reversed(procs):
            _stop_node(p)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_lost_node_group_is_rebuilt_on_the_head(ckpt, reference, two_nodes):
    address, env, second = two_nodes
    r = subprocess.run([sys.executable, os.path.join(HERE, "node_loss_driver.py"), address, ckpt,
                        str(_raylet_pid(second))], env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    head, where = res["head"], {k: res[k] for k in ("head", "before", "after", "restarts")}
    assert len(set(res["before"])) == 1 and res["before"][0] != head, where  # on the second node
    # 0 restarts: the old group finished before the node was gone, so no recovery was seen.
    assert res["restarts"] == 1, where
    assert res["after"] == [head, head], where  # rebuilt on the head
    assert res["reasons"] == ["length"] * 4
    assert res["tokens"] == reference

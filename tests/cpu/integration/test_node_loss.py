"""Node loss: two Ray nodes on one machine, a head started
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
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest
from node_loss_case import PARAMS, PROMPTS
from ray_nodes import free_port, raylet_pid, start_node, stop_node, token_env, wait_nodes
from recovery_utils import undisturbed_tokens
from repo_paths import SUPPORT

# The head's GCS declares a silent node dead after about 3 s, not Ray's default 15 s.
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_timeout_ms": "1000"}


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def reference(ckpt):
    return undisturbed_tokens(ckpt, PROMPTS, PARAMS, max_num_batched_tokens=64, max_model_len=512)


@pytest.fixture
def two_nodes():
    """(GCS address, the cluster's env, the second node's `ray start` process)."""
    env = token_env(secrets.token_hex(32), FAST_HEALTH)  # both nodes and the driver
    temp_dir = tempfile.mkdtemp(prefix="cvnode", dir="/tmp")  # short: Unix socket paths
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = start_node(env, ["--head", "--port", str(port), "--num-cpus", "2",
                            "--resources", '{"head_cpu": 2}', "--include-dashboard", "false",
                            "--ray-client-server-port", str(free_port()), "--temp-dir", temp_dir])
    procs = [head]
    try:
        wait_nodes(address, env, 1, procs)
        second = start_node(env, ["--address", address, "--num-cpus", "2",
                                  "--resources", '{"second_cpu": 2}'])
        procs.append(second)
        wait_nodes(address, env, 2, procs)
        yield address, env, second
    finally:
        for p in reversed(procs):
            stop_node(p)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_lost_node_group_is_rebuilt_on_the_head(ckpt, reference, two_nodes):
    address, env, second = two_nodes
    r = subprocess.run([sys.executable, str(SUPPORT / "node_loss_driver.py"), address, ckpt,
                        str(raylet_pid(second))], env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    head, where = res["head"], {k: res[k] for k in ("head", "before", "after", "restarts")}
    assert len(set(res["before"])) == 1 and res["before"][0] != head, where  # on the second node
    # 0 restarts: the old group finished before the node was gone, so no recovery was seen.
    assert res["restarts"] == 1, where
    assert res["after"] == [head, head], where  # rebuilt on the head
    assert res["reasons"] == ["length"] * 4
    assert res["tokens"] == reference

"""The driver of tests/cpu/integration/test_node_loss.py, run as its own process so that
Ray's token authentication (read once per process) never meets the test
process's other Ray instances. Connects to the two-node cluster, starts the
engine with its workers on the second node, SIGKILLs that node (its raylet and
every process the raylet started, the workers among them) mid-generation and
prints one JSON line: the tokens and finish reasons, the workers' nodes before
and after, the restart count.

usage: node_loss_driver.py ADDRESS CHECKPOINT RAYLET_PID"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
from node_loss_case import PARAMS, PROMPTS, engine_config  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from recovery_utils import drain_all  # noqa: E402

from conveyor.engine.config import build_config  # noqa: E402
from conveyor.engine.core.inproc_client import InProcCoreClient  # noqa: E402
from conveyor.engine.frontend.async_client import AsyncLLM  # noqa: E402


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # field 4; comm may hold spaces


def kill_node(raylet_pid: int, worker_pids: list[int]) -> None:
    """SIGKILL the node at once: its raylet and the processes it started.

    Killing the raylet alone is not a lost node: Ray's workers run in their own
    sessions and notice their raylet's death only seconds later (the raylet
    death check), and meanwhile they go on answering the ZMQ data plane. The
    tiny model finishes the remaining tokens in about a second, so the old
    group sometimes completed every request and no rebuild happened."""
    children = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and _parent_pid(int(p)) == raylet_pid:
                children.append(int(p))
        except OSError:  # exited meanwhile
            continue
    missing = set(worker_pids) - set(children)
    if missing:
        raise RuntimeError(f"worker pids {sorted(missing)} are not the raylet's children {children}")
    for pid in [*children, raylet_pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # a child that exited after the listing is already gone, as wanted
            continue


async def generate_and_lose_node(llm: AsyncLLM, raylet_pid: int, worker_pids: list[int]
                                 ) -> list[tuple[list[int], str | None]]:
    streams = [llm.generate(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    firsts = [await s.__anext__() for s in streams]
    kill_node(raylet_pid, worker_pids)  # the node is gone, its workers with it
    return await drain_all(firsts, streams, timeout_s=180)


def main(address: str, ckpt: str, raylet_pid: int) -> None:
    ray.init(address=address, include_dashboard=False)
    head = ray.get_runtime_context().get_node_id()
    # All of the head's CPUs, while the engine starts: its workers can only go to the second node.
    blocker = placement_group([{"CPU": 2, "head_cpu": 2}], strategy="STRICT_PACK")
    ray.get(blocker.ready(), timeout=60)
    cfg = build_config(engine_config(ckpt))
    client = InProcCoreClient(cfg)  # the core in this process, on the head
    try:
        before = [n for n, _, _ in client.core.executor.rank_infos]
        remove_placement_group(blocker)  # room on the head again, for the rebuild

        async def scenario():
            return await generate_and_lose_node(AsyncLLM(cfg, client=client), raylet_pid,
                                                client.core.executor.worker_process_ids())
        outs = asyncio.run(scenario())
        after = [n for n, _, _ in client.core.executor.rank_infos]
        restarts = client.core.num_restarts
    finally:
        client.shutdown()
        ray.shutdown()
    print(json.dumps({"head": head, "before": before, "after": after, "restarts": restarts,
                      "tokens": [t for t, _ in outs], "reasons": [r for _, r in outs]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

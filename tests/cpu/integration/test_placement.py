"""Placement on a simulated multi-node Ray cluster (its own Ray instance)."""
from __future__ import annotations

import ray


def test_placement_two_nodes_keeps_tp_groups_local():
    """A simulated 2-node cluster with 2 fake GPUs each: a TP=2 x PP=2 engine's
    placement group puts each TP group (consecutive ranks) on one node."""
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group

    from conveyor.executors.ray_executor import place_workers

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2)
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        pg = placement_group([{"GPU": 1}] * 4, strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        actors, nodes, order, infos = place_workers(pg, 0, 4, tp=2, start_timeout_s=120.0)
        rank_nodes = [n for n, _, _ in infos]
        assert len(set(rank_nodes)) == 2
        assert rank_nodes[0] == rank_nodes[1] and rank_nodes[2] == rank_nodes[3]
        assert rank_nodes[0] == ray.get_runtime_context().get_node_id()  # driver's node first
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
    finally:
        ray.shutdown()
        cluster.shutdown()

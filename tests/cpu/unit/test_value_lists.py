"""Each value list has one owner, the config (conveyor/engine/config/sections.py);
where the import rules keep the implementing package from importing the config
(kernels import nothing of ours), this test keeps the two in step."""
from __future__ import annotations


def test_router_policies_and_grammar_backends_are_the_configs() -> None:
    from conveyor.engine.config import sections
    from conveyor.engine.dp.router.policy import POLICIES
    from conveyor.engine.structured_output.registry import backend_names

    assert POLICIES is sections.ROUTER_POLICIES
    assert backend_names() == sorted(sections.GRAMMAR_BACKENDS)


def test_executors_attention_backends_and_isas_match_their_registries() -> None:
    from conveyor.engine.config import sections
    from conveyor.executors import EXECUTORS
    from conveyor.kernels.backends import BACKEND_CHOICES
    from conveyor.kernels.cpu_attention import ISAS

    assert sorted(EXECUTORS) == sorted(sections.EXECUTORS)
    assert sorted(BACKEND_CHOICES) == sorted(sections.BACKENDS)
    assert tuple(ISAS) == sections.CPU_ISAS


def test_engine_placement_is_one_rule() -> None:
    """A data-parallel engine's actor asks for the same resources wherever it
    is started (a replica's own engines, the app's engine pool)."""
    from conveyor.cluster.engine_actor.actor import CoreActorPlacement
    from conveyor.engine.config import build_config

    assert CoreActorPlacement.of_engine(build_config(executor="ray"), use_gpu=True) == CoreActorPlacement()
    cpu = CoreActorPlacement.of_engine(build_config(executor="mp", tensor_parallel_size=2), use_gpu=False)
    gpu = CoreActorPlacement.of_engine(build_config(executor="mp", tensor_parallel_size=2), use_gpu=True)
    assert (cpu.num_cpus, cpu.num_gpus, gpu.num_cpus, gpu.num_gpus) == (1.0, 0.0, 1.0, 2.0)

"""Executors behind a small registry: name -> factory(config) -> Executor."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.engine.config import EngineConfig
    from conveyor.executors.base import Executor


def _uniproc(config: EngineConfig) -> Executor:
    from conveyor.executors.uniproc import UniProcExecutor
    return UniProcExecutor(config)


def _ray(config: EngineConfig) -> Executor:
    from conveyor.executors.ray_executor import RayExecutor
    return RayExecutor(config)


def _mp(config: EngineConfig) -> Executor:
    from conveyor.executors.multiproc import MultiprocExecutor
    return MultiprocExecutor(config)


EXECUTORS: dict[str, Callable[[EngineConfig], Executor]] = {"uniproc": _uniproc, "mp": _mp, "ray": _ray}


def make_executor(config: EngineConfig) -> Executor:
    name = config.parallel.executor
    if name not in EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; choose one of {sorted(EXECUTORS)}")
    return EXECUTORS[name](config)

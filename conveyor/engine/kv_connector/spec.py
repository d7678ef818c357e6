"""The tiers' sizes and places, derived once from the config and the measured
KV layout; the scheduler side and the worker side build the same spec."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import KVCacheInfo
from conveyor.engine.kv_connector.disk_format import model_identity

GIB = 1 << 30


@dataclass(frozen=True)
class TierSpec:
    block_size: int
    bytes_per_block: int  # the engine's block over all ranks (for sizing the tiers)
    cpu_blocks: int  # host-tier slots (0: off)
    disk_blocks: int  # disk-tier files (0: off)
    disk_folder: Path | None  # <offload_disk_path>/<model identity>
    model_id: str
    load_timeout_s: float
    world_size: int = 1  # ranks that each keep a shard of every block


def tiers_enabled(config: EngineConfig) -> bool:
    cc = config.cache
    return cc.offload_cpu_gb > 0 or (cc.offload_disk_gb > 0 and cc.offload_disk_path is not None)


def tier_spec(config: EngineConfig, kv: KVCacheInfo) -> TierSpec:
    cc, p = config.cache, config.parallel
    # kv is the output rank's layout; every rank holds a like share of a block
    # (TP splits the heads, PP the layers: equal within a layer or so).
    world = config.world_size
    bpb = max(kv.bytes_per_block, 1) * world
    disk_on = cc.offload_disk_gb > 0 and cc.offload_disk_path is not None
    model_id = ""
    folder = None
    if disk_on:
        assert cc.offload_disk_path is not None  # disk_on says so
        model_id = model_identity(config.model.path, kv.kv_dtype, cc.block_size, bpb,
                                  (p.tensor_parallel_size, p.pipeline_parallel_size, 0))
        folder = Path(cc.offload_disk_path) / model_id
    return TierSpec(block_size=cc.block_size, bytes_per_block=bpb,
                    cpu_blocks=int(cc.offload_cpu_gb * GIB) // bpb,
                    disk_blocks=int(cc.offload_disk_gb * GIB) // bpb if disk_on else 0,
                    disk_folder=folder, model_id=model_id, load_timeout_s=cc.kv_load_timeout_s,
                    world_size=world)

"""Worker: one rank. Device, process groups, model, KV cache, and the
pipeline-parallel bridge around ModelRunner.execute_model."""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import msgspec
import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import KVCacheInfo, ModelRunnerOutput, SchedulerOutput
from conveyor.engine.kv_connector.metadata import KVConnectorOutput
from conveyor.parallel import state as ps
from conveyor.parallel.communication import IntermediateTensors, recv_tensor_dict, send_tensor_dict
from conveyor.parallel.ports import free_port
from conveyor.workers.kv_connector import make_worker_connector
from conveyor.workers.kv_connector.rank_merge import RankMerge, gather_reports
from conveyor.workers.model_loader import load_hf_config, load_model
from conveyor.workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    dt = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    dt = dt if isinstance(dt, torch.dtype) else _DTYPES.get(str(dt).replace("torch.", ""), torch.float32)
    # CPU matmuls in half precision are slow and inexact: run fp32 there.
    return dt if device.type == "cuda" else torch.float32


def cpu_bf16_math() -> str:
    """What ``dtype: bfloat16`` computes in on this CPU: with AMX or AVX512_BF16
    oneDNN's linears multiply in bf16 (fp32 accumulation); without, they keep
    bf16 storage and widen to fp32 for the math. Attention always runs fp32
    math over the bf16 cache (conveyor/kernels/csrc widens rows in registers)."""
    if torch.cpu._is_amx_tile_supported():
        return "bf16 math (AMX tiles; fp32 accumulation)"
    if torch.cpu._is_avx512_bf16_supported():
        return "bf16 math (AVX512_BF16; fp32 accumulation)"
    return "bf16 storage, fp32 math (this CPU has neither AVX512_BF16 nor AMX)"


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        # World size 1 rendezvous through a private file: no port to race for.
        self._store_file: str | None = None
        if init_method is None and config.world_size == 1:
            self._store_file = tempfile.mktemp(prefix="conveyor-dist-")
            init_method = f"file://{self._store_file}"
        self.init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None
        self.kv_merge: RankMerge | None = None

    # ---- start-up ------------------------------------------------------------

    def init_device(self) -> None:
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        p = self.config.parallel
        threads = p.cpu_threads_per_worker
        if self.device.type == "cpu" and (threads or self.config.world_size > 1):
            # Ranks share this machine's cores: oversubscribed OpenMP threads
            # spin against each other and slow every collective down.
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // self.config.world_size))
        # Even at world size 1, so the TP/PP code paths are the ones that run.
        ps.init_distributed(self.config.world_size, self.rank, p.tensor_parallel_size,
                            p.pipeline_parallel_size, self.init_method,
                            timeout_s=p.collective_timeout_s)
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> None:
        cfg = self.config
        hf = load_hf_config(cfg.model.path)
        self.dtype = resolve_dtype(cfg.model.dtype, hf, self.device)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            logger.info("dtype bfloat16 on CPU: linears in %s", cpu_bf16_math())
        model = load_model(cfg.model.path, hf, self.dtype, self.device,
                           pp_layer_partition=cfg.parallel.pp_layer_partition,
                           expert_parallel=cfg.parallel.enable_expert_parallel)
        self.model_runner = ModelRunner(cfg, model, self.device, hf.vocab_size, ps.is_last_pp_rank(),
                                        ps.is_first_pp_rank())
        if cfg.model.quantization == "int8":  # after the runner: it loads the CPU kernels
            from conveyor.workers.layers.quant import quantize_linears

            quantize_linears(model)
        if self.device.type == "cpu":
            from conveyor.kernels.cpu_attention import release_freed_memory

            release_freed_memory()  # what loading (and quantizing) freed

    def determine_num_blocks(self) -> int:
        """Blocks that fit this rank's budget (the executor takes the min over ranks)."""
        cfg = self.config
        runner = self._runner()
        per_block = max(runner.kv_bytes_per_block(self.dtype), 1)
        if cfg.cache.num_gpu_blocks is not None:
            return cfg.cache.num_gpu_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * cfg.cache.gpu_memory_utilization - used - self._activation_reserve()
        else:
            budget = cfg.cache.cpu_kv_cache_bytes
        # Never more than every running sequence at full length could use.
        need = cfg.scheduler.max_num_seqs * -(-cfg.max_model_len // cfg.cache.block_size) + 1
        return int(max(min(budget // per_block, need), 0))

    def _activation_reserve(self) -> int:
        """Peak memory of the largest step (profiled on CUDA, on this rank's
        stage: real attention, logits and sampler), less the profile's own
        temporary KV cache."""
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        cache_bytes = self._runner().profile_run(self.dtype)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - cache_bytes
        torch.cuda.empty_cache()
        return int(max(peak, 0) * 1.2)

    def initialize_cache(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise RuntimeError(
                f"only {num_blocks} KV blocks fit this rank's budget; lower max_model_len or raise "
                "cache.cpu_kv_cache_bytes / gpu_memory_utilization")
        runner = self._runner()
        runner.allocate_kv_cache(num_blocks, self.dtype)
        runner.warm_up()  # compiles the kernels before the engine reports ready
        if runner.kv_connector is not None:
            runner.kv_connector.close()
        runner.kv_connector = make_worker_connector(self.config, self.kv_info(num_blocks),
                                                    runner.kv_caches, self.rank, self.config.world_size)
        # Several ranks: each moves its shard; the engine hears one agreed report.
        ws = self.config.world_size
        self.kv_merge = RankMerge(ws) if runner.kv_connector is not None and ws > 1 else None

    def kv_info(self, num_blocks: int) -> KVCacheInfo:
        r = self._runner()
        return KVCacheInfo(num_blocks, self.config.cache.block_size,
                           r.kv_bytes_per_block(self.dtype), r.vocab_size,
                           str(self.dtype).removeprefix("torch."))

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (shared tensors counted once)."""
        seen: dict[int, int] = {}
        for p in self._runner().model.parameters():
            seen[p.data_ptr()] = p.numel() * p.element_size()
        return sum(seen.values())

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("load_model() has not run")
        return self.model_runner

    # ---- per step --------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        runner = self._runner()
        if self.kv_merge is not None:
            self.kv_merge.note(so.kv_connector_metadata)
        intermediate = None
        forward = so.total_num_scheduled_tokens > 0
        if forward and not ps.is_first_pp_rank():
            intermediate = recv_tensor_dict(ps.pp_prev_rank(), device=self.device)
        out = runner.execute_model(so, intermediate)
        if isinstance(out, IntermediateTensors):
            send_tensor_dict(out, ps.pp_next_rank())
            return None
        if out is not None and self.kv_merge is not None:  # a step with no forward: no sample_tokens
            return self._with_merged_kv(out, out.kv_connector_output)
        return out

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput | None:
        runner = self._runner()
        out = runner.sample_tokens(grammar_output) if ps.is_last_pp_rank() else None
        if self.kv_merge is not None:
            if out is not None:
                mine = out.kv_connector_output
            else:  # an earlier stage: its shard's transfers still count
                conn = runner.kv_connector
                assert conn is not None  # kv_merge exists only with a connector
                conn.wait_for_save()
                mine = conn.get_output()
            out = self._with_merged_kv(out, mine)
        return out if ps.is_last_pp_rank() and ps.tp_rank() == 0 else None

    def _with_merged_kv(self, out: ModelRunnerOutput | None, mine: KVConnectorOutput | None
                        ) -> ModelRunnerOutput | None:
        """A collective over every rank, once per step: the engine's one KV
        connector report (conveyor/workers/kv_connector/rank_merge.py)."""
        assert self.kv_merge is not None  # the callers checked
        reports = gather_reports(mine, ps.get_world_cpu_group(), self.config.world_size)
        merged = self.kv_merge.merge(reports)
        return None if out is None else msgspec.structs.replace(out, kv_connector_output=merged)

    def shutdown(self) -> None:
        if self.model_runner is not None and self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.close()  # disk writes finish: a restart finds them
        ps.destroy_distributed()
        self.model_runner = None
        if self._store_file is not None and os.path.exists(self._store_file):
            os.unlink(self._store_file)

"""EngineConfig: one frozen config, built once from YAML or keyword arguments.

- `sections.py`: the structs (DESIGN.md §8); each field declares its rule, its
  LLM(...) keyword and its CLI flag once (`knobs.py`);
- `build.py`: decode, validate, resolve (`build_config`, `load_config`) and
  the checks that need the cluster or the checkpoint.
"""
from conveyor.engine.config.build import (
                                 ConfigError,
                                 build_config,
                                 check_cluster_fits,
                                 check_model_dir,
                                 cli_knobs,
                                 load_config,
                                 read_config_tree,
)
from conveyor.engine.config.knobs import Knob, KnobInfo
from conveyor.engine.config.sections import (
                                 TOOL_CALL_PARSERS,
                                 TRITON_BLOCK_SIZES,
                                 CacheConfig,
                                 EngineConfig,
                                 LoRAConfig,
                                 ModelConfig,
                                 ParallelConfig,
                                 SchedulerConfig,
                                 ServeConfig,
                                 SpeculativeConfig,
                                 StructuredOutputsConfig,
)

__all__ = ["CacheConfig", "ConfigError", "EngineConfig", "Knob", "KnobInfo", "LoRAConfig", "ModelConfig",
           "ParallelConfig", "SchedulerConfig", "ServeConfig", "SpeculativeConfig",
           "StructuredOutputsConfig", "TOOL_CALL_PARSERS", "TRITON_BLOCK_SIZES", "build_config",
           "check_cluster_fits", "check_model_dir", "cli_knobs", "load_config", "read_config_tree"]

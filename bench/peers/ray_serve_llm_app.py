#!/usr/bin/env python3
"""Ray Serve LLM (vLLM behind Ray Serve) on CPU, for bench/serve_compare.py's
optional third column. Runs in the venv of ../shared/peers/vllm_cpu/README.md
("Ray Serve LLM on CPU"), not in the project's: it imports ray.serve.llm and vLLM.

  /tmp/rayllmpeer/bin/python bench/peers/ray_serve_llm_app.py MODEL_DIR --port 8300

Serves /v1 on 127.0.0.1:PORT through Serve's proxy until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import os
import signal
import threading

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Passed on to the replicas when set here (bench/routing/routing_live.py: one unpinned
# compute thread per replica).
PASS_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")


def main() -> int:
    """Deploy the OpenAI app over vLLM replicas; serve until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-cpus", type=int, default=4, help="Ray's logical CPUs (see below)")
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas (LLMServer deployment)")
    p.add_argument("--prefix-router", action="store_true",
                   help="route with Ray Serve LLM's PrefixCacheAffinityRouter (default: power of two)")
    p.add_argument("--block-size", type=int, default=None, help="vLLM KV block size (default: vLLM's)")
    p.add_argument("--num-blocks", type=int, default=None, help="vLLM num_gpu_blocks_override per replica")
    p.add_argument("--temp-dir", default="/tmp/ray_llm_peer",
                   help="this Ray instance's own temp dir (never the default /tmp/ray others use)")
    a = p.parse_args()
    os.environ.update(ENV)
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    # Logical CPUs only (vLLM binds its own compute thread to core 0 and reserves
    # core 1, whatever Ray counts): the LLM server's placement group takes 2 (its
    # bundle plus the replica actor), and the OpenAI ingress needs one more, so
    # with Ray's default of nproc=2 the ingress never schedules.
    ray.init(address="local", num_cpus=a.num_cpus, include_dashboard=False, _temp_dir=a.temp_dir)
    deployment: dict[str, object] = {"num_replicas": a.replicas}
    if a.prefix_router:
        deployment["request_router_config"] = {
            "request_router_class": "ray.serve.llm.request_router.PrefixCacheAffinityRouter"}
    engine: dict[str, object] = {"dtype": "float32", "max_model_len": a.max_model_len,
                                 "max_num_seqs": a.max_num_seqs,
                                 # a RAM fraction per replica on CPU: two at 0.5 would not fit
                                 "gpu_memory_utilization": 0.5 / a.replicas,
                                 # usage.prompt_tokens_details.cached_tokens (the hit rate)
                                 "enable_prompt_tokens_details": True}
    if a.block_size:
        engine["block_size"] = a.block_size
    if a.num_blocks:
        engine["num_gpu_blocks_override"] = a.num_blocks
    env = {**ENV, **{k: os.environ[k] for k in PASS_ENV if k in os.environ}}
    cfg = LLMConfig(model_loading_config={"model_id": "m30", "model_source": os.path.abspath(a.model)},
                    accelerator_config={"kind": "cpu"},
                    placement_group_config={"bundles": [{"CPU": 1}]},
                    deployment_config=deployment, engine_kwargs=engine,
                    runtime_env={"env_vars": env})
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(build_openai_app({"llm_configs": [cfg]}), blocking=False)
    print(f"Ray Serve LLM at http://127.0.0.1:{a.port}/v1", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

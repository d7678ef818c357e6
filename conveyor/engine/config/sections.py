"""The config sections (DESIGN.md §8). Each field carries its one declaration:
type, default, rule, and where it is exposed (LLM keyword, CLI flag)."""
from typing import Annotated

import msgspec

from conveyor.engine.config.knobs import at_least, finite_in, int_in, knob, one_of
from conveyor.engine.sampling_params import MAX_N

_FROZEN = dict(frozen=True, forbid_unknown_fields=True, kw_only=True)

DTYPES = ("float32", "float16", "bfloat16", "auto")
CPU_ISAS = ("auto", "avx512", "avx2", "portable")  # == conveyor.kernels.cpu_attention.ISAS
BACKENDS = ("auto", "torch", "cpu", "triton")
EXECUTORS = ("uniproc", "ray", "mp")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
BLOCK_SIZES = (8, 16, 32, 64, 128)
GRAMMAR_BACKENDS = ("llguidance",)  # conveyor/engine/structured_output/registry.py builds them
ROUTER_POLICIES = ("kv_aware", "session", "least_loaded", "power_of_two", "round_robin")
SCALE_SIGNALS = ("waiting", "kv_usage")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # == conveyor.cluster.openai.tools.parsers.TOOL_PARSERS (a test checks)
# The Triton kernels' tile shapes (conveyor/kernels/paged_attention.py asserts the same
# set; a test keeps the two in step).
TRITON_BLOCK_SIZES = (16, 32, 64)
_BOOL = knob("bool")


class ModelConfig(msgspec.Struct, **_FROZEN):
    path: Annotated[str, knob("a string (a local checkpoint directory)", kwarg="model", flag="--model",
                              help="local Hugging Face checkpoint directory")] = ""
    tokenizer: Annotated[str | None, knob("null or a tokenizer directory", kwarg=True, flag=True,
                                          help="tokenizer directory (default: the model's)")] = None
    dtype: Annotated[str, one_of(DTYPES, kwarg=True, flag=True)] = "float32"
    # None: from the checkpoint's config.json
    max_model_len: Annotated[int | None, at_least(1, nullable=True, kwarg=True, flag=True,
                                                  help="context length cap")] = None
    seed: Annotated[int, knob("int", kwarg=True, flag=True, help="engine seed")] = 0
    attention_backend: Annotated[str, one_of(BACKENDS, kwarg=True, flag=True)] = "auto"
    # The cap on SamplingParams.n (conveyor/engine/frontend/prepare.py checks it per request).
    max_n: Annotated[int, int_in(1, MAX_N)] = 16
    # The cpu backend's kernel table: "auto" (the best this CPU runs, by cpuid)
    # or one forced (benchmarks, tests).
    cpu_isa: Annotated[str, one_of(CPU_ISAS, kwarg=True, flag=True)] = "auto"
    # Weight-only quantization computed at load: None or "int8" (per-channel
    # scales, fp32 math; CPU, fp32 checkpoints' linears; conveyor/workers/layers/quant.py).
    quantization: Annotated[str | None, one_of((None, "int8"), kwarg=True, flag=True)] = None
    # Never capture CUDA graphs for decode steps (vLLM's enforce_eager); graphs
    # are used only on CUDA with the triton backend (conveyor/workers/cuda_graphs.py).
    enforce_eager: Annotated[bool, knob("bool", kwarg=True, flag=True,
                                        help="true | false: no CUDA graphs for decode steps")] = False


class ParallelConfig(msgspec.Struct, **_FROZEN):
    tensor_parallel_size: Annotated[int, at_least(1, kwarg=True, flag=True,
                                                  help="TP ranks per engine")] = 1
    pipeline_parallel_size: Annotated[int, at_least(1, kwarg=True, flag=True,
                                                    help="PP stages per engine")] = 1
    # Independent engine replicas behind one frontend and the router
    # (serve.router); each has its own TP x PP worker group.
    data_parallel_size: Annotated[int, int_in(1, 1024, kwarg=True, flag=True,
                                              help="engine replicas behind one frontend and the router")] = 1
    # Prefill/decode disaggregation (docs/disaggregation.md): engines 0..P-1
    # compute prompts, the others decode; the KV moves through the shared KV
    # folder (cache.offload_disk_path). 0: every engine does both.
    prefill_engines: Annotated[int, int_in(0, 1023, kwarg=True, flag=True,
                                           help="engines that only prefill (P/D; 0: off)")] = 0
    # Where the workers run (uniproc: this process; mp: child processes; ray:
    # Ray actors). Where the engine core runs is engine_actor's to say.
    executor: Annotated[str, one_of(EXECUTORS, kwarg=True, flag=True)] = "uniproc"
    # Run the EngineCore in its own Ray actor (EngineCoreActor), so the
    # frontend's event loop and the engine step never share a GIL. None (the
    # default): on with executor "ray" (what that executor always meant) and
    # in Serve replicas, off for LLM/AsyncLLM with another executor
    # (EngineConfig.core_in_actor). serve.engine_actor is its older
    # spelling and maps onto it.
    engine_actor: Annotated[bool | None, knob("true, false or null (auto)", kwarg=True)] = None
    placement_strategy: Annotated[str, one_of(STRATEGIES, kwarg=True, flag=True)] = "PACK"
    pp_layer_partition: Annotated[list[int] | None, knob(
        "null or a list of ints >= 1, one per pipeline stage",
        lambda v: v is None or all(x >= 1 for x in v))] = None
    # Every wait on a worker is bounded: a step with no reply after this long
    # means a wedged rank, and the engine fails as if that rank had died.
    step_timeout_s: Annotated[float, finite_in(1.0, 86400.0)] = 120.0
    # Added to the first step's bound (lazy compiles, first CUDA allocations).
    first_step_extra_s: Annotated[float, finite_in(0.0, 86400.0)] = 300.0
    # torch.distributed timeout of every collective and PP send/recv.
    collective_timeout_s: Annotated[float, finite_in(1.0, 86400.0)] = 300.0
    # How long the Ray executor waits for its placement group and its workers'
    # first answers; raise it on an autoscaling cluster, where new nodes take
    # minutes to join.
    placement_timeout_s: Annotated[float, finite_in(0.1, 86400.0)] = 10.0
    # How long the Ray executor waits for its new worker actors' first answers
    # (each imports torch and the model code before it can reply).
    worker_start_timeout_s: Annotated[float, finite_in(1.0, 86400.0)] = 120.0
    # Logical CPUs a worker's bundle reserves on a CPU-only cluster: below 1,
    # several ranks share a core (tests, laptops).
    num_cpus_per_worker: Annotated[float, knob("float in (0, 64]", lambda v: 0.0 < v <= 64.0)] = 1.0
    # Recovery from a lost rank (executors mp and ray): the engine rebuilds
    # its worker group and recomputes every in-flight request, at most
    # max_restarts times per restart_window_s; a rebuild that finds no
    # capacity within recovery_timeout_s fails the engine as before.
    max_restarts: Annotated[int, int_in(0, 100)] = 3
    # data_parallel_size > 1: a drain moves its requests in waves of at most
    # the longest moved context's tokens, the next wave once the last one's
    # streams have their first token on their new engine, so each moved
    # stream waits for its own re-prefill, not for all of them together
    # (conveyor/engine/dp/paced_drain.py PacedDrains). Off: every request moves at once.
    paced_drain: Annotated[bool, knob("bool")] = True
    # Mixture-of-experts models: spread the experts over the tensor-parallel
    # ranks (each holds num_experts / tp whole experts) instead of sharding every
    # expert's matrices; attention stays tensor-parallel (conveyor/workers/layers/moe.py).
    enable_expert_parallel: Annotated[bool, knob("bool", kwarg=True, flag=True)] = False
    # CPU: torch threads of each worker; 0: this machine's cores over the
    # ranks that share it (world_size, times data_parallel_size for engines
    # in this process: conveyor/engine/dp/client.py engine_config). Oversubscribed
    # OpenMP threads spin against each other: two in-process engines with a
    # thread per core each decoded 2.2x slower on 2 cores (BENCHMARKS.md
    # "Live migration").
    cpu_threads_per_worker: Annotated[int, int_in(0, 1024)] = 0
    restart_window_s: Annotated[float, finite_in(1.0, 86400.0)] = 600.0
    recovery_timeout_s: Annotated[float, finite_in(1.0, 86400.0)] = 120.0


class SchedulerConfig(msgspec.Struct, **_FROZEN):
    max_num_seqs: Annotated[int, at_least(1, kwarg=True, flag=True, help="max running requests")] = 256
    max_num_batched_tokens: Annotated[int, at_least(1, kwarg=True, flag=True,
                                                    help="token budget per step")] = 2048
    enable_chunked_prefill: Annotated[bool, knob("bool", kwarg=True, flag=True)] = True
    long_prefill_token_threshold: Annotated[int, at_least(0, kwarg=True)] = 0
    policy: Annotated[str, one_of(("fcfs", "priority"), kwarg=True, flag=True)] = "fcfs"
    # Plan step N+1 while step N runs (vLLM's async scheduling, PP = 1 only):
    # "auto" is on where the forward runs on an accelerator and off on CPU
    # (BENCHMARKS.md "Async scheduling"); YAML's on/off spell true/false, which
    # mean the same.
    async_scheduling: Annotated[str | bool, knob(
        "auto, on or off (or true/false)", lambda v: v in ("auto", "on", "off", True, False),
        kwarg=True, flag=True, help="auto | on | off: plan the next step while one runs")] = "auto"
    # The encoder stage: image encoder output rows computed in one step
    # (conveyor/engine/multimodal/encoder_cache.py). One image never exceeds it
    # (the frontend refuses a larger one).
    max_num_encoder_input_tokens: Annotated[int, int_in(1, 1 << 20, kwarg=True)] = 8192


class CacheConfig(msgspec.Struct, **_FROZEN):
    block_size: Annotated[int, one_of(BLOCK_SIZES, kwarg=True, flag=True,
                                      help="KV block size in tokens")] = 16
    gpu_memory_utilization: Annotated[float, knob(
        "float in (0, 1]", lambda v: 0.0 < v <= 1.0, kwarg=True, flag=True,
        help="fraction of GPU memory for the engine")] = 0.9
    num_gpu_blocks: Annotated[int | None, at_least(2, nullable=True, kwarg=True, flag=True,
                                                   help="KV blocks (default: measured)")] = None
    # KV budget when running on CPU
    cpu_kv_cache_bytes: Annotated[int, at_least(1, kwarg=True)] = 1 << 30
    enable_prefix_caching: Annotated[bool, knob("bool", kwarg=True, flag=True)] = True
    # KV tiers below the paged pool (docs/kv_tiers.md): evicted blocks move to
    # host memory, and (with a path) to disk, which survives restarts; 0 = off.
    offload_cpu_gb: Annotated[float, finite_in(0.0, 65536.0, kwarg=True, flag=True,
                                               help="host-memory KV tier in GiB (0: off)")] = 0.0
    offload_disk_path: Annotated[str | None, knob("null or a directory", kwarg=True, flag=True,
                                                  help="disk KV tier directory")] = None
    offload_disk_gb: Annotated[float, finite_in(0.0, 100000.0, kwarg=True, flag=True,
                                                help="disk KV tier in GiB (0: off)")] = 0.0
    # A request waiting for tier KV longer than this recomputes its prefix instead.
    kv_load_timeout_s: Annotated[float, finite_in(0.001, 3600.0, kwarg=True)] = 30.0
    # How long a prefill engine keeps a finished prompt's blocks in the shared
    # KV folder for the decode engine (P/D), and a decode engine waits for them.
    kv_lease_s: Annotated[float, finite_in(0.01, 3600.0, kwarg=True)] = 10.0
    # Data parallel with a shared KV folder: a request routed to an engine
    # while another holds a longer prefix loads the difference from the folder
    # (its blocks are there once that engine finished or evicted them), when
    # the difference is at least peer_fetch_min_tokens (bench/peer_fetch.py
    # measures where a load starts to beat a recompute).
    peer_fetch: Annotated[bool, knob("bool", kwarg=True, flag=True)] = False
    peer_fetch_min_tokens: Annotated[int, int_in(1, 1 << 20, kwarg=True)] = 32


class ServeConfig(msgspec.Struct, **_FROZEN):
    host: Annotated[str, knob("a host name or IP address", bool, flag=True,
                              help="HTTP bind address")] = "127.0.0.1"
    port: Annotated[int, int_in(1, 65535, flag=True, help="HTTP port")] = 8000
    replicas: Annotated[int, at_least(1, flag=True, help="Serve ingress replicas (one engine each; with data_parallel_size > 1 all share the N engines)")] = 1
    api_key_env: Annotated[str | None, knob("null or an environment variable name", flag=True,
                                            help="environment variable holding the API key")] = None
    # None: sized from max_num_seqs
    max_ongoing_requests: Annotated[int | None, at_least(1, nullable=True)] = None
    served_model_name: Annotated[str | None, knob("null or a model name", flag=True,
                                                  help="the `model` name clients send")] = None
    max_body_bytes: Annotated[int, at_least(1)] = 2 * 1024 * 1024
    metrics_public: Annotated[bool, _BOOL] = False
    cors_origins: list[str] = msgspec.field(default_factory=list)
    # A replica admits max_ongoing_requests (None: 2 x max_num_seqs) +
    # max_queued_requests (None: 4 x max_ongoing_requests) requests, all queued
    # in its engine; past that it answers 429 + Retry-After.
    max_queued_requests: Annotated[int | None, at_least(1, nullable=True)] = None
    # SSE: send a choice's tokens once this many are pending (vLLM's
    # --stream-interval); the first token and the finish always go at once.
    stream_interval: Annotated[int, at_least(1)] = 1
    # SSE: after a prompt's first delta, at most one event per this many ms;
    # tokens that arrive in between go out together (Ray Serve LLM's
    # stream_batching_interval_ms). A model slower than this per token is
    # never delayed; a faster one stops paying HTTP work per token.
    stream_batching_interval_ms: Annotated[float, finite_in(0.0, 10000.0)] = 0.0
    # The older spelling of parallel.engine_actor (which see), still accepted:
    # when set, and parallel.engine_actor is not, it sets that knob at load
    # (with executor "ray" the core was always in an actor, so false is
    # ignored there, as before). Nothing reads it after load.
    engine_actor: Annotated[bool | None, knob("true, false or null (unset)")] = None
    # Ray Serve's direct ingress (experimental in Ray 2.60): each replica also
    # serves the API on its own port (30000+), and clients there skip the
    # proxy hop. Every Ray process needs RAY_SERVE_ENABLE_DIRECT_INGRESS=1,
    # which only a process that starts Ray can set. None (the default): on
    # where Conveyor starts Ray itself (`conveyor serve`, run_serve without a
    # running Ray), off on an existing cluster; true/false: always / never.
    direct_ingress: Annotated[bool | None, knob("true, false or null (auto)")] = None
    # CPU replicas (core in an actor, executor not "ray", no GPU): the last this
    # many cores of the node run the replica's threads (HTTP, Serve, output
    # processing), the others the engine's step thread, as vLLM's CPU backend
    # reserves a core for its frontend (conveyor/cluster/engine_actor/cpu_layout.py). 0: no pinning.
    # None (the default): 1 for a single CPU replica, else 0.
    frontend_cpus: Annotated[int | None, knob("null (auto) or an int in 0..64",
                                              lambda v: v is None or 0 <= v <= 64)] = None
    # How "auto" tool_choice finds calls in generated text, and the format
    # "required"/named tool_choice constrain output to (conveyor/cluster/openai/tools/parsers/):
    # hermes (<tool_call>{...}</tool_call>, Qwen) or llama3_json (bare JSON).
    tool_call_parser: Annotated[str, one_of(TOOL_CALL_PARSERS)] = "hermes"
    # Whether the `priority` request field (policy "priority") is honoured:
    # off by default, so one client cannot jump every other client's queue.
    # Off, a request that sends a non-default priority gets 400.
    allow_client_priority: Annotated[bool, _BOOL] = False
    # Which engine serves a request when parallel.data_parallel_size > 1
    # (conveyor/engine/dp/router/policy.py). Offline LLM(...) and batch jobs too, so its
    # flag is among the engine options.
    router: Annotated[str, one_of(ROUTER_POLICIES, kwarg=True, flag=True, cli_group="engine")] = "kv_aware"
    # Stored /v1/responses (store: true): a sqlite file in this directory
    # behind one named Ray actor (None: <tmpdir>/conveyor-responses), at most
    # responses_max_entries of them (oldest dropped), each kept responses_ttl_s.
    responses_store_dir: Annotated[str | None, knob("null or a directory")] = None
    responses_max_entries: Annotated[int, int_in(1, 10_000_000)] = 10000
    responses_ttl_s: Annotated[float, finite_in(1.0, 365 * 86400.0)] = 86400.0
    # Engine autoscaling (conveyor/engine/dp/scale_policy.py, conveyor/engine/dp/scaling.py): the
    # data-parallel engines in service move between min_engines and
    # max_engines (None: parallel.data_parallel_size, the count it starts
    # with) on a load signal, one engine at a time, each move held for its
    # delay first; a scale-down drains the engine through migration.
    min_engines: Annotated[int | None, int_in(1, 1024, nullable=True, kwarg=True, flag=True,
                                              help="fewest engines autoscaling keeps")] = None
    max_engines: Annotated[int | None, int_in(1, 1024, nullable=True, kwarg=True, flag=True,
                                              help="most engines autoscaling starts")] = None
    # waiting: requests queued in the engines (scale up past the target per
    # engine); kv_usage: the fraction of KV blocks in use (past the target).
    autoscale_signal: Annotated[str, one_of(SCALE_SIGNALS, flag=True)] = "waiting"
    target_waiting_per_engine: Annotated[float, finite_in(0.0, 1e6, flag=True)] = 2.0
    target_kv_usage: Annotated[float, finite_in(0.01, 1.0, flag=True)] = 0.8
    # How long the signal must ask for a move before it is made (Ray Serve's
    # upscale_delay_s / downscale_delay_s); 0 acts on the next look.
    upscale_delay_s: Annotated[float, finite_in(0.0, 86400.0, flag=True)] = 30.0
    downscale_delay_s: Annotated[float, finite_in(0.0, 86400.0, flag=True)] = 600.0
    autoscale_interval_s: Annotated[float, finite_in(0.01, 3600.0)] = 1.0


class StructuredOutputsConfig(msgspec.Struct, **_FROZEN):
    backend: Annotated[str, one_of(GRAMMAR_BACKENDS)] = "llguidance"
    # grammar compiles run here, never on the step loop
    compile_threads: Annotated[int, int_in(1, 64)] = 1
    # JSON schemas (response_format, structured_outputs.json, tool parameters):
    # false (default, xgrammar's strict mode) = an object declaring properties
    # without additionalProperties admits no other keys; true = JSON Schema's
    # open default (conveyor/engine/structured_output/schema.py).
    allow_additional_properties: Annotated[bool, _BOOL] = False


class SpeculativeConfig(msgspec.Struct, **_FROZEN):
    """N-gram (prompt-lookup) speculative decoding; method None = off.
    Drafts: the k tokens that followed the longest earlier occurrence (length
    prompt_lookup_max down to prompt_lookup_min) of the sequence's suffix."""
    method: Annotated[str | None, knob("null or ngram", lambda v: v in (None, "ngram"),
                                       flag="--speculative-method",
                                       help="ngram: n-gram (prompt-lookup) speculative decoding")] = None
    num_speculative_tokens: Annotated[int, int_in(1, 8, flag=True,
                                                  help="draft tokens per step, 1..8")] = 4
    prompt_lookup_min: Annotated[int, int_in(1, 16)] = 2
    prompt_lookup_max: Annotated[int, int_in(1, 16)] = 4

    @property
    def enabled(self) -> bool:
        return self.method is not None


class LoRAConfig(msgspec.Struct, **_FROZEN):
    """Multi-LoRA (PEFT adapters): at most max_loras distinct adapters in one
    step (the slots), ranks up to max_lora_rank, max_cpu_loras parsed adapters
    kept in host memory (None: max_loras). `adapters` {name: path} are checked
    at start and addressable by name (HTTP `model`)."""
    enable: Annotated[bool, knob("bool", kwarg="enable_lora", flag="--enable-lora",
                                 help="true | false: serve PEFT LoRA adapters")] = False
    max_loras: Annotated[int, int_in(1, 256, kwarg=True, flag=True,
                                     help="distinct LoRA adapters in one step")] = 1
    max_lora_rank: Annotated[int, int_in(1, 512, kwarg=True, flag=True,
                                         help="largest LoRA rank accepted")] = 16
    max_cpu_loras: Annotated[int | None, int_in(1, 4096, nullable=True, kwarg=True, flag=True,
                                                help="LoRA adapters kept in host memory")] = None
    adapters: Annotated[dict[str, str], knob("a mapping {adapter name: PEFT adapter directory}")] = \
        msgspec.field(default_factory=dict)


class MultimodalConfig(msgspec.Struct, **_FROZEN):
    """Image inputs (docs/multimodal.md): at most limit_per_prompt images per
    prompt, each of at most max_image_pixels pixels (checked on the file's
    header, before decoding); http(s) image URLs only from
    allowed_media_domains (exact hosts, or ".example.com" for its
    subdomains; empty: data: URLs only). The workers keep encoder outputs of
    up to encoder_cache_tokens rows (an image's rows never exceed it)."""
    limit_per_prompt: Annotated[int, int_in(0, 256, kwarg=True, flag=True,
                                            help="images per prompt")] = 4
    max_image_pixels: Annotated[int, int_in(1, 1 << 31, kwarg=True)] = 16_777_216
    encoder_cache_tokens: Annotated[int, int_in(1, 1 << 24, kwarg=True)] = 16384
    allowed_media_domains: Annotated[list[str], knob(
        "a list of host names", lambda v: all(isinstance(d, str) and d.strip(".") for d in v),
        kwarg=True)] = msgspec.field(default_factory=list)


class EngineConfig(msgspec.Struct, **_FROZEN):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    serve: ServeConfig = msgspec.field(default_factory=ServeConfig)
    structured_outputs: StructuredOutputsConfig = msgspec.field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    multimodal: MultimodalConfig = msgspec.field(default_factory=MultimodalConfig)

    @property
    def max_model_len(self) -> int:
        if self.model.max_model_len is None:
            raise RuntimeError("config not resolved: build it with build_config()")
        return self.model.max_model_len

    @property
    def world_size(self) -> int:
        return self.parallel.tensor_parallel_size * self.parallel.pipeline_parallel_size

    def core_in_actor(self, serving: bool = False) -> bool:
        """Whether the EngineCore runs in its own Ray actor: parallel.engine_actor
        when set (YAML's older serve.engine_actor maps onto it at load). Unset: on
        with executor "ray" (that key's meaning before the knob existed) and in
        Serve replicas (`serving`), off for LLM/AsyncLLM with another executor."""
        p = self.parallel
        if p.engine_actor is not None:
            return p.engine_actor
        return p.executor == "ray" or serving

"""LLM: offline generation in this process (vLLM-compatible names).

The composition root of the offline path: config -> executor -> EngineCore,
plus the tokenizer and the per-request output state. When the core runs
elsewhere (parallel.engine_actor: an EngineCoreActor) or as N engines, a
CoreClient (conveyor/engine/core_client.py; a caller may hand in the factory of its
actor client) is stepped through SyncCoreEngine."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from conveyor.engine.config import EngineConfig, build_config, check_model_dir, load_config
from conveyor.engine.contracts import EngineCoreRequest
from conveyor.engine.core.engine_core import EngineCore
from conveyor.engine.core_client import NOT_DATA_PARALLEL, CoreClientFactory, FleetAdmin, metric_dict
from conveyor.engine.frontend.clients import make_core_client
from conveyor.engine.frontend.expert_counters import ExpertCounters
from conveyor.engine.frontend.kv_tier_counters import KVTierCounters
from conveyor.engine.frontend.output_processor import CompletionOutput, RequestOutput, RequestState, resumed_requests
from conveyor.engine.frontend.prepare import Frontend, PreparedRequest, Prompt
from conveyor.engine.frontend.sync_engine import SyncCoreEngine
from conveyor.engine.frontend.tokenizer import Tokenizer
from conveyor.engine.lora import LoRARequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.spec_decode.metrics import SpecDecodeCounters

__all__ = ["LLM", "RequestOutput", "CompletionOutput"]


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 core_client_factory: CoreClientFactory | None = None, **kwargs: Any) -> None:
        """`core_client_factory` builds the client of a core in an actor
        (default: cluster's RayCoreClient, imported only when asked for)."""
        if config is None:
            config = build_config(model=model or "", **kwargs)
        elif model is not None or kwargs:
            raise ValueError("pass either config= or model/keyword arguments, not both")
        if not config.model.path:
            raise ValueError("model is required: a local Hugging Face checkpoint directory")
        check_model_dir(config)
        self.config = config
        self.engine = self._make_engine(config, core_client_factory)
        self.frontend = Frontend(config, self.engine.kv_info.vocab_size)
        self.tokenizer = self.frontend.tokenizer
        self._ids = itertools.count()
        self._spec_counters = SpecDecodeCounters()
        self._expert_counters = ExpertCounters()
        self._kv_counters = KVTierCounters()
        self._encoder_cache_hits = 0

    @staticmethod
    def _make_engine(config: EngineConfig, actor_factory: CoreClientFactory | None) -> Any:
        if config.parallel.data_parallel_size > 1 or config.core_in_actor():
            return SyncCoreEngine(make_core_client(config, actor_factory))
        from conveyor.executors import make_executor

        return EngineCore(config, make_executor(config))

    @classmethod
    def from_config(cls, path: str, **overrides: Any) -> LLM:
        config = load_config(path, **overrides)
        check_model_dir(config, source=path)
        return cls(config=config)

    # ---- generation ------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `priority` (one per prompt,
        lower runs first) matters with policy="priority". `lora_request`: one
        adapter for every prompt, or a list with one per prompt (None = base)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"got {len(prios)} priorities for {len(prompts)} prompts")
        loras = _as_lora_list(lora_request, len(prompts))
        # Build and validate every request first: on bad input nothing is queued.
        batch = [self._make_requests(p, sp, pr, lr)
                 for p, sp, pr, lr in zip(prompts, params, prios, loras)]
        states: dict[str, RequestState] = {}
        for _, pairs in batch:
            for ecr, st in pairs:
                self.engine.add_request(ecr)
                states[ecr.request_id] = st
        self._run(states, use_tqdm)
        results = []
        for prep, reqs in batch:
            sts = [st for _, st in reqs]
            results.append(RequestOutput(prep.request_id, prep.prompt, prep.prompt_token_ids,
                                         [st.completion() for st in sts],
                                         max(st.num_cached_tokens for st in sts), True,
                                         sts[0].prompt_logprobs))
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation of OpenAI-shaped messages (or a list of them)
        through the model's chat template (vLLM's LLM.chat); text and
        image_url parts (data: URLs; http(s) from multimodal.allowed_media_domains)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = [self.frontend.chat_prompt(c, add_generation_prompt, chat_template)  # type: ignore[arg-type]
                                 for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _make_requests(self, prompt: Prompt, sp: SamplingParams, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> tuple[PreparedRequest, list[tuple[EngineCoreRequest, RequestState]]]:
        prep = self.frontend.prepare(prompt, sp, f"req{next(self._ids)}", priority,
                                     lora_request=lora_request)
        states = [RequestState.make(c.request_id, k, c.sampling_params, prep.prompt_token_ids,
                                    self.tokenizer, c) for k, c in enumerate(prep.children)]
        return prep, list(zip(prep.children, states))

    def _run(self, states: dict[str, RequestState], use_tqdm: bool) -> None:
        pending = set(states)
        bar = _progress(len(pending)) if use_tqdm else None
        try:
            while pending:
                outs, _ = self.engine.step_fn()
                if outs is not None and outs.scheduler_stats is not None:
                    self._spec_counters.absorb(outs.scheduler_stats)
                    self._expert_counters.absorb(outs.scheduler_stats)
                    self._kv_counters.absorb(outs.scheduler_stats)
                    self._encoder_cache_hits += outs.scheduler_stats.encoder_cache_hits
                if outs is not None and outs.resume is not None:  # only a SyncCoreEngine asks
                    self.engine.resume(outs.resume.tag, resumed_requests(outs.resume, states.get))
                for o in (outs.outputs if outs is not None else ()):
                    st = states.get(o.request_id)
                    if st is None:
                        continue
                    if st.process(o):
                        self.engine.abort_requests([o.request_id])
                    if st.finished and o.request_id in pending:
                        pending.discard(o.request_id)
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_work() and pending:
                    raise RuntimeError(f"engine went idle with {len(pending)} unfinished requests")
        except BaseException:
            self.engine.abort_requests(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()

    def worker_pids(self) -> list[int]:
        """Live worker process ids in rank order (this process with executor uniproc)."""
        return self.engine.worker_pids()

    def get_metrics(self) -> dict[str, float]:
        """Current counter values keyed by metric name (speculative decoding:
        conveyor:spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens,
        ..._num_accepted_tokens_per_pos{position="i"})."""
        out = {**self._spec_counters.as_dict(), **self._expert_counters.as_dict(),
               **self._kv_counters.as_dict()}
        if self.frontend.images is not None:  # a vision-language model
            out["conveyor_encoder_cache_hits_total"] = float(self._encoder_cache_hits)
        admin = self._admin()
        if admin is not None:  # data parallel: per-engine and router series
            out.update(metric_dict(admin.metric_rows()))
        return out

    def _admin(self) -> FleetAdmin | None:
        return self.engine.client.admin if isinstance(self.engine, SyncCoreEngine) else None

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def drain(self, engine: int, timeout_s: float = 60.0) -> int:
        """Data parallel, from another thread while generate() runs: move every
        request off `engine` to the others (DataParallelClient.drain); returns
        how many moved, once the engine holds none."""
        admin = self._admin()
        if admin is None:
            raise ValueError(NOT_DATA_PARALLEL)
        return admin.drain(engine, timeout_s)

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt of token ids
    for p in items:
        if not isinstance(p, (str, list, dict)):
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict "
                             f"(prompt, multi_modal_data), got {type(p).__name__}")
    return items


def _as_params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
    return sp


def _as_lora_list(lr: LoRARequest | Sequence[LoRARequest | None] | None,
                  n: int) -> list[LoRARequest | None]:
    if lr is None or isinstance(lr, LoRARequest):
        return [lr] * n
    lr = list(lr)
    if len(lr) != n:
        raise ValueError(f"lora_request: got {len(lr)} entries for {n} prompts")
    return lr


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)

"""ModelRunner: turns SchedulerOutputs into forward passes and samples.

It keeps a mirror of the scheduler's view (CachedRequestState per request and
the persistent InputBatch), updated from each SchedulerOutput diff, so new
requests travel in full once and running ones only as deltas.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from conveyor.engine.sampling_params import SamplingFields
from conveyor.kernels import huge_pages
from conveyor.kernels.backends import AttentionMetadata, get_attention_backend
from conveyor.parallel.communication import IntermediateTensors
from conveyor.parallel.layers import mark_decode_rows
from conveyor.workers.cuda_graphs import CudaGraphCapturer, DecodeGraphRunner, capture_sizes, graphs_refused
from conveyor.workers.dummy_batch import (
    DummyShape,
    blocks_needed,
    dummy_step,
    profile_sampling_params,
    profile_shape,
    warmup_shapes,
)
from conveyor.workers.forward_context import set_forward_context
from conveyor.workers.grammar_mask import apply_grammar_bitmask
from conveyor.workers.input_batch import CachedRequestState, InputBatch, PreparedInputs, prepare_inputs
from conveyor.workers.kv_connector.base import KVConnectorWorker
from conveyor.workers.layers.attention import find_attention_layers
from conveyor.workers.layers.moe import FusedMoE, take_routed_tokens
from conveyor.workers.lora.mapping import set_lora_mapping
from conveyor.workers.mm_encoder import EncoderRunner
from conveyor.workers.prompt_logprobs import compute_prompt_logprobs
from conveyor.workers.rejection_sampler import SpecLayout, sample_with_drafts
from conveyor.workers.sampler import Sampler, SamplingMetadata, plain_greedy, row_argmax

if TYPE_CHECKING:
    from conveyor.workers.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass
class _PendingSample:
    """Between execute_model and sample_tokens: logits of this step's rows."""
    logits: torch.Tensor
    req_ids: list[str]
    # Rows whose chunk reaches the end of their known tokens sample a token;
    # partial prefill chunks do not.
    samples: np.ndarray
    # Set when some row verifies drafts: logits has one row per draft + 1.
    spec: SpecLayout | None = None
    # This step's prompt logprobs (rows with prompt_logprobs in prefill).
    prompt_logprobs: dict[str, PromptLogprobs] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, device: torch.device,
                 vocab_size: int, is_last_stage: bool = True, is_first_stage: bool = True) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.vocab_size = vocab_size
        self.is_last_stage = is_last_stage
        self.is_first_stage = is_first_stage
        self.block_size = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        # Live requests that asked for prompt logprobs: while empty, a step
        # pays nothing for them.
        self._prompt_logprobs_reqs: set[str] = set()
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, config.max_model_len,
                                      self.block_size)
        self.attn_backend = get_attention_backend(config.model.attention_backend, device,
                                                  cpu_isa=config.model.cpu_isa)
        spec = config.speculative
        mark_decode_rows(model, config.scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens
                                                                      if spec.enabled else 0)))
        self.sampler = Sampler()
        self.moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.kv_caches: list[torch.Tensor] = []
        self._pending: _PendingSample | None = None
        self.lora = make_lora_manager(config, model, device)
        # Captured decode graphs (CUDA + triton only), made by warm_up().
        self.graphs: DecodeGraphRunner | None = None
        # KV beyond the pool (conveyor/workers/kv_connector/), set after warm-up.
        self.kv_connector: KVConnectorWorker | None = None
        # The encoder stage of a vision-language model (its first PP stage embeds).
        self.mm = (EncoderRunner(model, device)
                   if getattr(model, "supports_images", False) and is_first_stage else None)

    # ---- KV cache ------------------------------------------------------------

    def kv_bytes_per_block(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_size * elem
                   for a in find_attention_layers(self.model))

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        # Zeroed: masked-out slots must not hold NaN (0 * NaN poisons the sum).
        self.kv_caches = []
        for i, attn in enumerate(find_attention_layers(self.model)):
            shape = attn.kv_cache_shape(num_blocks, self.block_size)
            # On CPU on huge pages: decode attention streams the cache (kernels/huge_pages.py).
            cache = (huge_pages.zeros(shape, dtype) if self.device.type == "cpu"
                     else torch.zeros(shape, dtype=dtype, device=self.device))
            attn.kv_cache = cache
            attn.layer_index = i
            self.kv_caches.append(cache)

    # ---- profile and warm-up ------------------------------------------------------

    def dummy_run(self, shape: DummyShape, with_prompt_logprobs: bool = False) -> None:
        """One synthetic step through the real path (paged attention in a
        forward context, logits and the sampler on the last stage; a non-first
        stage gets zero IntermediateTensors instead of a PP receive), then its
        requests are removed again. Needs a KV cache of enough blocks."""
        if self.input_batch.num_reqs or self.requests:
            raise RuntimeError("dummy_run() needs an idle runner")
        sp: SamplingFields = profile_sampling_params(self.vocab_size)
        if with_prompt_logprobs:  # the profile's peak includes their logits passes
            sp = sp.clone(prompt_logprobs=sp.logprobs)
        step, cleanup = dummy_step(shape, self.block_size, sp)
        inter = None if self.is_first_stage else self._zero_intermediates(shape.num_tokens)
        try:
            if self.execute_model(step, inter) is None:
                self.sample_tokens()
        finally:
            self._pending = None
            self.execute_model(cleanup)
            take_routed_tokens(self.moe_layers)  # a profile's routing is no one's

    def _zero_intermediates(self, num_tokens: int) -> IntermediateTensors:
        hidden = self.model.config.hidden_size
        dtype = next(self.model.parameters()).dtype
        z = torch.zeros(num_tokens, hidden, dtype=dtype, device=self.device)
        return IntermediateTensors({"hidden_states": z, "residual": z.clone()})

    def profile_run(self, dtype: torch.dtype) -> int:
        """Run the largest possible step on a temporary KV cache sized for it
        (the real one is not allocated yet); returns that cache's bytes, which
        the caller subtracts from the peak it measured."""
        c = self.config
        shape = profile_shape(c.scheduler.max_num_batched_tokens, c.scheduler.max_num_seqs,
                              c.max_model_len)
        num_blocks = blocks_needed(shape, self.block_size) + 1
        self.allocate_kv_cache(num_blocks, dtype)
        try:
            self.dummy_run(shape, with_prompt_logprobs=True)
            return num_blocks * self.kv_bytes_per_block(dtype)
        finally:
            self.free_kv_cache()

    def warm_up(self) -> None:
        """Compile the attention kernels for the step shapes a real batch
        uses, on the real cache; then zero it again (masked slots must stay
        finite)."""
        c = self.config
        usable = (self.kv_caches[0].shape[0] - 1) if self.kv_caches else 0
        for shape in warmup_shapes(self.block_size, c.max_model_len, c.scheduler.max_num_seqs):
            if blocks_needed(shape, self.block_size) <= usable:
                self.dummy_run(shape)
        for cache in self.kv_caches:
            cache.zero_()
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """Capture the decode graphs on the real KV cache (padding writes none of it)."""
        why = graphs_refused(self.config, self.device, self.attn_backend.name)
        if why is not None or not self.is_first_stage or not self.kv_caches:
            log.info("decode steps run eagerly: %s", why or "no KV cache / not the first stage")
            return
        sizes = capture_sizes(self.config.scheduler.max_num_seqs)
        self.graphs = DecodeGraphRunner(self._graph_forward, sizes, self.input_batch.block_table.table.shape[1],
                                        self.config.max_model_len, self.device, CudaGraphCapturer())
        with torch.inference_mode():
            self.graphs.capture_all()
        log.info("captured decode CUDA graphs for batch sizes %s", sizes)

    def _graph_forward(self, meta: AttentionMetadata, input_ids: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        with set_forward_context(meta, self.attn_backend):
            return self.model(input_ids, positions, None)

    def free_kv_cache(self) -> None:
        self.graphs = None  # they address the cache being freed
        for attn in find_attention_layers(self.model):
            attn.kv_cache = None
        self.kv_caches = []

    # ---- state updates -------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        if self.mm is not None:  # evictions apply before this step's images are encoded
            self.mm.free(so.free_encoder_mm_hashes)
        for rid in sorted(so.finished_req_ids):
            self.requests.pop(rid, None)
            if self.mm is not None:
                self.mm.forget(rid)
            self._prompt_logprobs_reqs.discard(rid)
            batch.remove_request(rid)
        cached = so.scheduled_cached_reqs
        resumed = set(cached.resumed_req_ids)
        # Rows not scheduled this step leave the batch (their state stays).
        for rid in [r for r in batch.req_id_to_index if r not in so.num_scheduled_tokens or r in resumed]:
            batch.remove_request(rid)
        to_add = [self._new_state(nr) for nr in so.scheduled_new_reqs]
        for i, rid in enumerate(cached.req_ids):
            st = self.requests[rid]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            if rid in resumed:
                st.block_ids = list(new_blocks or [])
                st.output_token_ids = cached.resumed_token_ids[rid][len(st.prompt_token_ids):]
            elif new_blocks:
                st.block_ids.extend(new_blocks)
            if cached.new_token_ids:
                self._absorb_tokens(st, cached.new_token_ids[i])
            row = batch.req_id_to_index.get(rid)
            if row is None:
                to_add.append(st)
                continue
            batch.num_computed_tokens[row] = st.num_computed_tokens
            if new_blocks:
                batch.block_table.append_row(new_blocks, row)
            if cached.new_token_ids:
                for t in st.output_token_ids[batch.num_tokens[row] - len(st.prompt_token_ids):]:
                    batch.append_token(row, t)
        for st in to_add:
            batch.add_request(st)
        batch.condense()
        if self.mm is not None and so.scheduled_encoder_inputs:  # part of the diff, even in a step
            self.mm.execute(so, self.requests)                   # whose tokens were all preempted
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            batch.set_draft_tokens(batch.req_id_to_index[rid], drafts)

    def _new_state(self, nr: NewRequestData) -> CachedRequestState:
        sp = nr.sampling_params
        gen = None
        if sp.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sp.seed)
        st = CachedRequestState(nr.req_id, list(nr.prompt_token_ids), sp, gen, list(nr.block_ids),
                                nr.num_computed_tokens, list(nr.output_token_ids), nr.eos_token_id,
                                nr.lora_request, list(nr.mm_features))
        self.requests[nr.req_id] = st
        if sp.prompt_logprobs is not None:
            self._prompt_logprobs_reqs.add(nr.req_id)
        return st

    @staticmethod
    def _absorb_tokens(st: CachedRequestState, tokens: list[int]) -> None:
        """PP non-last stages learn sampled tokens from the scheduled slice."""
        known = st.num_tokens
        start = st.num_computed_tokens
        for j, t in enumerate(tokens):
            if start + j >= known:
                st.output_token_ids.append(t)

    # ---- forward ---------------------------------------------------------------

    def _prepare(self, so: SchedulerOutput) -> tuple[PreparedInputs, np.ndarray, list[str]]:
        batch = self.input_batch
        req_ids = cast(list[str], batch.req_ids[:batch.num_reqs])  # rows < num_reqs are live
        num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        return prepare_inputs(batch, num_sched, self.block_size), num_sched, req_ids

    def _attn_metadata(self, p: PreparedInputs) -> AttentionMetadata:
        dev = self.device
        n = len(p.seq_lens)
        bt = self.input_batch.block_table.table[:n]
        max_blocks = int(-(-int(p.seq_lens.max()) // self.block_size))
        q_lens = np.diff(p.query_start_loc)
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(p.slot_mapping).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(p.query_start_loc).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(p.seq_lens).to(dev, non_blocking=True),
            block_table=torch.from_numpy(np.ascontiguousarray(bt[:, :max_blocks])).to(dev, non_blocking=True),
            max_query_len=int(q_lens.max()), max_seq_len=int(p.seq_lens.max()),
            query_start_loc_cpu=p.query_start_loc, seq_lens_cpu=p.seq_lens)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, intermediate_tensors: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        """None on the last stage (logits kept for sample_tokens), the
        IntermediateTensors to send on other stages."""
        if self.kv_connector is not None:  # before the forward: it may read or fill blocks
            self.kv_connector.start_load_kv(so.kv_connector_metadata)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            kvo = None
            if self.kv_connector is not None:
                self.kv_connector.wait_idle(0.01)  # nothing to compute: let loads land
                kvo = self.kv_connector.get_output()
            return EMPTY_MODEL_RUNNER_OUTPUT if kvo is None else ModelRunnerOutput(
                [], {}, [], kv_connector_output=kvo)
        p, num_sched, req_ids = self._prepare(so)
        lora_mapping = None
        if self.lora is not None:
            lora_mapping = self.lora.step_mapping(
                [self.requests[r].lora_request for r in req_ids], p.req_indices)
        # Captured graphs hold no LoRA deltas: a LoRA engine always runs eagerly.
        # Graphs are refused under PP, so only a last stage replays one.
        # A layerwise KV connector's hooks are not in the captured graphs: eager then.
        layerwise = self.kv_connector is not None and self.kv_connector.layerwise
        embeds, mpos = self._mm_inputs(p, num_sched, req_ids) if self.mm is not None else (None, None)
        out = (self._graph_step(p, so) if self.graphs is not None and self.lora is None and not layerwise
               and embeds is None and mpos is None else None)
        if out is None:
            meta = self._attn_metadata(p)
            input_ids = torch.from_numpy(p.input_ids).to(self.device)
            positions = mpos if mpos is not None else torch.from_numpy(p.positions.astype(np.int64)).to(self.device)
            conn = self.kv_connector if layerwise else None
            with set_forward_context(meta, self.attn_backend, conn), set_lora_mapping(lora_mapping):
                hidden = self.model(input_ids, positions, intermediate_tensors, embeds)
            if not self.is_last_stage:
                return hidden  # the IntermediateTensors to send
            out = hidden
        spec = None
        logits_indices = p.logits_indices
        if so.scheduled_spec_decode_tokens:
            spec = SpecLayout.build([so.scheduled_spec_decode_tokens.get(r, []) for r in req_ids])
            logits_indices = spec.logits_indices(p.logits_indices)
        if len(logits_indices) == out.shape[0]:  # increasing indices into every row: each row once
            logits = self.model.compute_logits(out)
        else:
            logits_idx = torch.from_numpy(logits_indices.astype(np.int64)).to(self.device)
            logits = self.model.compute_logits(out[logits_idx])
        batch = self.input_batch
        rows = np.arange(len(req_ids))
        samples = batch.num_computed_tokens[rows] + num_sched >= batch.num_tokens[rows]
        plp = None
        if self._prompt_logprobs_reqs:
            plp = compute_prompt_logprobs(self.model.compute_logits, out,
                                          [self.requests[r] for r in req_ids],
                                          batch.num_computed_tokens[rows], num_sched, p.query_start_loc)
        self._pending = _PendingSample(logits, req_ids, samples, spec, plp)
        return None

    def _mm_inputs(self, p: PreparedInputs, num_sched: np.ndarray,
                   req_ids: list[str]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(input embeddings with the step's image rows in place; M-RoPE
        [3, T] positions), each None when the step needs none."""
        assert self.mm is not None
        computed = self.input_batch.num_computed_tokens[np.arange(len(req_ids))]
        input_ids = torch.from_numpy(p.input_ids).to(self.device)
        embeds = self.mm.inputs_embeds(self.requests, req_ids, computed, num_sched, p.query_start_loc, input_ids)
        states = [self.requests[r] for r in req_ids]
        return embeds, self.mm.mrope(states, computed, num_sched, p.query_start_loc, p.positions)

    def _graph_step(self, p: PreparedInputs, so: SchedulerOutput) -> torch.Tensor | None:
        """Replay a captured graph for a decode-only step (one token per row,
        no drafts); None: run eagerly (a prefill, or past the largest size)."""
        n = len(p.seq_lens)
        if len(p.input_ids) != n or so.scheduled_spec_decode_tokens:
            return None
        max_blocks = int(-(-int(p.seq_lens.max()) // self.block_size))
        bt = np.ascontiguousarray(self.input_batch.block_table.table[:n, :max_blocks])
        assert self.graphs is not None  # the caller checked
        return self.graphs.run(p.input_ids, p.positions.astype(np.int64), p.slot_mapping,
                               p.seq_lens, bt)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        out = self._sample_tokens(grammar_output)
        out.expert_tokens = take_routed_tokens(self.moe_layers)
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save()
            out.kv_connector_output = self.kv_connector.get_output()
        return out

    def _sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("sample_tokens() called without a preceding execute_model()")
        states = [self.requests[r] for r in pending.req_ids]
        if pending.spec is not None:
            return self._sample_spec(pending, states, grammar_output)
        if grammar_output is not None:
            apply_grammar_bitmask(pending.logits, pending.req_ids, grammar_output)
        logprobs = None
        if plain_greedy(states):
            tokens = row_argmax(pending.logits).tolist()
        else:
            out = self.sampler(pending.logits, SamplingMetadata.build(states, self.vocab_size, self.device))
            tokens, logprobs = out.sampled_token_ids.tolist(), out.to_lists()
        sampled: list[list[int]] = []
        batch = self.input_batch
        for row, (st, tok, keep) in enumerate(zip(states, tokens, pending.samples)):
            if keep:
                st.output_token_ids.append(tok)
                batch.append_token(row, tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(pending.req_ids, {r: i for i, r in enumerate(pending.req_ids)},
                                 sampled, logprobs, prompt_logprobs=pending.prompt_logprobs)

    def _sample_spec(self, pending: _PendingSample, states: list[CachedRequestState],
                     grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """A step that verifies drafts: several tokens per row."""
        spec = pending.spec
        assert spec is not None
        if grammar_output is not None:  # one mask row per draft position plus one
            apply_grammar_bitmask(pending.logits, pending.req_ids, grammar_output, spec.offsets)
        emitted, logprobs = sample_with_drafts(pending.logits, states, spec, self.vocab_size,
                                               self.device)
        batch = self.input_batch
        sampled: list[list[int]] = []
        for row, (st, toks, keep) in enumerate(zip(states, emitted, pending.samples)):
            if not keep:
                sampled.append([])
                continue
            st.output_token_ids.extend(toks)
            for t in toks:
                batch.append_token(row, t)
            sampled.append(toks)
        return ModelRunnerOutput(pending.req_ids, {r: i for i, r in enumerate(pending.req_ids)},
                                 sampled, logprobs, prompt_logprobs=pending.prompt_logprobs)


def make_lora_manager(config: EngineConfig, model: LlamaForCausalLM, device: torch.device) -> Any:
    """A LoRAManager (wrapping the model's projections) when lora.enable, else None."""
    if not config.lora.enable:
        return None
    from conveyor.engine.lora import ModelDims
    from conveyor.workers.lora.manager import LoRAManager

    return LoRAManager(model, config.lora, ModelDims.from_model_dir(config.model.path), device)

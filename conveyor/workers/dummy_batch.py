"""Synthetic SchedulerOutputs that drive a ModelRunner through its real path
(states, inputs, attention metadata, paged attention in a forward context,
logits, sampler) without a scheduler: the KV-sizing profile and the warm-up
that compiles the attention kernels before the engine reports ready."""
from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.contracts import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.engine.sampling_params import MAX_LOGPROBS, SamplingFields, SamplingParams

DUMMY_PREFIX = "_conveyor_dummy_"


@dataclass(frozen=True)
class DummyShape:
    """num_seqs sequences of seq_len tokens; the last query_len of each are
    this step's queries (query_len == seq_len: a prefill, 1: a decode)."""
    num_seqs: int
    seq_len: int
    query_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len


def _longest(max_model_len: int) -> int:
    # A sampled token is appended after the sequence: it must still fit.
    return max(1, max_model_len - 1)


def profile_shape(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> DummyShape:
    """The largest step the scheduler can build: the full token budget as
    prefills, spread over as many sequences as may run (each within
    max_model_len), so the sampler also sees its widest batch."""
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    per_seq = max(1, min(_longest(max_model_len), max_num_batched_tokens // seqs))
    return DummyShape(seqs, per_seq, per_seq)


def warmup_shapes(block_size: int, max_model_len: int, max_num_seqs: int) -> list[DummyShape]:
    """A mixed prefill and a decode-only batch long enough for the split-KV
    decode path (>= 16 blocks): the Triton kernel variants a real step uses."""
    seqs = min(2, max_num_seqs)
    prefill = min(_longest(max_model_len), block_size + 1)
    decode = min(_longest(max_model_len), 16 * block_size)
    return [DummyShape(seqs, prefill, prefill), DummyShape(seqs, decode, 1)]


def blocks_needed(shape: DummyShape, block_size: int) -> int:
    """KV blocks the batch writes, excluding the null block 0."""
    return shape.num_seqs * -(-shape.seq_len // block_size)


def profile_sampling_params(vocab_size: int) -> SamplingParams:
    """Every sampler feature that allocates per [batch, vocab]: the profile
    must see the sampler's peak, not a greedy argmax."""
    # Seeded: each dummy row draws from its own generator, so the profile
    # leaves the global RNG (unseeded requests' randomness) untouched.
    return SamplingParams(temperature=1.0, seed=0, top_k=min(50, vocab_size), top_p=0.9, min_p=0.05,
                          max_tokens=1, logprobs=min(MAX_LOGPROBS, vocab_size),
                          logit_bias={0: 1.0}, allowed_token_ids=list(range(vocab_size)),
                          presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1)


def dummy_step(shape: DummyShape, block_size: int, sp: SamplingFields,
               first_block: int = 1) -> tuple[SchedulerOutput, SchedulerOutput]:
    """(the step, the step that removes its requests again). Request i owns
    consecutive blocks from first_block on; token ids are 0."""
    per_seq = -(-shape.seq_len // block_size)
    new, sched = [], {}
    for i in range(shape.num_seqs):
        rid = f"{DUMMY_PREFIX}{i}"
        blocks = list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
        new.append(NewRequestData(rid, [0] * shape.seq_len, sp, blocks,
                                  shape.seq_len - shape.query_len))
        sched[rid] = shape.query_len
    step = SchedulerOutput(new, CachedRequestData(), sched, shape.num_tokens, set())
    cleanup = SchedulerOutput([], CachedRequestData(), {}, 0, set(sched))
    return step, cleanup

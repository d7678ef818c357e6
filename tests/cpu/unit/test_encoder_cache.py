"""The scheduler's side of the encoder stage without a model: the encoder
budget and cache cut a step before an image that does not fit, outputs are
computed once and referenced, freed images stay until their room is
needed and are then sent to the workers; mm_hash in the block hashes."""
from __future__ import annotations

import msgspec
from sched_utils import fake_output

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreRequest
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.step_output import StepPlan
from conveyor.engine.kv_cache.hashing import BlockHasher
from conveyor.engine.multimodal.encoder_cache import EncoderCacheManager
from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.engine.sampling_params import SamplingParams


def _req(rid: str, images: list[tuple[str, int, int]], n: int = 64) -> Request:
    """A prompt of n tokens with images (mm_hash, offset, length)."""
    feats = [MultiModalFeature(h, off, length, b"", [0]) for h, off, length in images]
    ecr = EngineCoreRequest(request_id=rid, prompt_token_ids=[7] * n, sampling_params=SamplingParams(max_tokens=4),
                            mm_features=feats)
    return Request.from_engine_core_request(ecr, 1024)


def test_budget_cuts_the_chunk_before_an_image_and_a_cached_one_is_a_hit():
    mgr = EncoderCacheManager(cache_size=100, compute_budget=30)
    a = _req("a", [("x", 4, 25), ("y", 40, 25)])
    plan = StepPlan(token_budget=64, encoder_budget=30)
    # Image x fits (25 of 30 rows); y does not: the chunk stops at its first placeholder.
    assert mgr.fit(a, 0, 64, plan) == 40
    assert plan.encoder_pending == {"a": [0]} and plan.encoder_budget == 5
    mgr.commit(a, plan)
    assert plan.encoder_inputs == {"a": [0]} and mgr.num_free == 75
    # Its next chunk starts inside x (already computed, referenced): only y runs, no hit.
    plan = StepPlan(token_budget=64, encoder_budget=30)
    assert mgr.fit(a, 20, 44, plan) == 44 and plan.encoder_pending == {"a": [1]}
    mgr.commit(a, plan)
    assert mgr.take_hits() == 0
    # Another request with image x: referenced, not computed. It waits (no KV
    # blocks) and is fitted again: one hit, counted when it runs.
    b = _req("b", [("x", 0, 25)])
    plan = StepPlan(token_budget=64, encoder_budget=30)
    assert mgr.fit(b, 0, 64, plan) == 64 and not plan.encoder_pending
    mgr.free(b)
    assert mgr.fit(b, 0, 64, plan) == 64 and mgr.take_hits() == 0
    mgr.commit(b, plan)
    assert mgr.take_hits() == 1 and mgr.cached["x"] == {"a", "b"}


def test_an_image_waits_when_nothing_can_be_evicted():
    mgr = EncoderCacheManager(cache_size=50, compute_budget=100)
    a, b = _req("a", [("x", 0, 30)]), _req("b", [("y", 8, 30)])
    plan = StepPlan(token_budget=64, encoder_budget=100)
    mgr.fit(a, 0, 64, plan)
    mgr.commit(a, plan)
    assert mgr.fit(b, 0, 64, plan) == 8  # x is referenced: y's 30 rows do not fit in 20
    assert mgr.fit(b, 8, 56, plan) == 0  # the request waits
    assert mgr.take_freed() == []


def test_unreferenced_outputs_stay_until_their_room_is_needed_oldest_first():
    mgr = EncoderCacheManager(cache_size=60, compute_budget=100)
    for rid, h in (("a", "x"), ("b", "y")):
        r = _req(rid, [(h, 0, 25)])
        plan = StepPlan(token_budget=64, encoder_budget=100)
        mgr.fit(r, 0, 64, plan)
        mgr.commit(r, plan)
        r.num_computed_tokens = 30
        mgr.release_passed(r)  # past its image: unreferenced, still cached
    assert list(mgr.freeable) == ["x", "y"] and mgr.num_free == 10
    again = _req("c", [("y", 0, 25)])
    plan = StepPlan(token_budget=64, encoder_budget=100)
    assert mgr.fit(again, 0, 64, plan) == 64  # y comes back from the cache
    mgr.commit(again, plan)
    assert mgr.take_hits() == 1
    new = _req("d", [("z", 0, 25)])
    mgr.fit(new, 0, 64, plan)
    mgr.commit(new, plan)
    assert mgr.take_freed() == ["x"] and set(mgr.cached) == {"y", "z"} and mgr.num_free == 10


def test_scheduler_sends_encoder_inputs_and_frees_through_the_diff():
    tree = {"model": {"max_model_len": 256}, "cache": {"enable_prefix_caching": False},
            "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 16, "max_num_encoder_input_tokens": 25},
            "multimodal": {"encoder_cache_tokens": 25}}
    s = Scheduler(msgspec.convert(tree, EngineConfig), 64)
    a = _req("a", [("x", 4, 25)], n=40)
    s.add_request(a)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 16} and so.scheduled_encoder_inputs == {"a": [0]}
    s.update_from_output(so, fake_output(so, s))
    so = s.schedule()  # the chunk through the rest of x: no new encoder work
    assert so.num_scheduled_tokens == {"a": 16} and so.scheduled_encoder_inputs == {}
    s.update_from_output(so, fake_output(so, s))
    b = _req("b", [("y", 0, 25)], n=30)
    s.add_request(b)
    so = s.schedule()  # a is past x: x is evicted for y, and the workers are told first
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.free_encoder_mm_hashes == ["x"]


def test_block_hashes_carry_the_images_that_meet_each_block():
    h = BlockHasher(16)
    one, other, same, text = (_req("1", [("x", 20, 25)]), _req("2", [("y", 20, 25)]),
                              _req("3", [("x", 20, 25)]), _req("4", []))
    for r in (one, other, same, text):
        h.extend(r)
    assert one.block_hashes == same.block_hashes
    assert one.block_hashes[0] == other.block_hashes[0] == text.block_hashes[0]  # text only
    assert all(a != b for a, b in zip(one.block_hashes[1:], other.block_hashes[1:]))
    assert one.block_hashes[1] != text.block_hashes[1]


def test_a_prefix_hit_inside_an_image_that_cannot_run_waits():
    """The prefix cache computed [0, 32) of an image at [20, 45): the image
    must be encoded for the rest; with no room this step the request gets 0
    tokens (never a negative count)."""
    mgr = EncoderCacheManager(cache_size=100, compute_budget=10)
    r = _req("r", [("x", 20, 25)])
    plan = StepPlan(token_budget=64, encoder_budget=10)
    assert mgr.fit(r, 32, 32, plan) == 0 and not plan.encoder_pending


def test_an_image_twice_in_a_prompt_is_kept_until_its_last_place_passes():
    mgr = EncoderCacheManager(cache_size=100, compute_budget=100)
    r = _req("r", [("x", 4, 25), ("x", 40, 25)], n=80)
    plan = StepPlan(token_budget=80, encoder_budget=100)
    assert mgr.fit(r, 0, 80, plan) == 80 and plan.encoder_pending == {"r": [0]}  # computed once
    mgr.commit(r, plan)
    r.num_computed_tokens = 50  # past the first place, inside the second
    mgr.release_passed(r)
    assert mgr.cached["x"] == {"r"} and not mgr.freeable
    r.num_computed_tokens = 80
    mgr.release_passed(r)
    assert list(mgr.freeable) == ["x"]

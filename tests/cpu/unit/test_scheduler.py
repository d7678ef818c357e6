"""Scheduler scenarios with fake model outputs (vLLM's test patterns, our numbers)."""
from __future__ import annotations

from sched_utils import EOS, create_requests, create_scheduler, fake_output, make_request

from conveyor.engine.contracts import ModelRunnerOutput, RequestStatus


def _mro(reqs, tokens):
    ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, tokens)


def test_ten_new_requests_one_step():
    s = create_scheduler()
    reqs = create_requests(10, num_tokens=10)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == 10
    assert out.num_scheduled_tokens == {r.request_id: 10 for r in reqs}
    assert out.total_num_scheduled_tokens == 100
    assert [r.request_id for r in s.running] == [str(i) for i in range(10)]
    assert not s.waiting


def test_long_prefill_threshold_and_budget():
    s = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400,
                         max_model_len=4096)
    reqs = create_requests(3, num_tokens=800)
    for r in reqs:
        s.add_request(r)
    o1 = s.schedule()
    assert [o1.num_scheduled_tokens[r.request_id] for r in reqs] == [400, 400, 224]
    s.update_from_output(o1, fake_output(o1, s))
    o2 = s.schedule()
    assert [o2.num_scheduled_tokens[r.request_id] for r in reqs] == [400, 400, 224]
    s.update_from_output(o2, fake_output(o2, s))
    assert [len(r.output_token_ids) for r in reqs] == [1, 1, 0]
    o3 = s.schedule()
    assert [o3.num_scheduled_tokens[r.request_id] for r in reqs] == [1, 1, 352]


def test_lone_request_ignores_threshold():
    s = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400,
                         max_model_len=4096)
    (r,) = create_requests(1, num_tokens=2000)
    s.add_request(r)
    assert s.schedule().num_scheduled_tokens[r.request_id] == 1024


def _chunked(enable: bool) -> int:
    s = create_scheduler(max_num_batched_tokens=1024, max_num_seqs=3, enable_chunked_prefill=enable,
                         max_model_len=1024)
    for r in create_requests(2, num_tokens=800) + create_requests(2, num_tokens=10, start=2):
        s.add_request(r)
    return len(s.schedule().num_scheduled_tokens)


def test_chunked_prefill_off_no_overtaking():
    assert _chunked(False) == 1
    assert _chunked(True) == 2


def _finish_one(stop_ids=(), max_tokens=16, sampled=(10,), ignore_eos=False, min_tokens=0):
    s = create_scheduler()
    r = make_request("0", [1] * 4, max_tokens=max_tokens, stop_token_ids=list(stop_ids),
                     ignore_eos=ignore_eos, min_tokens=min_tokens)
    s.add_request(r)
    out = s.schedule()
    eco = s.update_from_output(out, _mro([r], [list(sampled)]))
    return r, eco.outputs[0]


def test_stop_eos():
    r, o = _finish_one(sampled=[EOS])
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert str(o.finish_reason) == "stop" and o.new_token_ids == [EOS]


def test_stop_token_ids_trim():
    r, o = _finish_one(stop_ids=[42, 43], sampled=[10, 42, 12])
    assert r.output_token_ids == [10, 42] and o.new_token_ids == [10, 42]
    assert r.status == RequestStatus.FINISHED_STOPPED and o.stop_reason == 42


def test_max_tokens_length_capped():
    r, o = _finish_one(max_tokens=2, sampled=[10, 11, 12])
    assert r.output_token_ids == [10, 11]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and str(o.finish_reason) == "length"


def test_ignore_eos_keeps_running():
    r, o = _finish_one(sampled=[EOS], ignore_eos=True)
    assert r.status == RequestStatus.RUNNING and o.finish_reason is None


def test_min_tokens_ignores_early_eos():
    s = create_scheduler()
    r = make_request("0", [1] * 4, max_tokens=10, min_tokens=5)
    s.add_request(r)
    for step in range(5):
        out = s.schedule()
        s.update_from_output(out, _mro([r], [[EOS]]))
        if step < 4:
            assert r.status == RequestStatus.RUNNING
    assert r.status == RequestStatus.FINISHED_STOPPED and len(r.output_token_ids) == 5


def test_pp_pattern_no_double_scheduling():
    s = create_scheduler(max_num_batched_tokens=1024, max_num_seqs=2, max_model_len=2048)
    r0, r1 = create_requests(2, num_tokens=512)
    s.add_request(r0)
    o0 = s.schedule()
    assert o0.num_scheduled_tokens == {"0": 512}
    s.add_request(r1)
    o1 = s.schedule()
    assert o1.num_scheduled_tokens == {"1": 512}  # r0's output is in flight
    s.update_from_output(o0, _mro([r0], [[7]]))
    o2 = s.schedule()
    assert o2.num_scheduled_tokens == {"0": 1}


def test_preempt_during_execution_keeps_in_flight_token():
    s = create_scheduler(num_blocks=11, max_num_batched_tokens=100, enable_prefix_caching=False)
    r0, r1 = create_requests(2, num_tokens=80)
    s.add_request(r0)
    o0 = s.schedule()
    assert len(o0.scheduled_new_reqs[0].block_ids) == 5
    s.add_request(r1)
    o1 = s.schedule()
    assert len(o1.scheduled_new_reqs[0].block_ids) == 5
    s.update_from_output(o0, _mro([r0], [[0 + 5]]))
    o2 = s.schedule()  # r0 needs a 6th block: r1 goes
    assert "1" not in o2.num_scheduled_tokens
    assert s.running == [r0] and r1.status == RequestStatus.PREEMPTED
    assert s.num_preemptions == 1
    s.update_from_output(o1, _mro([r1], [[42]]))
    assert r1.output_token_ids == [42]


def test_priority_order():
    s = create_scheduler(policy="priority")
    for rid, (p, t) in enumerate(zip([2, 0, 1], [1, 2, 3])):
        s.add_request(make_request(str(rid), [1] * 4, priority=p, arrival_time=t))
    out = s.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["1", "2", "0"]
    s = create_scheduler(policy="priority")
    for rid, (p, t) in enumerate(zip([2, 1, 1, 0], [1, 3, 2, 4])):
        s.add_request(make_request(str(rid), [1] * 4, priority=p, arrival_time=t))
    assert [r.req_id for r in s.schedule().scheduled_new_reqs] == ["3", "2", "1", "0"]


def test_priority_one_by_one():
    prios = [5, 1, 8, 3, 2, 7, 4, 6]
    s = create_scheduler(policy="priority", max_num_seqs=1)
    for i, p in enumerate(prios):
        s.add_request(make_request(str(i), [1] * 4, max_tokens=1, priority=p, arrival_time=i))
    order = []
    while s.has_unfinished_requests():
        out = s.schedule()
        order += [r.req_id for r in out.scheduled_new_reqs]
        s.update_from_output(out, fake_output(out, s, token=9))
    assert [prios[int(i)] for i in order] == sorted(prios)


def test_priority_preemption_out_of_kv_and_resume():
    s = create_scheduler(policy="priority", num_blocks=5, max_num_batched_tokens=200, max_num_seqs=2)
    low = make_request("low", list(range(1, 31)), max_tokens=50, priority=1, arrival_time=0)
    s.add_request(low)
    o = s.schedule()
    s.update_from_output(o, _mro([low], [[100]]))
    high = make_request("high", list(range(1, 33)), max_tokens=50, priority=0, arrival_time=1)
    s.add_request(high)
    o = s.schedule()
    assert len(o.scheduled_new_reqs) == 1 and o.scheduled_cached_reqs.req_ids == ["low"]
    s.update_from_output(o, _mro([low, high], [[100], [100]]))
    o = s.schedule()  # high needs a 3rd block: low (worse priority) is preempted
    assert o.scheduled_cached_reqs.req_ids == ["high"]
    assert low.status == RequestStatus.PREEMPTED and len(s.waiting) == 1 and s.running == [high]
    s.update_from_output(o, _mro([high], [[100]]))
    s.finish_requests("high", RequestStatus.FINISHED_STOPPED)
    o = s.schedule()
    cached = o.scheduled_cached_reqs
    assert cached.req_ids == ["low"] and cached.resumed_req_ids == ["low"]
    assert cached.resumed_token_ids["low"] == list(range(1, 31)) + [100, 100]
    assert o.num_scheduled_tokens == {"low": 32}


def test_async_abort_one_per_step():
    s = create_scheduler()
    reqs = create_requests(10, num_tokens=8, max_tokens=100)
    for r in reqs:
        s.add_request(r)
    order = [0, 8, 3, 1, 6, 4, 2, 5, 7, 9]
    for idx in order:
        out = s.schedule()
        s.finish_requests(str(idx), RequestStatus.FINISHED_ABORTED)  # arrives mid-flight
        s.update_from_output(out, fake_output(out, s, token=5))
    for pos, idx in enumerate(order):
        assert reqs[idx].status == RequestStatus.FINISHED_ABORTED
        assert len(reqs[idx].output_token_ids) == pos
    assert not s.requests and not s.running and not s.waiting


def test_no_leak_after_completion_with_caching():
    s = create_scheduler(num_blocks=100, enable_prefix_caching=True)
    for r in create_requests(5, num_tokens=40, max_tokens=20):
        s.add_request(r)
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, fake_output(out, s, token=5))
    kv = s.kv_cache_manager
    assert not s.requests and not s.running
    assert kv.get_num_free_blocks() == 100 - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_stats():
    s = create_scheduler(num_blocks=101, enable_prefix_caching=True)
    for r in create_requests(2, num_tokens=40):
        s.add_request(r)
    out = s.schedule()
    eco = s.update_from_output(out, fake_output(out, s))
    st = eco.scheduler_stats
    assert st.num_running_reqs == 2 and st.num_waiting_reqs == 0
    assert st.prefix_cache_stats.queries == 80 and st.prefix_cache_stats.hits == 0
    assert abs(st.kv_cache_usage - 6 / 100) < 1e-9
    assert st.num_generation_tokens == 2

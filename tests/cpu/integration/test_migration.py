"""Live migration between data-parallel engines (conveyor/engine/dp/client.py): drain an
engine, and lose one (its only worker SIGKILLed, restart budget 0), with
greedy, seeded-with-penalties, JSON-schema and n=2-with-stop-strings requests
in flight on two in-process engines. Every request ends with its normal
finish reason and the tokens, text and logprobs of an undisturbed run."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

import jsonschema
import msgspec
import pytest
from fake_engines import FakeEngineClient, fake_fleet
from recovery_utils import FakeFrontend

from conveyor.engine import SamplingParams, StructuredOutputsParams
from conveyor.engine.core_client import metric_dict

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "string", "minLength": 6, "maxLength": 10}}}, "required": ["tags"], "additionalProperties": False}
PROMPTS = ["The cat sits on the mat and", "Give me data about", "Once upon a time there",
           "A list of colors:", "The dog runs to the ball"]


def _params(stop: list[str]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True, logprobs=2),
            # Penalties and min_tokens count the output tokens the new engine was given.
            SamplingParams(max_tokens=40, temperature=0.8, seed=9, min_tokens=30, frequency_penalty=0.7,
                           presence_penalty=0.4, repetition_penalty=1.2),
            SamplingParams(max_tokens=120, temperature=0.8, seed=5,
                           structured_outputs=StructuredOutputsParams(json=TAGS)),
            SamplingParams(n=2, max_tokens=40, temperature=0.8, seed=3, ignore_eos=True, stop=stop,
                           logprobs=1)]


@pytest.fixture(scope="module")
def config(tiny_llama):
    from conveyor.engine.config import build_config

    return build_config(model=tiny_llama, max_model_len=512, data_parallel_size=2, router="round_robin",
                        **{"parallel.max_restarts": 0, "serve.served_model_name": "tiny"})


async def _run(llm, params: list[SamplingParams], disrupt=None) -> list[dict]:
    """Every request's choices (tokens, text, logprobs, finish); `disrupt`
    runs once every stream has delivered its first tokens."""
    gens = [llm.generate(p, sp) for p, sp in zip(PROMPTS, params)]
    firsts = [await g.__anext__() for g in gens]
    if disrupt is not None:
        await disrupt()
    results = []
    for first, g in zip(firsts, gens):
        acc: dict[int, dict] = {}
        for ro in [first] + [ro async for ro in g]:
            for d in ro.outputs:
                c = acc.setdefault(d.index, {"ids": [], "text": "", "lps": [], "finish": None})
                c["ids"] += d.token_ids
                c["text"] += d.text
                c["lps"] += d.logprobs or []
                c["finish"] = (d.finish_reason, d.stop_reason)
        results.append(acc)
    return results


def _diff(got: list[dict], ref: list[dict]) -> str | None:
    """None when every request matches the reference: token ids, text and
    finish exactly; logprobs to 1e-4 (the new engine computes the migrated
    context in a prefill, not token by token, so the last bits may differ)."""
    for i, (g, r) in enumerate(zip(got, ref)):
        if g.keys() != r.keys():
            return f"request {i}: choices {sorted(g)} != {sorted(r)}"
        for k in r:
            for key in ("ids", "text", "finish"):
                if g[k][key] != r[k][key]:
                    return f"request {i} choice {k} {key}: {g[k][key]!r} != {r[k][key]!r}"
            for pos, (a, b) in enumerate(zip(g[k]["lps"], r[k]["lps"])):
                if a.keys() != b.keys() or any(abs(a[t] - b[t]) > 1e-4 for t in a):
                    return f"request {i} choice {k} logprobs at {pos}: {a} != {b}"
    return None if len(got) == len(ref) else "request count"


async def _kv_idle(llm, engines: list[int]) -> list[float]:
    """Each engine's KV usage once it has no request (an abort for a stop
    string may still be on its way when the stream ends)."""
    cores = [llm.client.inner.clients[e].core for e in engines]
    for _ in range(500):
        if not any(c.scheduler.has_requests() for c in cores):
            break
        await asyncio.sleep(0.01)
    return [c.scheduler.make_stats().kv_cache_usage for c in cores]


def test_drain_and_engine_loss_move_requests_token_exact(config, caplog, tmp_path):
    """Then a rollout of another scheduler.max_num_seqs under load (dead
    engine 0 replaced, then engine 1 drained and replaced; token-exact), and
    on those engines issue 26's batch cases (tests/cpu/migration_batch.py): an engine lost mid-job, and
    the whole job lost and run again from its token journal."""
    import migration_batch as mb

    from conveyor.cluster.batch.engines import LineRunner

    caplog.set_level(logging.INFO, logger="conveyor.engine.dp.migration_log")

    async def scenario() -> None:  # one event loop: AsyncLLM binds to the first it runs on
        runner = LineRunner.start(config, str(tmp_path / "warmup.tokens"))
        dp = runner.llm.client.inner
        try:
            params = await _scenario(runner.llm, caplog)
            loop = asyncio.get_running_loop()
            # A rollout of another max_num_seqs under load, engine by engine, no request lost:
            # dead engine 0 comes back first, then engine 1 is drained and replaced.
            new = msgspec.structs.replace(config, scheduler=msgspec.structs.replace(config.scheduler,
                                                                                    max_num_seqs=8))

            async def rollout() -> None:
                await loop.run_in_executor(None, dp.rollout, new)

            assert _diff(await _run(runner.llm, params[0], rollout), params[1]) is None
            assert [c.core.config.scheduler.max_num_seqs for c in dp.clients] == [8, 8]
            assert dp.states == ["up", "up"]
            ref = await mb.reference(runner)
            await mb.engine_lost_mid_job(runner, dp, str(tmp_path / "lost.jsonl"), ref)
            single = msgspec.structs.replace(config, parallel=msgspec.structs.replace(
                config.parallel, data_parallel_size=1))
            await mb.job_lost_and_resubmitted(runner, single, str(tmp_path / "crash.jsonl"), ref)
        finally:
            await runner.close()

    asyncio.run(scenario())


async def _scenario(llm, caplog) -> tuple[list[SamplingParams], list[dict]]:
    dp = llm.client.inner  # under the batch's token journal (conveyor/cluster/batch/token_journal.py)
    # A stop string child 1 of the n=2 request meets mid-way: from a run without one.
    probe = (await _run(llm, _params([])))[4][1]["text"]
    stop = probe[len(probe) // 2:len(probe) // 2 + 3]
    assert stop.strip(), probe
    ref = await _run(llm, _params([stop]))
    assert ref[4][1]["finish"] == ("stop", stop), ref[4][1]
    assert [ref[i][0]["finish"][0] for i in (0, 1, 3)] == ["length", "length", "stop"]
    jsonschema.validate(json.loads(ref[3][0]["text"]), TAGS)

    moved: list[int] = []

    async def drain() -> None:
        moved.append(await llm.drain(0))

    assert _diff(await _run(llm, _params([stop]), drain), ref) is None
    assert moved[0] > 0 and dp.states == ["drained", "up"]
    assert await _kv_idle(llm, [0, 1]) == [0.0, 0.0]
    llm.undrain(0)

    async def kill() -> None:
        os.kill(dp.clients[0].worker_pids()[0], signal.SIGKILL)

    assert _diff(await _run(llm, _params([stop]), kill), ref) is None
    assert dp.states == ["dead", "up"] and llm.check_health() == "ok"
    assert await _kv_idle(llm, [1]) == [0.0]
    assert not len(dp.mover.book) and not dp._live and not dp.mover.moving and dp.router.inflight.sum() == 0
    m = metric_dict(dp.metric_rows())
    assert m['conveyor:migrations_total{engine="0",cause="drain"}'] == moved[0]
    assert m['conveyor:migrations_total{engine="0",cause="lost"}'] > 0
    assert m['conveyor:migration_reprefill_tokens_total{engine="1"}'] > 0
    logged = [r.getMessage() for r in caplog.records if "migrated from engine 0 to engine 1" in r.getMessage()]
    assert len(logged) >= moved[0] and "largest gap between tokens" in logged[0]
    return _params([stop]), ref


# ---- the client's bookkeeping, without engines ---------------------------------------

def _fake_dp(n: int = 2, paced: bool = False):
    from conveyor.engine.config import build_config

    engines = [FakeEngineClient() for _ in range(n)]
    dp = fake_fleet(build_config(data_parallel_size=n, router="round_robin",
                                 **{"parallel.paced_drain": paced}), engines)
    front = FakeFrontend()
    dp.start(front)
    return dp, engines, front


def _req(rid: str):
    from conveyor.engine.contracts import EngineCoreRequest

    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(5, 25)),
                             sampling_params=SamplingParams(max_tokens=8), arrival_time=0.0,
                             priority=0, eos_token_id=None)


def _out(rid: str, toks: list[int], finished: bool = False):
    from conveyor.engine.contracts import EngineCoreOutput, EngineCoreOutputs, FinishReason

    return EngineCoreOutputs(outputs=[EngineCoreOutput(rid, toks, FinishReason.LENGTH if finished else None)])


def test_loss_moves_delivered_tokens_as_output_tokens_and_drops_late_outputs() -> None:
    from conveyor.engine.contracts import EngineCoreOutputs, SchedulerStats

    dp, (a, b), front = _fake_dp()
    front.add(dp, _req("r0"))
    front.add(dp, _req("r1"))
    owner = a if a.added and a.added[0].request_id == "r0" else b
    other = b if owner is a else a
    owner.emit(_out("r0", [7, 8]))
    owner.emit(EngineCoreOutputs(engine_error="boom"))  # lost: r0 moves, no error reaches the frontend
    assert all(o.engine_error is None for o in front.got)
    n = len(other.added)
    assert front.answer(dp) == 1  # resubmitted from what the frontend was handed
    assert len(other.added) == n + 1
    moved = other.added[-1]
    assert (moved.request_id, moved.prompt_token_ids, moved.output_token_ids) == ("r0", list(range(5, 25)), [7, 8])
    owner.emit(_out("r0", [9]))  # a late output of the lost engine: dropped
    other.emit(_out("r0", [9], finished=True))
    toks = [t for o in front.got for x in o.outputs if x.request_id == "r0" for t in x.new_token_ids]
    assert toks == [7, 8, 9]
    src = 0 if owner is a else 1
    assert dp.check_health() == "ok"
    assert metric_dict(dp.metric_rows())[f'conveyor:migrations_total{{engine="{src}",cause="lost"}}'] == 1
    # Drain the survivor: nothing is up to take its requests.
    with pytest.raises(ValueError, match="only one up"):
        dp.drain(1 if owner is a else 0)
    # Drained with requests: they are aborted there and resubmitted; drain
    # returns how many moved once the engine is idle and the frontend answered.
    dp2, (c, d), front2 = _fake_dp()
    for i in range(4):
        front2.add(dp2, _req(f"q{i}"))
    import threading
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(dp2.drain(0, timeout_s=10)))
    t.start()
    for _ in range(500):  # the drain asks the frontend for the requests it moves
        if front2.asks:
            break
        threading.Event().wait(0.01)
    on_c = [r.request_id for r in c.added]
    assert len(on_c) == 2 and sorted(c.aborted) == on_c
    c.emit(EngineCoreOutputs(scheduler_stats=SchedulerStats()))  # idle, the moves not made yet
    t.join(0.2)
    assert t.is_alive() and not got
    assert front2.answer(dp2) == 2
    t.join(10)
    assert got == [2]
    assert sorted(r.request_id for r in d.added) == ["q0", "q1", "q2", "q3"]
    dp2.add_request(_req("q4"))
    assert d.added[-1].request_id == "q4"
    dp2.undrain(0)
    dp2.add_request(_req("q5"))
    dp2.add_request(_req("q6"))
    assert len(c.added) == 3  # it takes requests again


def test_paced_drain_moves_a_wave_once_the_last_produced_on_its_new_engine(caplog) -> None:
    """parallel.paced_drain: waves of at most the longest moved context's
    tokens (here one request each); the drained engine keeps delivering the
    requests not yet moved; the next wave moves on the first output of the
    last one from its new engine; a request that finished before its wave
    does not move. Each moved stream's largest gap is logged (info) when it
    ends, with its request id and both engines; the tokens its new engine
    computed again are counted."""
    import re
    import threading

    from conveyor.engine.contracts import EngineCoreOutputs, SchedulerStats

    caplog.set_level(logging.INFO, logger="conveyor.engine.dp.migration_log")
    dp, engines, front = _fake_dp(paced=True)
    for i in range(6):
        front.add(dp, _req(f"w{i}"))  # round robin: w0, w2, w4 on one engine (a)
    ia = 0 if engines[0].added[0].request_id == "w0" else 1
    a, b = engines[ia], engines[1 - ia]
    a.emit(_out("w0", [7, 8]))  # the longest context (22 tokens): the wave budget
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(dp.drain(ia, timeout_s=10)))
    t.start()
    for _ in range(500):  # the first wave is off engine a, the frontend asked for it
        if front.asks:
            break
        threading.Event().wait(0.01)
    assert a.aborted == ["w0"] and front.answer(dp) == 1 and len(b.added) == 4
    assert a.aborted == ["w0"] and (b.added[-1].request_id, b.added[-1].output_token_ids) == ("w0", [7, 8])
    a.emit(_out("w2", [3]))  # not moved yet: still a's, delivered
    assert len(b.added) == 4
    b.emit(_out("w0", [9]))  # w0 produced on b: the next wave (w2, with its token) moves
    assert front.answer(dp) == 1
    assert a.aborted == ["w0", "w2"] and (b.added[-1].request_id, b.added[-1].output_token_ids) == ("w2", [3])
    a.emit(_out("w4", [5], finished=True))  # finished before its wave: never moves
    b.emit(_out("w2", [4]))
    assert a.aborted == ["w0", "w2"] and len(b.added) == 5
    a.emit(EngineCoreOutputs(scheduler_stats=SchedulerStats()))
    t.join(10)
    m = metric_dict(dp.metric_rows())
    assert done == [2] and m[f'conveyor:migrations_total{{engine="{ia}",cause="drain"}}'] == 2
    assert m[f'conveyor:migration_reprefill_tokens_total{{engine="{1 - ia}"}}'] == 22 + 21  # nothing cached
    b.emit(_out("w0", [10], finished=True))
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request w0 ")]
    assert len(logged) == 1 and re.fullmatch(
        rf"request w0 migrated from engine {ia} to engine {1 - ia} \(drain\): largest gap between tokens "
        r"\d+\.\d ms, 22 context tokens, 0 cached on the new engine", logged[0]), logged
    toks = {x.request_id: [] for o in front.got for x in o.outputs}
    for o in front.got:
        for x in o.outputs:
            toks[x.request_id] += x.new_token_ids
    assert (toks["w0"], toks["w2"], toks["w4"]) == ([7, 8, 9, 10], [3, 4], [5])


def test_actor_loss_moves_at_once_and_the_rebuilt_engine_comes_back() -> None:
    dp, (a, b), front = _fake_dp()
    front.add(dp, _req("r0"))
    front.add(dp, _req("r1"))
    lost, back = a.hooks
    lost("actor died")
    assert dp.states == ["lost", "up"] and dp.check_health() == "recovering"
    assert front.answer(dp) == 1 and sorted(r.request_id for r in b.added) == ["r0", "r1"]
    back()
    assert dp.states == ["up", "up"]
    # Every engine lost at once: the requests wait for a rebuild and go back to it.
    lost2, _ = b.hooks
    lost("again")
    lost2("too")
    assert front.answer(dp) == 0 and len(b.added) == 2 and len(a.added) == 1
    back()
    assert front.answer(dp) == 2 and sorted(r.request_id for r in a.added[-2:]) == ["r0", "r1"]


def test_a_move_answered_while_no_engine_is_up_waits_for_one() -> None:
    """The frontend answers a move once every engine is lost: the request
    waits (on no engine) and goes to the first engine back, with the tokens
    the frontend had when it answered; an abort meanwhile ends the move."""
    dp, (a, b), front = _fake_dp()
    front.add(dp, _req("r0"))
    front.add(dp, _req("r1"))
    if a.added[0].request_id != "r0":
        a, b = b, a
    a.emit(_out("r0", [7]))
    (lost_a, back_a), (lost_b, _) = a.hooks, b.hooks
    lost_a("gone")  # r0 moves: asked, not answered yet
    lost_b("gone too")  # r1 waits for b's rebuild
    assert front.answer(dp) == 1 and dp.mover.parked.keys() == {"r0"}
    dp.abort_requests(["r1"])
    back_a()
    assert front.answer(dp) == 0 and not dp.mover.parked and not dp.mover.moving
    assert [(r.request_id, r.output_token_ids) for r in a.added[1:]] == [("r0", [7])]


def test_drain_cli_and_admin_body_checks(capsys) -> None:
    import socket

    from pydantic import ValidationError

    from conveyor.cluster.cli.main import main
    from conveyor.cluster.openai.routes.admin import DrainRequest

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["drain", "--url", f"http://127.0.0.1:{port}", "--engine", "1", "--timeout", "1"]) == 1
    assert "/admin/drain" in capsys.readouterr().err
    for bad in ({"engine": -1}, {"engine": "0"}, {"engine": 0, "timeout_s": float("nan")},
                {"engine": 0, "timeout_s": 0}, {"engine": 0, "extra": 1}):
        with pytest.raises(ValidationError):
            DrainRequest.model_validate(bad)


def test_data_parallel_batch_journals_merge_and_resume_on_any_engine(tmp_path) -> None:
    """`--data-parallel N` batch jobs: engine i journals to `<journal>.i` and
    resumes from the job's merged journal, whichever engine a line lands on in
    the next run; the driver's merge keeps each key's longest entry and drops
    written lines; a finished job leaves no journal file."""
    from conveyor.cluster.batch.token_journal import (
        LineJournal,
        TokenJournal,
        engine_journals,
        load_entries,
        merge_journals,
    )

    base = str(tmp_path / "out.jsonl.tokens")
    la, lb = LineJournal.line_id({"custom_id": "a"}), LineJournal.line_id({"custom_id": "b"})
    ka, kb = f"cmpl-{la}-0", f"cmpl-{lb}-0"
    assert LineJournal.line_of(ka) == la

    def engine(i: int) -> tuple[LineJournal, FakeEngineClient, list]:
        fake, got = FakeEngineClient(), []
        j = LineJournal(fake, TokenJournal(f"{base}.{i}", min_flush_tokens=1, restore_from=base))
        j.start(got.append)
        return j, fake, got

    def lost(*js: LineJournal) -> None:  # the job's process is gone (flushed lines stay)
        for j in js:
            os.close(j.journal._fd)

    (j0, f0, _), (j1, f1, _) = engine(0), engine(1)
    j0.add_request(_req(ka + "-r1"))
    j1.add_request(_req(kb + "-r1"))
    f0.emit(_out(ka + "-r1", [1, 2, 3]))
    f1.emit(_out(kb + "-r1", [7, 8]))
    lost(j0, j1)
    merge_journals(base, lambda k: True)
    assert engine_journals(base) == [] and {k: e.tokens for k, e in load_entries(base).items()} == {
        ka: [1, 2, 3], kb: [7, 8]}
    # Run 2 deals the lines the other way round: each resumes from the merged journal.
    (j0, f0, got0), (j1, f1, got1) = engine(0), engine(1)
    j1.add_request(_req(ka + "-r2"))
    j0.add_request(_req(kb + "-r2"))
    assert [o.outputs[0].new_token_ids for o in got1] == [[1, 2, 3]] and f1.added[0].output_token_ids == [1, 2, 3]
    assert [o.outputs[0].new_token_ids for o in got0] == [[7, 8]] and f0.added[0].output_token_ids == [7, 8]
    f1.emit(_out(ka + "-r2", [4]))
    f0.emit(_out(kb + "-r2", [9], finished=True))
    j0.forget_line(lb)  # line b written
    lost(j0, j1)
    merge_journals(base, lambda k: LineJournal.line_of(k) != lb)
    assert {k: e.tokens for k, e in load_entries(base).items()} == {ka: [1, 2, 3, 4]}
    # Run 3: a finishes on engine 0; its own file empties and goes, then the merged one.
    j0, f0, _ = engine(0)
    j0.add_request(_req(ka + "-r3"))
    assert f0.added[0].output_token_ids == [1, 2, 3, 4]
    f0.emit(_out(ka + "-r3", [5], finished=True))
    j0.forget_line(la)
    j0.shutdown()
    merge_journals(base, lambda k: False)
    assert os.listdir(tmp_path) == []

"""The Ray Serve OpenAI app end to end on a tiny checkpoint: the official
`openai` client against it (greedy parity with LLM.generate), every error
status in the OpenAI error shape, auth per route, health/metrics, client
disconnect -> abort -> KV freed, backpressure, and 64 concurrent streams.

One Ray instance and one Serve app per module, all on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import msgspec
import pytest
import torch
from ray_nodes import engine_actor_pids
from repo_paths import ROOT
from sse_utils import DONE, sse_events

from conveyor.parallel.ports import free_port

KEY_ENV, KEY = "CONVEYOR_TEST_SERVE_KEY", "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The cat runs", "A dog sees the ball today.", "My friend builds", "日本語の本"]
MAX_TOKENS = 24


def _write_config(path: str, ckpt: str, port: int, **serve: object) -> str:
    cfg = {"model": {"path": ckpt, "max_model_len": 1024},
           "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
           "cache": {"num_gpu_blocks": 1024},
           "serve": {"host": "127.0.0.1", "port": port, "served_model_name": "tiny",
                     "api_key_env": KEY_ENV, **serve}}
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def refs(ckpt):
    """LLM.generate greedy references (run before the server engine is busy)."""
    from conveyor.engine import LLM, SamplingParams
    from conveyor.engine.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]),
                          add_special_tokens=False)
    llm = LLM(model=ckpt, max_model_len=1024)
    try:
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        outs = llm.generate(PROMPTS + [chat_ids], sp, use_tqdm=False)
    finally:
        llm.shutdown()
    return {"completion": [o.outputs[0] for o in outs[:-1]], "chat": outs[-1].outputs[0],
            "chat_prompt_len": len(chat_ids)}


@pytest.fixture(scope="module")
def server(ckpt, refs, tmp_path_factory):  # refs first: no in-process engine beside Ray
    import ray
    from ray import serve

    from conveyor.cluster.serve_app import run_serve

    os.environ[KEY_ENV] = KEY  # before ray.init: replicas inherit the environment
    cfg = _write_config(str(tmp_path_factory.mktemp("cfg") / "engine.yaml"), ckpt, free_port(),
                        responses_store_dir=str(tmp_path_factory.mktemp("responses")))
    # Logical CPUs for every app the module deploys while the data-parallel
    # app (module-scoped) is still up; 4 left a later app waiting forever.
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        yield run_serve(cfg, blocking=False)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines():
        if line.startswith("conveyor:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.split("{", 1)[0] == name)


# ---- no Ray (first, before the module's Ray instance starts) -----------------------

def test_replica_resources_and_sizing():
    from conveyor.cluster.engine_actor.actor import CoreActorPlacement
    from conveyor.cluster.serve_app import (
        SERVE_HEADROOM,
        core_actor_placement,
        deployment_options,
        max_admitted,
        replica_resources,
    )
    from conveyor.engine.config import build_config

    ray_cfg = build_config(executor="ray", tensor_parallel_size=2, pipeline_parallel_size=2,
                           placement_strategy="SPREAD")
    gpu = replica_resources(ray_cfg, use_gpu=True)
    assert gpu["placement_group_bundles"] == [{"CPU": 1.0}] + [{"GPU": 1.0}] * 4
    assert gpu["placement_group_strategy"] == "SPREAD" and gpu["ray_actor_options"] == {"num_cpus": 1}
    assert replica_resources(ray_cfg, use_gpu=False)["placement_group_bundles"] == [{"CPU": 1.0}] * 5
    # The default: EngineCore (+ the model) in its own actor, on bundle 1 with the GPUs.
    tp2 = build_config(executor="mp", tensor_parallel_size=2)
    assert replica_resources(tp2, use_gpu=True)["placement_group_bundles"] == [
        {"CPU": 1.0}, {"CPU": 1.0, "GPU": 2.0}]
    assert core_actor_placement(tp2, use_gpu=True) == CoreActorPlacement(1, 1.0, 2.0)
    assert core_actor_placement(build_config(), use_gpu=False) == CoreActorPlacement(1, 1.0, 0.0)
    assert core_actor_placement(ray_cfg, use_gpu=True) == CoreActorPlacement(0, 0.0, 0.0)
    inproc = build_config({"serve": {"engine_actor": False}})
    assert replica_resources(inproc, use_gpu=False) == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0}}
    assert core_actor_placement(inproc, use_gpu=False) is None
    # The replica admits 2 x max_num_seqs + 4x that; Serve's caps sit a little above.
    cfg64 = build_config(max_num_seqs=64)
    assert max_admitted(cfg64) == 128 + 512
    opts = deployment_options(cfg64, use_gpu=False)
    assert opts["max_ongoing_requests"] == 640 + SERVE_HEADROOM
    assert opts["max_queued_requests"] == 640
    assert opts["backpressure_config"] == {"status_code": 429, "retry_after_s": 1.0}
    assert max_admitted(build_config({"serve": {"max_ongoing_requests": 7,
                                                "max_queued_requests": 3}})) == 10


def test_direct_ingress_defaults_on_only_where_conveyor_starts_ray():
    from conveyor.cluster.serve_app import wants_direct_ingress
    from conveyor.engine.config import build_config

    auto = build_config()
    assert auto.serve.direct_ingress is None
    assert wants_direct_ingress(auto, starts_ray=True) is True
    assert wants_direct_ingress(auto, starts_ray=False) is False  # Ray already up: too late
    for value in (True, False):
        cfg = build_config({"serve": {"direct_ingress": value}})
        assert wants_direct_ingress(cfg, starts_ray=True) is value
        assert wants_direct_ingress(cfg, starts_ray=False) is value


def test_frontend_cpus_split_only_for_one_cpu_replica_running_its_model():
    from conveyor.cluster.engine_actor.cpu_layout import CpuSplit, frontend_cpus, split_cpus
    from conveyor.engine.config import ConfigError, build_config

    assert frontend_cpus(build_config(), use_gpu=False) == 1  # the default: auto
    assert frontend_cpus(build_config(), use_gpu=True) == 0
    assert frontend_cpus(build_config({"serve": {"replicas": 2}}), use_gpu=False) == 0
    assert frontend_cpus(build_config(executor="ray"), use_gpu=False) == 0  # model in workers
    assert frontend_cpus(build_config({"serve": {"engine_actor": False}}), use_gpu=False) == 0
    assert frontend_cpus(build_config({"serve": {"frontend_cpus": 3}}), use_gpu=True) == 3
    assert frontend_cpus(build_config({"serve": {"frontend_cpus": 0}}), use_gpu=False) == 0
    assert split_cpus({0, 1}, 1) == CpuSplit((0,), (1,))
    assert split_cpus({4, 2, 7, 5}, 2) == CpuSplit((2, 4), (5, 7))
    assert split_cpus({0}, 1) is None and split_cpus({0, 1}, 2) is None  # a side with no core
    assert split_cpus({0, 1}, 0) is None
    with pytest.raises(ConfigError, match="serve.frontend_cpus"):
        build_config({"serve": {"frontend_cpus": -1}})


async def _event_sizes(llm, cfg, max_tokens: int, **serve_fields: object) -> list[int]:
    """Tokens per SSE event of one streamed completion from a server whose
    serve.* config has `serve_fields` replaced."""
    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer

    srv = OpenAIServer(llm, msgspec.structs.replace(
        cfg, serve=msgspec.structs.replace(cfg.serve, **serve_fields)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(srv, api_key=None)),
                                 base_url="http://t") as c:
        r = await c.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": max_tokens, "logprobs": 0, "ignore_eos": True, "stream": True})
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    return [len(e["choices"][0]["logprobs"]["tokens"]) for e in events]


# ---- the OpenAI app in process: one engine for the SSE tests, a FakeCore for the rest ----------

class _LoopThread:
    """One event loop in a thread for a class of tests: the AsyncLLM bound
    to it serves them all (an engine start per test would cost seconds)."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture(scope="class")
def inproc(ckpt):
    """(loop, AsyncLLM, config) for one class; shut down before the Ray tests."""
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    cfg = build_config({"model": {"path": ckpt, "max_model_len": 512}})
    lt = _LoopThread()
    llm = AsyncLLM(cfg)
    try:
        yield lt, llm, cfg
    finally:
        lt.run(llm.shutdown())
        lt.close()


class TestServerSSEInProcess:
    def test_stream_interval_sends_tokens_in_groups(self, inproc):
        """serve.stream_interval=4: after the first chunk, every chunk but the
        last holds at least 4 tokens, and none is lost."""
        lt, llm, cfg = inproc
        sizes = lt.run(_event_sizes(llm, cfg, 10, stream_interval=4))
        assert sum(sizes) == 10 and all(n >= 4 for n in sizes[1:-1]), sizes

    def test_stream_batching_interval_holds_tokens_until_the_finish(self, inproc):
        """serve.stream_batching_interval_ms reaches the SSE path: with an
        interval longer than the whole generation, one event after the first
        carries everything (the finish is never held back)."""
        lt, llm, cfg = inproc
        sizes = lt.run(_event_sizes(llm, cfg, 120, stream_batching_interval_ms=10000.0))
        assert sum(sizes) == 120 and len(sizes) <= 2, sizes


def _fake_app(core=None, cfg=None, headers=AUTH, **server_kw):
    """(AsyncLLM over a FakeCore, its OpenAIServer, an httpx client of its app with KEY)."""
    from fake_core import FakeCore
    from fake_core import engine_config as _cfg

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.frontend.async_client import AsyncLLM

    core = core or FakeCore(finish=True)
    cfg = cfg or _cfg(**{"serve.metrics_public": True})
    llm = AsyncLLM(cfg, core)
    srv = OpenAIServer(llm, cfg, **server_kw)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(srv, api_key=KEY)),
                               base_url="http://t", headers=headers)
    return core, srv, client


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 4}


def _finish_first(core) -> None:
    from conveyor.engine.contracts import FinishReason

    core.emit(core.added[0].request_id, [11], FinishReason.LENGTH)


def test_public_metrics_need_no_key():
    async def run() -> None:
        _, _, c = _fake_app()
        async with c:
            assert (await c.get("/metrics", headers={"Authorization": ""})).status_code == 200

    asyncio.run(run())


def test_request_id_header_names_the_response():
    async def run() -> None:
        _, _, c = _fake_app()
        async with c:
            r = await c.post("/v1/completions", json=BODY, headers={"X-Request-Id": "rid-1"})
            assert r.headers["x-request-id"] == "rid-1" and r.json()["id"] == "cmpl-rid-1"

    asyncio.run(run())


def test_past_the_admission_slots_a_request_gets_429_with_retry_after():
    from fake_core import FakeCore

    async def run() -> None:
        core, srv, c = _fake_app(FakeCore(finish=False), max_admitted=1)
        async with c:
            first = asyncio.create_task(c.post("/v1/completions", json=BODY))
            await core.added_event.wait()  # the one slot is taken
            r = await c.post("/v1/completions", json=BODY)
            _assert_error(r, 429, "server_at_capacity")
            assert r.headers["retry-after"] == "1"
            _finish_first(core)
            assert (await first).status_code == 200

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_response_gives_its_admission_slot_back(stream):
    async def run() -> None:
        _, srv, c = _fake_app(max_admitted=1)
        async with c:
            r = await c.post("/v1/completions", json={**BODY, "stream": stream})
            assert r.status_code == 200 and (not stream or r.text.endswith("data: [DONE]\n\n"))
            assert srv.admitted == 0

    asyncio.run(run())


def test_a_request_id_in_flight_twice_is_refused_and_the_first_goes_on():
    from fake_core import FakeCore

    async def run() -> None:
        core, _, c = _fake_app(FakeCore(finish=False))
        async with c:
            dup = {"X-Request-Id": "dup-1"}
            first = asyncio.create_task(c.post("/v1/completions", json=BODY, headers=dup))
            await core.added_event.wait()
            _assert_error(await c.post("/v1/completions", json=BODY, headers=dup), 400,
                          "invalid_value", "X-Request-Id")
            _finish_first(core)
            r = await first
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1

    asyncio.run(run())


def test_a_draining_replica_answers_503():
    async def run() -> None:
        _, srv, c = _fake_app()
        srv.draining = True
        async with c:
            assert (await c.get("/health")).status_code == 503
            _assert_error(await c.post("/v1/completions", json=BODY), 503, "engine_unavailable")

    asyncio.run(run())


def test_our_own_bug_is_a_generic_500_without_details():
    async def run() -> None:
        _, srv, c = _fake_app()

        async def broken(job, streams):
            raise RuntimeError("secret detail")
        srv.builder.collect = broken
        async with c:
            r = await c.post("/v1/completions", json=BODY)
            _assert_error(r, 500, "internal_error")
            assert "secret" not in r.text

    asyncio.run(run())


def test_engine_death_mid_stream_goes_in_band_then_health_fails():
    from fake_core import FakeCore

    from conveyor.engine.contracts import EngineCoreOutputs

    async def run() -> None:
        core, srv, c = _fake_app(FakeCore(finish=False))
        async with c:
            stream = asyncio.create_task(c.post("/v1/completions", json={**BODY, "stream": True}))
            await core.added_event.wait()
            core.on_outputs(EngineCoreOutputs(engine_error="worker died"))
            events = [ln[6:] for ln in (await stream).text.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
            assert (await c.get("/health")).status_code == 503
            _assert_error(await c.post("/v1/completions", json=BODY), 503, "engine_unavailable")

    asyncio.run(run())


@pytest.mark.parametrize("origins,allowed", [(None, None), (["http://ui.example"], "http://ui.example")])
def test_cors_preflight_only_when_configured_and_never_with_credentials(origins, allowed):
    from fake_core import engine_config as _cfg

    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}

    async def run() -> None:
        cfg = _cfg(**({"serve.cors_origins": origins} if origins else {}))
        _, _, c = _fake_app(cfg=cfg, headers={})  # a preflight carries no key
        async with c:
            r = await c.options("/v1/completions", headers=preflight)
            assert r.headers.get("access-control-allow-origin") == allowed
            assert "access-control-allow-credentials" not in r.headers

    asyncio.run(run())


def test_output_slot_merges_and_batching_interval(ckpt):
    """A consumer that falls behind gets the steps it missed merged into one
    delta; min_interval_s spaces deltas out; neither changes the tokens."""
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM
    from conveyor.engine.sampling_params import SamplingParams

    cfg = build_config({"model": {"path": ckpt, "max_model_len": 512}})
    # 480 tokens: at ~0.4 ms a step (the decode stack) 120 were done within two 50 ms intervals.
    sp = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        llm = AsyncLLM(cfg)
        try:
            async def deltas(pause_after_first: float = 0.0, interval: float = 0.0):
                out = []
                async for ro in llm.generate("The cat", sp, min_interval_s=interval):
                    out.append((time.monotonic(), list(ro.outputs[0].token_ids), ro.finished))
                    if len(out) == 1 and pause_after_first:
                        await asyncio.sleep(pause_after_first)
                return out

            ref = [t for _, ids, _ in await deltas() for t in ids]
            assert len(ref) == 480
            lagging = await deltas(pause_after_first=0.3)
            assert [t for _, ids, _ in lagging for t in ids] == ref
            assert len(lagging[1][1]) > 1, [len(ids) for _, ids, _ in lagging]
            # abort() from elsewhere ends a consumer that is waiting for output.
            gen = llm.generate("The cat", sp, request_id="to-abort")
            first = await gen.__anext__()
            await llm.abort("to-abort")
            rest = [ro async for ro in gen]
            assert not first.finished and rest[-1].finished
            assert rest[-1].outputs[-1].finish_reason == "abort"
            spaced = await deltas(interval=0.02)
            assert [t for _, ids, _ in spaced for t in ids] == ref and spaced[-1][2]
            gaps = [b[0] - a[0] for a, b in zip(spaced, spaced[1:])]
            assert len(spaced) >= 3 and all(g >= 0.018 for g in gaps[:-1]), gaps
        finally:
            await llm.shutdown()

    asyncio.run(run())


# ---- the openai client ----------------------------------------------------------------

def test_completions_greedy_equals_llm(client, refs):
    for prompt, ref in zip(PROMPTS, refs["completion"]):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0)
        assert r.choices[0].text == ref.text
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")


def test_batch_prompts_index_and_usage(client, refs):
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=MAX_TOKENS,
                                  temperature=0.0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs["completion"][0].text] * 2 + [refs["completion"][1].text] * 2
    assert r.usage.completion_tokens == 2 * sum(len(x.token_ids) for x in refs["completion"][:2])


def test_usage_reports_the_engines_cached_tokens(client):
    """usage.prompt_tokens_details.cached_tokens is the engine's own prefix-cache
    hit (whole 16-token blocks, at most prompt - 1), streamed with include_usage too."""
    prompt = [5 + (i * 37) % 400 for i in range(70)]
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0.0)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64


def test_chat_greedy_equals_llm(client, refs):
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                       temperature=0.0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == refs["chat"].text
    assert r.usage.prompt_tokens == refs["chat_prompt_len"]
    assert r.usage.completion_tokens == len(refs["chat"].token_ids)


def test_streaming_with_usage(client, refs):
    ref = refs["completion"][1]
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)

    msgs = [{"role": "user", "content": PROMPTS[0]}]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == refs["chat"].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(refs["chat"].token_ids)


def test_n2_stop_and_logprobs(client, refs):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, n=2,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    texts = {0: "", 1: ""}
    for c in client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=2,
                                       temperature=0.0, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {0: refs["completion"][0].text, 1: refs["completion"][0].text}
    # A stop string taken from the greedy text ends it right before the stop.
    ref = refs["completion"][0].text
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0.0, stop=[stop])
    assert r.choices[0].text == ref[:ref.index(stop)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6,
                                  temperature=0.0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def _post(server: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{server}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _check_echo_logprobs(lp: dict, ids: list[int], ref, n_out: int) -> None:
    """OpenAI's legacy shape: the prompt's tokens first (null at position 0),
    each value transformers' log-softmax (fp32, 1e-4), top-1 its maximum."""
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + n_out
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < 1e-4
        (top,) = lp["top_logprobs"][j].values()
        assert abs(top - ref[j - 1].max().item()) < 1e-4
    offs = lp["text_offset"]
    assert offs[0] == 0 and all(offs[j + 1] == offs[j] + len(lp["tokens"][j]) for j in range(len(offs) - 1))


def test_completions_echo_prompt_logprobs_match_transformers(server, ckpt, refs):
    from llm_utils import hf_logprobs

    from conveyor.engine.frontend.tokenizer import load_tokenizer

    text = PROMPTS[1]
    tok = load_tokenizer(ckpt)
    ids = tok.encode(text)
    ref = hf_logprobs(ckpt, ids[:1], ids[1:])  # row j predicts ids[j + 1]
    greedy = refs["completion"][1]
    for prompt in (text, ids):  # a string and token ids (lm-eval sends ids)
        for max_tokens in (1, 0):  # lm-eval's loglikelihood shape, and prompt-only scoring
            r = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "echo": True,
                                                   "logprobs": 1, "max_tokens": max_tokens,
                                                   "temperature": 0})
            c = r["choices"][0]
            _check_echo_logprobs(c["logprobs"], ids, ref, max_tokens)
            echoed = text if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)
            assert c["text"] == echoed + (greedy.text[:len(c["text"]) - len(echoed)] if max_tokens else "")
            assert r["usage"]["completion_tokens"] == max_tokens
    # Echo without logprobs: prompt text + the greedy completion.
    r = _post(server, "/v1/completions", {"prompt": text, "echo": True, "max_tokens": MAX_TOKENS,
                                          "temperature": 0})
    assert r["choices"][0]["text"] == text + greedy.text and r["choices"][0]["logprobs"] is None
    # lm-eval's batch: several token-id prompts in one request, choices in order.
    r = _post(server, "/v1/completions", {"prompt": [ids, ids[:5]], "echo": True, "logprobs": 1,
                                          "max_tokens": 1, "temperature": 0, "seed": 1234})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    _check_echo_logprobs(r["choices"][0]["logprobs"], ids, ref, 1)
    _check_echo_logprobs(r["choices"][1]["logprobs"], ids[:5], ref, 1)


def test_completions_echo_streamed_n2(client):
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list] = {0: [], 1: []}
    for ch in client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True, logprobs=1, n=2,
                                        max_tokens=3, temperature=1.0, seed=3, stream=True):
        for c in ch.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.token_logprobs
    for i in (0, 1):
        assert texts[i].startswith(PROMPTS[0])
        assert tokens[i][0] is None and all(v is not None and v <= 0 for v in tokens[i][1:])
    assert len(tokens[0]) == len(tokens[1])


LM_EVAL_TASKS = os.path.join(os.path.dirname(__file__), "lm_eval_tasks")


def test_lm_eval_local_completions(server, ckpt, monkeypatch):
    """lm-eval's own local-completions client runs loglikelihood (multiple
    choice) and loglikelihood_rolling (perplexity) on the repo's tiny task;
    every score equals transformers' on the token ids lm-eval sent."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("lm_eval")
    from llm_utils import hf_logprobs
    from lm_eval import evaluator
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    seen = []
    parse = LocalCompletionsAPI.parse_logprobs

    def spy(outputs, tokens=None, ctxlens=None, **kw):
        res = parse(outputs, tokens=tokens, ctxlens=ctxlens, **kw)
        seen.extend(zip(tokens, ctxlens, res))
        return res

    monkeypatch.setattr(LocalCompletionsAPI, "parse_logprobs", staticmethod(spy))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.chdir(ROOT)  # the tasks name their data relative to the repository
    out = evaluator.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": f"{server}/v1/completions", "tokenizer": ckpt,
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1,
                    "max_length": 512},
        tasks=["conveyor_tiny_mc", "conveyor_tiny_rolling"],
        task_manager=TaskManager(include_path=LM_EVAL_TASKS, include_defaults=False),
        log_samples=False, bootstrap_iters=0)
    assert "acc,none" in out["results"]["conveyor_tiny_mc"]
    assert out["results"]["conveyor_tiny_rolling"]["word_perplexity,none"] > 1
    assert len(seen) == 8 + 3  # one request per choice, one window per text
    for ids, ctxlen, (ll, greedy) in seen:
        ref = hf_logprobs(ckpt, ids[:ctxlen], ids[ctxlen:])
        cont = torch.tensor(ids[ctxlen:])
        assert abs(ll - ref.gather(1, cont[:, None]).sum().item()) < 1e-4 * len(cont)
        assert greedy == bool((ref.argmax(-1) == cont).all())


def test_null_means_absent(server):
    nulls = {k: None for k in ("n", "presence_penalty", "frequency_penalty", "logprobs", "stream", "echo",
                               "min_p", "repetition_penalty", "seed", "stop", "temperature", "top_p",
                               "max_tokens")}
    r = _post(server, "/v1/completions", {"prompt": PROMPTS[0], **nulls, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["logprobs"] is None
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               **nulls, "top_logprobs": None, "max_tokens": 3})
    assert r["usage"]["completion_tokens"] <= 3 and len(r["choices"]) == 1


def test_logit_bias_and_allowed_token_ids_http(server, ckpt):
    from conveyor.engine.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    r = _post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                          "logit_bias": {"42": 100}, "ignore_eos": True})
    assert r["choices"][0]["text"] == tok.decode([42] * 4)
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 6, "temperature": 1.0, "seed": 5,
                                               "allowed_token_ids": [42, 43], "ignore_eos": True,
                                               "logprobs": True})
    got = {t for c in r["choices"][0]["logprobs"]["content"] for t in [c["token"]]}
    assert got <= {tok.decode([42]), tok.decode([43])}


def test_models_and_request_id(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.post(f"{server}/v1/completions", headers={**AUTH, "X-Request-Id": "my-req-42"},
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.headers["x-request-id"] == "my-req-42" and r.json()["id"] == "cmpl-my-req-42"
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2})
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]


def test_responses_live_in_the_cluster_store(server, client):
    """Stored responses sit in one named Ray actor over sqlite: a follow-up
    continues after that actor is killed (recreated over the same file)."""
    import ray

    from conveyor.cluster.openai.responses_api.store import ACTOR_NAME, ACTOR_NAMESPACE

    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=4, temperature=0.0)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    ray.kill(ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE))
    follow = client.responses.create(model="tiny", previous_response_id=r.id, input="More",
                                     max_output_tokens=2, temperature=0.0)
    assert follow.usage.input_tokens > r.usage.input_tokens
    client.responses.delete(r.id)
    r404 = httpx.get(f"{server}/v1/responses/{r.id}", headers=AUTH)
    assert r404.status_code == 404 and r404.json()["error"]["code"] == "response_not_found"


# ---- errors --------------------------------------------------------------------------------

ERRORS = [  # (path, raw body, status, code, param)
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "invalid_value", "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400, "invalid_value", "top_p"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 1.5}', 400, "invalid_value", "top_p"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "invalid_value", "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "n": 1000}', 400, "invalid_value", "n"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 50}', 400, "invalid_value", "logprobs"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "invalid_value", "temperature"),
    ("/v1/completions", b'{"prompt": ""}', 400, "invalid_value", "prompt"),
    ("/v1/completions", b'{"prompt": []}', 400, "invalid_value", "prompt"),
    ("/v1/completions", b'{"prompt": [100000]}', 400, "invalid_value", "prompt"),
    ("/v1/completions", b'{"prompt": "x"', 400, "invalid_json", None),
    ("/v1/completions", b'[1, 2]', 400, "invalid_json", None),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "missing_required_parameter", "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "missing_required_parameter", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400,
     "invalid_value", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
     400, "invalid_value", "top_logprobs"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1024}', 400, "context_length_exceeded", "prompt"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}',
     400, "context_length_exceeded", "messages"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "model_not_found", "model"),
    ("/v1/responses", b'{"input": "x", "previous_response_id": "resp_x"}', 404, "response_not_found",
     "previous_response_id"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"5": 101}}', 400, "invalid_value", "logit_bias"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"five": 1}}', 400, "invalid_value", "logit_bias"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"100000": 1}}', 400, "invalid_value",
     "logit_bias"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 1}}',
     400, "invalid_value", "logit_bias"),
    ("/v1/completions", b'{"prompt": "x", "allowed_token_ids": [100000]}', 400, "invalid_value",
     "allowed_token_ids"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0, "echo": false}', 400, "invalid_value",
     "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400,
     "invalid_value", "stream_options"),
]


def _assert_error(r: httpx.Response, status: int, code: str, param: str | None = "any") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["type"], str) and err["code"] == code
    if param != "any":
        assert err["param"] == param


def test_error_statuses_and_shape(server):
    with httpx.Client(base_url=server, headers={**AUTH, "Content-Type": "application/json"}) as c:
        for path, body, status, code, param in ERRORS:
            _assert_error(c.post(path, content=body), status, code, param)
        big = b'{"prompt": "' + b"x" * (2 * 1024 * 1024) + b'"}'
        _assert_error(c.post("/v1/completions", content=big), 413, "request_too_large")
        # No Content-Length (chunked): the streamed size is counted.
        _assert_error(c.post("/v1/completions", content=iter([b"x" * 65536] * 40)), 413, "request_too_large")
        _assert_error(c.get("/no/such/route"), 404, "not_found")
    # The server survives all of it.
    assert httpx.get(f"{server}/health").status_code == 200


PROTECTED = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/v1/models/tiny", None),
             ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
             ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 1})]


def test_auth_per_route(server):
    with httpx.Client(base_url=server) as c:
        for method, path, body in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                _assert_error(c.request(method, path, json=body, headers=headers), 401, "invalid_api_key")
            assert c.request(method, path, json=body, headers=AUTH).status_code == 200
        _assert_error(c.get("/v1/../health/x"), 401, "invalid_api_key")  # not a public path
        for path in ("/health", "/live"):
            assert c.get(path).status_code == 200


def test_health_and_metrics(server, client):
    client.completions.create(model="tiny", prompt="The cat", max_tokens=4)
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    m = _metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert any(k.split("{")[0] == "conveyor:" + name for k in m), name
    assert _metric(m, "conveyor:prompt_tokens_total") > 0
    assert _metric(m, "conveyor:generation_tokens_total") >= 4
    assert 0.0 <= _metric(m, "conveyor:kv_cache_usage_perc") <= 1.0
    assert _metric(m, "conveyor:time_to_first_token_seconds_count") >= 1
    assert 0 < _metric(m, "conveyor:e2e_request_latency_seconds_sum") < 60


# ---- disconnects, backpressure, load ----------------------------------------------

def _wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Probe until the engine reports nothing running and no KV in use. The
    scheduler's stats are per step, so a small request makes it step once more."""
    deadline, m = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 1})
        m = _metrics(url)
        if (_metric(m, "conveyor:api_requests_in_progress") == 0
                and _metric(m, "conveyor:num_requests_running") == 0
                and _metric(m, "conveyor:num_requests_waiting") == 0
                and _metric(m, "conveyor:kv_cache_usage_perc") == 0.0):
            return m
        time.sleep(0.2)
    raise AssertionError(f"engine did not go idle: {m}")


def test_disconnect_aborts_and_frees_kv(server):
    long = {"prompt": "The cat runs", "max_tokens": 1000, "ignore_eos": True}
    before = _metric(_wait_idle(server), "conveyor:generation_tokens_total")

    async def stream_then_leave() -> None:
        async with httpx.AsyncClient(base_url=server, headers=AUTH) as c:
            async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 5:
                        break  # leaving the block closes the connection mid-stream

    asyncio.run(stream_then_leave())
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
        httpx.post(f"{server}/v1/completions", headers=AUTH, json=long, timeout=0.3)
    after = _metric(_wait_idle(server), "conveyor:generation_tokens_total")
    # Neither request ran to its 1000 tokens: both were aborted in the engine.
    assert after - before < 1000


def test_64_concurrent_streams(server):
    async def one(c: httpx.AsyncClient, i: int) -> tuple[bool, int, int]:
        body = {"prompt": f"{PROMPTS[i % 4]} {i}", "max_tokens": 32, "ignore_eos": True, "logprobs": 0,
                "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
        done, tokens, usage = False, 0, -1
        async for ev in sse_events(c, "/v1/completions", body):
            if ev is DONE:
                done = True
                continue
            assert "error" not in ev, ev
            if ev["choices"]:  # a chunk may carry several tokens when the server lags
                tokens += len(ev["choices"][0]["logprobs"]["tokens"])
            else:
                usage = ev["usage"]["completion_tokens"]
        return done, tokens, usage

    async def run() -> list[tuple[bool, int, int]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server, headers=AUTH, limits=limits, timeout=60) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(64))), 60)

    results = asyncio.run(run())  # run() bounds the load: a hang fails, not a slow machine
    assert all(done for done, _, _ in results)
    # the streamed tokens add up to usage
    assert all(tokens == usage == 32 for _, tokens, usage in results), results
    _wait_idle(server)


def test_backpressure_429(server, ckpt, tmp_path):
    """A second app that admits 1 ongoing + 1 queued request: the rest get 429 +
    Retry-After in the OpenAI error shape, and the slots come back afterwards."""
    from ray import serve

    from conveyor.cluster.serve_app import build_app

    cfg = _write_config(str(tmp_path / "small.yaml"), ckpt, 1, max_ongoing_requests=1,
                        max_queued_requests=1)
    serve.run(build_app({"config": cfg, "name": "Small"}),
              name="small", route_prefix="/small", blocking=False)
    try:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=60) as c:
                body = {"prompt": "The cat", "max_tokens": 400, "ignore_eos": True}
                return await asyncio.gather(*(c.post("/small/v1/completions", json=body)
                                              for _ in range(5)))

        responses = asyncio.run(run())
        codes = sorted(r.status_code for r in responses)
        assert codes == [200, 200, 429, 429, 429], codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers.get("retry-after") == "1"
                _assert_error(r, 429, "server_at_capacity")
        assert sorted(r.status_code for r in asyncio.run(run())) == codes  # no slot leaked
    finally:
        serve.delete("small")


def test_ray_executor_inside_the_replica_placement_group(server, ckpt, refs, tmp_path):
    """executor "ray" behind Serve: the EngineCoreActor shares the replica's bundle 0,
    its worker takes bundle 1 of the replica's placement group (no group of its own),
    and greedy output equals LLM.generate."""
    import ray
    from ray import serve

    from conveyor.cluster.serve_app import build_app

    def live_groups() -> set[str]:
        return {pid for pid, g in ray.util.placement_group_table().items() if g["state"] == "CREATED"}

    before = live_groups()
    cfg = _write_config(str(tmp_path / "rayexec.yaml"), ckpt, 1)
    serve.run(build_app({"config": cfg, "name": "RayExec", "overrides": {"executor": "ray"}}),
              name="rayexec", route_prefix="/rayexec", blocking=False)
    try:
        added = live_groups() - before
        assert len(added) == 1, added  # the replica's own; the executor made none
        r = httpx.post(f"{server}/rayexec/v1/completions", headers=AUTH, timeout=120, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == refs["completion"][0].text
        # Both bundles of the replica's group are in use: 0 by the replica, 1 by the worker.
        pg = added.pop()
        total, free = ray.cluster_resources(), ray.available_resources()
        for b in (0, 1):
            key = f"CPU_group_{b}_{pg}"
            assert total.get(key) == 1.0 and free.get(key, 0.0) == 0.0, (key, total.get(key), free.get(key))
    finally:
        serve.delete("rayexec")


@pytest.fixture(scope="module")
def dp_url(server, ckpt, tmp_path_factory):
    """A second app: data_parallel_size=2, each engine an EngineCoreActor
    driving one `mp` worker process, restart budget 0 (a lost engine's
    requests can only go on by migration)."""
    from ray import serve

    from conveyor.cluster.serve_app import build_app

    cfg = _write_config(str(tmp_path_factory.mktemp("dp") / "dp.yaml"), ckpt, 1)
    serve.run(build_app({"config": cfg, "name": "DP", "overrides": {
        "data_parallel_size": 2, "parallel.num_cpus_per_worker": 0.5, "executor": "mp",
        "parallel.max_restarts": 0}}), name="dp", route_prefix="/dp", blocking=False)
    try:
        yield f"{server}/dp"
    finally:
        serve.delete("dp")


def test_data_parallel_app_matches_one_engine_over_http(client, refs, dp_url):
    """data_parallel_size=2 behind one ingress replica: two EngineCoreActors and
    the kv_aware router give the single engine's tokens (greedy = LLM.generate,
    seeded = the module's one-engine app), a repeated prompt is routed to its
    cached blocks (usage.cached_tokens), and /metrics has per-engine series."""
    def post(body: dict) -> dict:
        r = httpx.post(f"{dp_url}/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", **body})
        assert r.status_code == 200, r.text
        return r.json()

    for prompt, ref in zip(PROMPTS, refs["completion"]):
        out = post({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0})
        assert out["choices"][0]["text"] == ref.text
    seeded = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0.9, "seed": 5}
    one = client.completions.create(model="tiny", **seeded).choices[0].text
    assert post(seeded)["choices"][0]["text"] == one
    long_prompt = [7 + (i * 53) % 400 for i in range(70)]
    post({"prompt": long_prompt, "max_tokens": 2, "temperature": 0.0})
    again = post({"prompt": long_prompt, "max_tokens": 2, "temperature": 0.0})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    m = _metrics(dp_url)
    engines = {k.split('engine="')[1].split('"')[0] for k in m if k.startswith("conveyor:router_decisions")}
    assert engines == {"0", "1"}, m
    assert any('reason="cache_hit"' in k for k in m if k.startswith("conveyor:router_decisions"))
    _drain_over_http(dp_url, post)


def test_32_streams_survive_engine_loss_and_drain(dp_url):
    """Issue 26 over HTTP: 32 concurrent streams (tests/cpu/migration_streams.py)
    on the 2-engine app, disrupted separately by SIGKILL of engine 0's
    EngineCoreActor, SIGKILL of its worker (restart budget 0), and a drain of
    engine 0. Every stream ends [DONE], no error event, with the undisturbed
    run's text, tool calls, finish reasons and logprob tokens; the engines end
    with no request and KV usage 0; /admin/replace brings a dead engine back."""
    import signal

    from migration_streams import bodies, diff, run_streams

    def engines() -> list[dict]:
        r = httpx.get(f"{dp_url}/admin/engines", headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["engines"]

    def idle_kv() -> list[float]:
        for _ in range(200):  # an abort for a stop string may still be on its way
            up = [e for e in engines() if e["state"] in ("up", "drained")]
            if not any(e["requests"] for e in up):
                break
            time.sleep(0.05)
        return [e["kv_cache_usage"] for e in up]

    def replace0() -> None:
        r = httpx.post(f"{dp_url}/admin/replace", headers=AUTH, json={"engine": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert [e["state"] for e in engines()] == ["up", "up"]

    assert [e["state"] for e in engines()] == ["up", "up"]  # a module-shared app: no drain left over
    probe = asyncio.run(run_streams(dp_url, AUTH, bodies("\x00")[27:]))[0]["choices"][1]["text"]
    stop = probe[len(probe) // 2:len(probe) // 2 + 2]
    assert stop.strip(), probe
    pairs = bodies(stop)
    ref = asyncio.run(run_streams(dp_url, AUTH, pairs))
    assert any(c["finish"] == "stop" for r in ref[27:] for c in r["choices"].values())
    assert all(r["choices"][0]["tools"][0]["name"] == "get_weather" for r in ref[22:27])

    async def drain(c: httpx.AsyncClient) -> None:
        # Drained once engine 0 reports requests of this run (the engines were
        # idle before it): waiting for every stream's first event instead let
        # engine 0 finish its short streams first on a loaded box.
        deadline = time.monotonic() + 60
        while not (await c.get("/admin/engines")).json()["engines"][0]["requests"]:
            assert time.monotonic() < deadline, "engine 0 never ran a request of this run"
            await asyncio.sleep(0.05)  # the engines' stats come once per step
        r = await c.post("/admin/drain", json={"engine": 0})
        assert r.status_code == 200 and r.json()["moved_requests"] > 0, r.text

    def kill(pid: int):
        async def go(c: httpx.AsyncClient) -> None:
            os.kill(pid, signal.SIGKILL)
        return go

    assert idle_kv() == [0.0, 0.0]  # no request left of the reference run: drain() waits for this one's
    assert diff(asyncio.run(run_streams(dp_url, AUTH, pairs, drain, at_once=True)), ref) is None
    assert idle_kv() == [0.0, 0.0]
    assert httpx.post(f"{dp_url}/admin/undrain", headers=AUTH, json={"engine": 0}).status_code == 200
    for victim in ("worker_pids", "actor_pid"):
        e0 = engines()[0]
        pid = e0[victim][0] if victim == "worker_pids" else e0[victim]
        assert diff(asyncio.run(run_streams(dp_url, AUTH, pairs, kill(pid))), ref) is None, victim
        assert [e["state"] for e in engines()] == ["dead", "up"], victim
        assert idle_kv() == [0.0], victim
        replace0()
    m = _metrics(dp_url)
    for cause in ("drain", "lost"):
        assert sum(v for k, v in m.items() if k.startswith("conveyor:migrations_total{")
                   and 'engine="0"' in k and f'cause="{cause}"' in k) > 0, (cause, m)


@pytest.fixture(scope="module")
def pd_url(server, ckpt, tmp_path_factory):
    """A P/D app: one prefill and one decode EngineCoreActor sharing a KV
    folder, restart budget 0 (a killed engine stays dead)."""
    from ray import serve

    from conveyor.cluster.serve_app import build_app

    tmp = tmp_path_factory.mktemp("pd")
    cfg = _write_config(str(tmp / "pd.yaml"), ckpt, 1)
    serve.run(build_app({"config": cfg, "name": "PD", "overrides": {
        "data_parallel_size": 2, "prefill_engines": 1, "offload_disk_path": str(tmp / "kv"),
        "offload_disk_gb": 0.05, "parallel.num_cpus_per_worker": 0.5, "executor": "mp",
        "parallel.max_restarts": 0, "max_num_batched_tokens": 64}}),  # prefill legs last many steps
        name="pd", route_prefix="/pd", blocking=False)
    try:
        yield f"{server}/pd"
    finally:
        serve.delete("pd")


def test_pd_app_matches_one_engine_and_survives_its_prefill_actor_killed(server, pd_url):
    """Issue 48 over HTTP: 16 streams with long prompts (greedy, seeded, n=2, JSON schema)
    give the one-engine app's text on the P/D app, with the prompts' blocks
    handed over; then SIGKILL of the prefill engine's EngineCoreActor while
    its legs run: every stream still ends [DONE] with the same text."""
    import signal

    from migration_streams import diff, run_streams

    schema = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}}, "required": ["a"],
              "additionalProperties": False}

    def streams(salt: int) -> list[tuple[str, dict]]:
        plain = [("/v1/completions", {
            "prompt": [7 + (i * 31 + j * 17 + salt) % 400 for j in range(300 + 8 * i)], "max_tokens": 24,
            "ignore_eos": True, "temperature": 0.0 if i % 3 == 0 else 0.8, "seed": 50 + i,
            "n": 2 if i % 3 == 2 else 1, "logprobs": 0}) for i in range(14)]
        words = " ".join(f"w{(k * 7 + salt) % 97}" for k in range(120))  # a long prompt: P/D hands it over
        return plain + [("/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"{words} {i}"}], "max_tokens": 40, "temperature": 0.8,
            "seed": 70 + i, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
            for i in range(2)]

    pairs, fresh = streams(0), streams(1)  # fresh: prompts no engine has cached
    ref = asyncio.run(run_streams(server, AUTH, pairs))
    ref_fresh = asyncio.run(run_streams(server, AUTH, fresh))
    assert diff(asyncio.run(run_streams(pd_url, AUTH, pairs)), ref) is None
    engines = httpx.get(f"{pd_url}/admin/engines", headers=AUTH, timeout=60).json()["engines"]
    assert [e["role"] for e in engines] == ["prefill", "decode"]
    text = httpx.get(f"{pd_url}/metrics", headers=AUTH).text
    assert re.search(r'conveyor_kv_reused_tokens_total\{[^}]*source="prefill"\} [1-9]', text), text

    def decode_computed() -> float:
        m = _metrics(pd_url)
        return next(v for k, v in m.items() if k.startswith('conveyor:prompt_tokens_computed_total{engine="1"'))

    async def kill_prefill(c: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 60  # once legs are on their way to it
        while not (await c.get("/admin/engines")).json()["engines"][0]["prefill_legs"]:
            assert time.monotonic() < deadline, "no prefill leg was sent"
            await asyncio.sleep(0.002)
        os.kill(engines[0]["actor_pid"], signal.SIGKILL)

    before = decode_computed()
    assert diff(asyncio.run(run_streams(pd_url, AUTH, fresh, kill_prefill, at_once=True)), ref_fresh) is None
    r = httpx.get(f"{pd_url}/admin/engines", headers=AUTH)
    assert r.status_code == 200, r.text
    states = [e["state"] for e in r.json()["engines"]]
    assert states[0] in ("dead", "lost") and states[1] == "up", states
    # Some prompts were never handed over: the decode engine computed them whole.
    assert decode_computed() - before > 300, (before, decode_computed(), states)


def _drain_over_http(url: str, post) -> None:
    """POST /admin/drain with streams in flight on both engines: every stream
    ends [DONE] with its undisturbed text and finish reason (greedy and
    seeded), and the drain is counted; undrain takes the engine back."""
    # 400 tokens: with every decode step one native call, 40-token streams finished before the drain.
    bodies = [{"prompt": p, "max_tokens": 400, "ignore_eos": True, "temperature": t, "seed": 5}
              for p in PROMPTS for t in (0.0, 0.9)]
    want = [post(b)["choices"][0]["text"] for b in bodies]

    async def one(c: httpx.AsyncClient, body: dict, started: asyncio.Event) -> tuple[str, str | None, bool]:
        text, finish, done = "", None, False
        async for ev in sse_events(c, "/v1/completions", {"model": "tiny", "stream": True, **body}):
            if ev is DONE:
                done = True
                continue
            assert "error" not in ev, ev
            text += ev["choices"][0]["text"]
            finish = ev["choices"][0]["finish_reason"] or finish
            started.set()
        return text, finish, done

    async def run() -> tuple[list, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as c:
            started = [asyncio.Event() for _ in bodies]
            tasks = [asyncio.create_task(one(c, b, s)) for b, s in zip(bodies, started)]
            await asyncio.gather(*(s.wait() for s in started))
            r = await c.post("/admin/drain", json={"engine": 0})
            return await asyncio.gather(*tasks), r

    got, r = asyncio.run(run())
    assert r.status_code == 200 and r.json()["status"] == "drained", r.text
    assert got == [(t, "length", True) for t in want]
    m = _metrics(url)
    drains = [v for k, v in m.items() if k.startswith("conveyor:migrations_total{")
              and 'engine="0"' in k and 'cause="drain"' in k]
    assert drains == [r.json()["moved_requests"]] and drains[0] > 0
    assert httpx.post(f"{url}/admin/drain", json={"engine": 0}).status_code == 401  # behind the key
    from conveyor.cluster.cli.main import main

    # `conveyor drain --undrain` takes it back; a second undrain is a 400 naming engine.
    assert main(["drain", "--url", url, "--engine", "0", "--undrain", "--api-key-env", KEY_ENV]) == 0
    r = httpx.post(f"{url}/admin/undrain", headers=AUTH, json={"engine": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "engine", r.text


def _thread_cpus(pid: int) -> list[set[int]]:
    """Each thread's allowed cores (Linux affinity is per thread)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(os.sched_getaffinity(int(tid)))
        except OSError:  # a thread that just ended
            continue
    return out


def test_cpu_replica_pins_engine_step_thread_and_replica_threads(server):
    """serve.frontend_cpus auto (1 here): the engine actor's step thread sits on
    all but the last core, every replica thread on the last one."""
    from conveyor.cluster.engine_actor.cpu_layout import split_cpus

    split = split_cpus(os.sched_getaffinity(0), 1)
    if split is None:
        pytest.skip("one core: nothing to split")
    engines = [_thread_cpus(p) for p in engine_actor_pids()]
    assert any(set(split.engine) in threads for threads in engines), engines
    replicas = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, b"OpenAIDeployment")]
    assert replicas
    assert any(all(c == set(split.frontend) for c in _thread_cpus(int(p))) for p in replicas)


def _cmdline_has(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return needle in f.read()
    except OSError:
        return False


def test_engine_actor_death_fails_streams_and_health(server, ckpt, tmp_path):
    """Past the restart budget (none here) the replica's engine actor dies
    mid-stream: the stream ends with an in-band engine_unavailable error and
    [DONE] (not a hang), and /health answers 503. (Within the budget the actor
    is replaced: test_engine_actor_recovery.py.)"""
    import signal

    from ray import serve

    from conveyor.cluster.serve_app import build_app

    before = engine_actor_pids()
    cfg = _write_config(str(tmp_path / "doomed.yaml"), ckpt, 1)
    with open(cfg) as f:
        doomed = json.load(f)
    doomed["parallel"] = {"max_restarts": 0}
    with open(cfg, "w") as f:
        json.dump(doomed, f)
    serve.run(build_app({"config": cfg, "name": "Doomed"}), name="doomed", route_prefix="/doomed",
              blocking=False)
    try:
        new = engine_actor_pids() - before
        assert len(new) == 1, new
        victim = new.pop()

        async def stream_while_killing() -> list[str]:
            body = {"prompt": "The cat", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            events: list[str] = []
            async with httpx.AsyncClient(base_url=f"{server}/doomed", headers=AUTH, timeout=60) as c:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 3:
                                os.kill(victim, signal.SIGKILL)
            return events

        # The bound guards against a hang; the stream's own end is the event.
        events = asyncio.run(asyncio.wait_for(stream_while_killing(), 60))
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
        _assert_error(httpx.get(f"{server}/doomed/health", timeout=30), 503, "engine_unavailable")
    finally:
        serve.delete("doomed")

"""LLaVA and Qwen2.5-VL end to end (issue 46): greedy fp32 tokens equal transformers'
generate through its own LlavaProcessor (vLLM's top-5 rule at a
divergence) on a tiny random checkpoint built here, with one image, two
images of different sizes, a text-only prompt in the same batch, prefill
chunks that cut through image placeholders, the same text with different
images, the same image again (encoder cache and prefix cache), preemption;
llm.chat with a data: URL gives generate's tokens."""
from __future__ import annotations

import base64
import io

import pytest
from llm_utils import close_or_why, engine_top5
from mm_utils import (
    IMAGE_ID,
    IMAGE_TOKENS,
    QWEN_IMAGE_ID,
    QWEN_PLACEHOLDER,
    hf_generate,
    hf_generate_qwen,
    image,
    make_tiny_llava,
    make_tiny_qwen_vl,
)

from conveyor.engine import LLM, SamplingParams

TOKENS = 10
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
# Two full blocks (block size 16) of text before the first image.
LEAD = ("The old man reads a long story in the morning? Every token finds the garden at night! "
        "My friend visits the river. Look:")
CASES = [  # (prompt, images): images of other sizes are resized and cropped by the processor
    ("The cat runs to the garden today.", []),
    (f"{LEAD} <image> what the cat sees", [image(1)]),
    ("<image> and <image>: which is the dog?", [image(2, (30, 30)), image(3, (64, 48))]),
    (f"{LEAD} <image> what the cat sees", [image(4, (50, 30))]),  # case 1's text, another image
    ("A small bird eats <image> the ball", [image(1)]),  # case 1's image, another text
]


def _prompt(text: str, images: list):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("llava") / "m"))


@pytest.fixture(scope="module")
def refs(llava):
    return [hf_generate(llava, p, imgs, TOKENS) for p, imgs in CASES]


def _check(outs, refs) -> None:
    for i, (o, (ref, top5)) in enumerate(zip(outs, refs)):
        c = o.outputs[0]
        why = close_or_why(c.token_ids, engine_top5(c), ref, top5)
        assert why is None, f"case {i}: {why}"


def _image_offset(out) -> int:
    return out.prompt_token_ids.index(IMAGE_ID)


def test_mixed_batch_chunked_through_images_matches_hf(llava, refs):
    """16 tokens a step: every image's 25 placeholders span two or three
    chunks; the encoder runs once per distinct image (case 4 reuses case 1's
    output: one hit), and the prefix cache shares case 1's text blocks with
    case 3 but never a block holding a different image; case 1 again hits
    its image blocks too."""
    with LLM(model=llava, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        outs = llm.generate([_prompt(p, imgs) for p, imgs in CASES], GREEDY, use_tqdm=False)
        hits = llm.get_metrics()["conveyor_encoder_cache_hits_total"]
        again = llm.generate(_prompt(*CASES[1]), GREEDY, use_tqdm=False)[0]
    _check(outs, refs)
    _check([again], refs[1:2])
    assert hits == 1
    assert [o.prompt_token_ids.count(IMAGE_ID) for o in outs] == [0, IMAGE_TOKENS, 2 * IMAGE_TOKENS,
                                                                  IMAGE_TOKENS, IMAGE_TOKENS]
    lead = _image_offset(outs[1])
    assert lead >= 32 and _image_offset(outs[3]) == lead
    assert outs[3].num_cached_tokens == lead // 16 * 16  # the text blocks, not the image's
    # The same text and image: every full block, its image's included.
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 >= lead + IMAGE_TOKENS


def test_preemption_recomputes_images(llava, refs):
    """A KV pool of 12 blocks for five requests: some are preempted and
    recompute their prompts, images included, from their cached encoder
    outputs or afresh; the tokens stay transformers'."""
    with LLM(model=llava, max_model_len=128, num_gpu_blocks=12, max_num_batched_tokens=64,
             max_num_seqs=5, enable_prefix_caching=False) as llm:
        outs = llm.generate([_prompt(p, imgs) for p, imgs in CASES], GREEDY, use_tqdm=False)
        preempted = llm.engine.scheduler.num_preemptions
    _check(outs, refs)
    assert preempted > 0


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_a_data_url_gives_generates_tokens(llava, refs):
    """The parts are concatenated in order, the image as "<image>", then the
    chat template; the same prompt through generate gives the same tokens."""
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": _data_url(image(1))}},
             {"type": "text", "text": " what the cat sees"}]
    with LLM(model=llava, max_model_len=256) as llm:
        chat = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Look: <image> what the cat sees"}])
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        gen = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image(1)}}, GREEDY,
                           use_tqdm=False)[0]
        plain = llm.chat([{"role": "user", "content": "The cat runs"}], GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == gen.prompt_token_ids
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids
    assert IMAGE_ID not in plain.prompt_token_ids and len(plain.outputs[0].token_ids) == TOKENS


# ---- Qwen2.5-VL: window attention, 2D rotary, the patch merger, M-RoPE -------------------------

QWEN_CASES = [  # images of different sizes get different grids, so different token counts
    ("The cat runs to the garden today.", []),
    (f"{LEAD} {QWEN_PLACEHOLDER} what the cat sees", [image(1, (30, 20))]),
    (f"{QWEN_PLACEHOLDER} and {QWEN_PLACEHOLDER}: which is the dog?", [image(2, (20, 20)), image(3, (40, 28))]),
    (f"{LEAD} {QWEN_PLACEHOLDER} what the cat sees", [image(4, (24, 36))]),  # case 1's text, another image
    (f"A small bird eats {QWEN_PLACEHOLDER} the ball", [image(1, (30, 20))]),  # case 1's image, another text
]


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory) -> str:
    return make_tiny_qwen_vl(str(tmp_path_factory.mktemp("qwen_vl") / "m"))


def test_qwen2_5_vl_matches_hf_chunked_preempted_and_tp2(qwen_vl):
    """M-RoPE positions across chunks that cut through images (16 tokens a
    step), decode tokens after the images (index + delta), a prefix-cache hit
    on text blocks only; then a small KV pool (preemption) and TP=2."""
    refs = [hf_generate_qwen(qwen_vl, p, imgs, TOKENS) for p, imgs in QWEN_CASES]
    prompts = [_prompt(p, imgs) for p, imgs in QWEN_CASES]
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": _data_url(image(1, (30, 20)))}}]
    with LLM(model=qwen_vl, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        hits = llm.get_metrics()["conveyor_encoder_cache_hits_total"]
        chat = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Look: {QWEN_PLACEHOLDER}"}])
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        gen = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image(1, (30, 20))}}, GREEDY,
                           use_tqdm=False)[0]
    _check(outs, refs)
    # llm.chat renders the image part as <|vision_start|><|image_pad|><|vision_end|>.
    assert chat.prompt_token_ids == gen.prompt_token_ids and chat.prompt_token_ids.count(QWEN_IMAGE_ID) == 40
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids
    assert hits == 1
    assert [o.prompt_token_ids.count(QWEN_IMAGE_ID) for o in outs] == [0, 40, 25 + 70, 54, 40]
    lead = outs[1].prompt_token_ids.index(QWEN_IMAGE_ID)
    assert outs[3].num_cached_tokens == lead // 16 * 16
    with LLM(model=qwen_vl, max_model_len=128, num_gpu_blocks=16, max_num_batched_tokens=128,
             max_num_seqs=5, enable_prefix_caching=False) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        preempted = llm.engine.scheduler.num_preemptions
    _check(outs, refs)
    assert preempted > 0
    with LLM(model=qwen_vl, max_model_len=256, tensor_parallel_size=2, executor="mp") as llm:
        _check(llm.generate(prompts, GREEDY, use_tqdm=False), refs)


def test_hub_layout_checkpoint_loads_the_same_weights(llava, tmp_path):
    """The Hub's llava-hf checkpoints name the tower "vision_tower.vision_model."
    (and transformers 5 "model.vision_tower.", "model.language_model."):
    every spelling fills the same parameters. LoRA on a vision-language model
    is refused at start, naming it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.prepare import Frontend
    from conveyor.parallel import state
    from conveyor.workers.model_loader import load_hf_config, load_model

    tensors = load_file(f"{llava}/model.safetensors")
    renames = [("vision_tower.", "vision_tower.vision_model."), ("language_model.model.", "model.language_model."),
               ("multi_modal_projector.", "model.multi_modal_projector.")]
    hub = str(tmp_path / "hub")
    shutil.copytree(llava, hub)
    moved = {}
    for k, v in tensors.items():
        for old, new in renames:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        moved[k] = v
    save_file(moved, f"{hub}/model.safetensors", metadata={"format": "pt"})
    state.init_distributed(1, 0, 1, 1, f"file://{tmp_path / 'dist'}")
    try:
        a, b = (dict(load_model(p, load_hf_config(p), torch.float32, "cpu").named_parameters()) for p in (llava, hub))
    finally:
        state.destroy_distributed()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="LoRA adapters on a vision-language model"):
        Frontend(build_config(model=llava, enable_lora=True), 520)


# ---- over HTTP (an in-process engine for the rest of the module: the last tests) -------------

def _png_claiming(width: int, height: int) -> str:
    """A data URL of a 1x1 PNG whose header (CRC fixed) claims width x height."""
    import struct
    import zlib

    buf = io.BytesIO()
    image(0, (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode()


def _bmp_url() -> str:
    buf = io.BytesIO()
    image(0, (4, 4)).save(buf, format="BMP")
    return "data:image/bmp;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


BAD_HTTP = [  # (image urls, words of the 400's message)
    (["data:image/png;base64,aGVsbG8gd29ybGQ="], "could not be decoded"),
    ([_png_claiming(100_000, 100_000)], "pixels"),
    ([_data_url(image(1))] * 5, "the limit is 4"),
    (["https://example.com/cat.png"], "allowed_media_domains"),
    ([_bmp_url()], "BMP"),
    ([_data_url(image(1))] * 2, "3 image placeholder"),  # "<image>" also typed as text: 3 for 2
]


@pytest.fixture(scope="module")
def api(llava):
    from asgi_utils import in_process_api

    yield from in_process_api(llava, 256)


def test_http_chat_with_a_data_url_matches_hf_and_bad_images_are_400s(api, llava, monkeypatch):
    """The openai client sends an image_url part (data: URL): transformers'
    tokens for the same rendered prompt come back, the image loaded on the
    prep pool, never on the event loop. Each bad image is a 400 naming the
    problem; /health stays 200 and the next request answers."""
    import threading

    from asgi_utils import openai_client, run_on

    import conveyor.cluster.openai.images as images_mod

    loop, app, llm = api
    threads = []

    def recording_load(url, policy):
        threads.append(threading.get_ident())
        return load_image(url, policy)

    load_image = images_mod.load_image
    monkeypatch.setattr(images_mod, "load_image", recording_load)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Look: <image> what the cat sees"}])
    assert text.startswith("<s>")
    ref, _ = hf_generate(llava, text[len("<s>"):], [image(1)], TOKENS)  # the processor adds <s> itself
    parts = [{"type": "text", "text": "Look: "}, _image_part(_data_url(image(1))),
             {"type": "text", "text": " what the cat sees"}]

    async def ask(client):
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                                 max_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.usage.prompt_tokens

    async def go(c):
        first = await ask(openai_client(c))
        refused = []
        for urls, words in BAD_HTTP:
            content = [{"type": "text", "text": "a <image> b"}] if "placeholder" in words else []
            content += [_image_part(u) for u in urls]
            r = await c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": content}]})
            refused.append((r.status_code, r.json()["error"]["message"]))
        health = (await c.get("/health")).status_code
        resp = await c.post("/v1/responses", json={"model": "tiny", "max_output_tokens": TOKENS, "temperature": 0.0,
                                                   "store": False, "input": [{"role": "user", "content": [
                                                       {"type": "input_text", "text": "Look: "},
                                                       {"type": "input_image", "image_url": _data_url(image(1))},
                                                       {"type": "input_text", "text": " what the cat sees"}]}]})
        return first, refused, health, await ask(openai_client(c)), resp.json()

    first, refused, health, again, resp = run_on(loop, app, go)
    assert first[0] == llm.tokenizer.decode(ref) and again == first
    # The Responses API's input_image: the same prompt (no ignore_eos there: its text may stop at EOS).
    assert resp["usage"]["input_tokens"] == first[1]
    assert first[0].startswith(resp["output"][0]["content"][0]["text"]) and resp["usage"]["output_tokens"] > 0
    assert first[1] == len(llm.tokenizer.encode(text, add_special_tokens=False)) + IMAGE_TOKENS - 1
    for (status, message), (_, words) in zip(refused, BAD_HTTP):
        assert status == 400 and words in message, (status, message, words)
    assert health == 200
    assert threads and threading.get_ident() not in threads  # the loop runs in this thread


def test_offline_bad_images_are_refused_naming_the_problem(llava, tiny_llama):
    """Each a ValueError before anything is queued (HTTP 400 at the server)."""
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.prepare import Frontend

    sp = SamplingParams(max_tokens=2)
    fe = Frontend(build_config(model=llava, limit_per_prompt=2, max_image_pixels=64 * 64), 520)
    bad = [
        ({"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [image(1)] * 3}}, "the limit is 2"),
        ({"prompt": "<image> and <image>", "multi_modal_data": {"image": image(1)}}, "2 image placeholder"),
        ({"prompt": "<image>", "multi_modal_data": {"image": image(1, (100, 50))}}, "max_image_pixels"),
        ({"prompt": "<image>", "multi_modal_data": {"image": b"\x89PNG"}}, "PIL.Image"),
        ({"prompt": "<image>", "multi_modal_data": {"video": [image(1)]}}, "only 'image'"),
    ]
    for prompt, words in bad:
        with pytest.raises(ValueError, match=words):
            fe.prepare(prompt, sp, "r")
    for url, words in [("https://example.com/a.png", "allowed_media_domains"),
                       ("data:image/png;base64,aGk=", "could not be decoded")]:
        with pytest.raises(ValueError, match=words):
            fe.chat_prompt([{"role": "user", "content": [_image_part(url)]}])
    small = Frontend(build_config(model=llava, max_num_encoder_input_tokens=16), 520)
    with pytest.raises(ValueError, match="25 encoder rows"):
        small.prepare({"prompt": "<image>", "multi_modal_data": {"image": image(1)}}, sp, "r")
    text_only = Frontend(build_config(model=tiny_llama), 512)
    with pytest.raises(ValueError, match="takes text only"):
        text_only.prepare({"prompt": "a", "multi_modal_data": {"image": image(1)}}, sp, "r")
    with pytest.raises(ValueError, match="takes text only"):
        text_only.chat_prompt([{"role": "user", "content": [_image_part(_data_url(image(1)))]}])


def test_tp2_matches_hf(llava, refs):
    """Two ranks (executor mp): the tower's heads and MLP and the projector
    split like the decoder's; every rank encodes the same pixels."""
    with LLM(model=llava, max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2,
             executor="mp") as llm:
        outs = llm.generate([_prompt(p, imgs) for p, imgs in CASES], GREEDY, use_tqdm=False)
    _check(outs, refs)


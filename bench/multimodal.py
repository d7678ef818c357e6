#!/usr/bin/env python3
"""Images through the encoder stage (docs/multimodal.md), offline, on a
random-weight LLaVA-shaped checkpoint built here: a CLIP tower of --vision-layers
layers over 224x224 images in 14-pixel patches (256 tokens an image), the
projector, and a Llama decoder of --layers layers.

Workloads (--requests requests, each a random text, one 640x480 image, more
text; greedy, --output tokens, ignore_eos):
  - distinct: every request its own image: the encoder runs once per request;
  - repeated: one image in every request (different texts): the encoder runs
    once, every other request hits the encoder cache.
Reported per workload: wall time, images/s, output tokens/s, encoder-cache
hits, and the frontend's preprocessing time per image (the checkpoint's
transformers image processor, the content hash and the copy). The tokens of
the repeated run are compared with one request run alone (they must be equal).
--served: the same two workloads over HTTP (one AsyncLLM behind uvicorn,
bench/lib/launch.py), every request at once, each image a JPEG data: URL in a
chat image_url part; with --vllm, `vllm serve` is up beside it and the two
take turns, --served-repeats rounds in alternating order, each round on
images of its own; the medians count. --vllm: both workloads through vLLM's CPU build on the
same checkpoint in its own process (bench/peers/vllm_mm_peer.py, the peer venv
with torchvision; see there), tokens compared. --hf: the distinct workload
through transformers' LlavaForConditionalGeneration.generate on the same
checkpoint (one batch, the image token expanded as its processor does), tokens
compared.

The checkpoint is written in the Hub's llava-hf layout (the tower under
"vision_tower.vision_model."): transformers 5.25 saves it without
"vision_model.", which vLLM 0.32's loader rejects; ours and transformers load both.

Usage:
  .venv/bin/python bench/multimodal.py --quick
  .venv/bin/python bench/multimodal.py --json bench/out/multimodal.json
  .venv/bin/python bench/multimodal.py --vllm --hf   # the peers (vLLM: see bench/peers/vllm_mm_peer.py)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
IMAGE_ID = 512  # "<image>", added to the tests' tiny tokenizer
BATCHED_TOKENS = 2048  # both engines' token budget per step (our default)
# torchvision for the vLLM peer, outside its venv (bench/peers/vllm_mm_peer.py):
# installed in the venv, it breaks the peer's other runs (`vllm bench serve` imports it).
PEER_TORCHVISION = os.environ.get("VLLM_PEER_TORCHVISION", "/tmp/vllmpeer_torchvision")


def build(path: str, layers: int, vision_layers: int) -> str:
    import torch
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as HF

    vision = CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=vision_layers,
                              num_attention_heads=6, image_size=224, patch_size=14, projection_dim=384)
    text = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=layers, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=2048,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05)
    torch.manual_seed(0)
    HF(LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID)).save_pretrained(path)
    hub_layout(os.path.join(path, "model.safetensors"))
    CLIPImageProcessorPil(size={"shortest_edge": 224},
                          crop_size={"height": 224, "width": 224}).save_pretrained(path)
    from tokenizers import AddedToken

    from conveyor.cluster.demo.model import build_tiny_tokenizer, save_tokenizer

    tok = build_tiny_tokenizer(512)
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    save_tokenizer(tok, path)
    return path


def hub_layout(file: str) -> None:
    """Rename the tower's tensors "vision_tower.X" -> "vision_tower.vision_model.X" in place."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    prefix = "vision_tower."
    save_file({prefix + "vision_model." + k[len(prefix):]
               if k.startswith(prefix) and not k.startswith(prefix + "vision_model.") else k: v
               for k, v in tensors.items()}, file, metadata={"format": "pt"})


def images(n: int, seed: int) -> list[Any]:
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(480, 640, 3) * 255).astype(np.uint8)) for _ in range(n)]


def prompts(n: int, imgs: list[Any], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(4, 512) for _ in range(32)] + [IMAGE_ID] + [rng.randrange(4, 512) for _ in range(16)]
        out.append({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs[i % len(imgs)]}})
    return out


def run(llm: Any, batch: list[dict[str, Any]], output: int) -> dict[str, Any]:
    from conveyor import SamplingParams

    sp = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    pre = llm.frontend.images
    s0, c0 = pre.seconds, pre.count
    h0 = llm.get_metrics()["conveyor_encoder_cache_hits_total"]
    t = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    return {"wall_s": round(wall, 3), "images_per_s": round(len(batch) / wall, 2),
            "output_tok_per_s": round(len(batch) * output / wall, 1),
            "encoder_cache_hits": int(llm.get_metrics()["conveyor_encoder_cache_hits_total"] - h0),
            "preprocess_ms_per_image": round((pre.seconds - s0) / max(pre.count - c0, 1) * 1e3, 2),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def _image_url(img: Any) -> str:
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def _wave(base: str, urls: list[str], reqs: int, output: int) -> float:
    """reqs chat requests at once, request i with image urls[i % len(urls)]: the wall time."""
    import asyncio

    import httpx

    def body(i: int) -> dict[str, Any]:
        content = [{"type": "text", "text": f"Picture {i}: what runs in the garden?"},
                   {"type": "image_url", "image_url": {"url": urls[i % len(urls)]}}]
        return {"model": "llava", "max_tokens": output, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "user", "content": content}]}

    async with httpx.AsyncClient(timeout=600) as c:
        t = time.perf_counter()
        rs = await asyncio.gather(*(c.post(f"{base}/v1/chat/completions", json=body(i)) for i in range(reqs)))
        wall = time.perf_counter() - t
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return wall


def _median_row(walls: list[float], reqs: int, output: int) -> dict[str, Any]:
    """A workload's waves: each wall, and the rates of their median."""
    import statistics

    mid = statistics.median(walls)
    return {"wall_s": round(mid, 3), "images_per_s": round(reqs / mid, 2),
            "output_tok_per_s": round(reqs * output / mid, 1), "waves_wall_s": [round(w, 3) for w in walls]}


def _cpu_busy(window_s: float) -> float:
    """The box's busy fraction (all cores) over the next ``window_s`` seconds."""
    def sample() -> list[int]:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]

    a = sample()
    time.sleep(window_s)
    d = [y - x for x, y in zip(a, sample())]
    return 1.0 - (d[3] + d[4]) / max(sum(d), 1)


def wait_idle(limit_s: float = 10.0) -> None:
    """Return once the box is idle (under 10% busy for 0.25 s), at most after ``limit_s``.
    vLLM's processes keep a core busy for about a second after a wave (its message
    queue polls): the next wave must not start on a box with one core taken."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and _cpu_busy(0.25) > 0.10:
        pass


def served_rounds(path: str, reqs: int, output: int, repeats: int, vllm: bool) -> dict[str, Any]:
    """Ours (one AsyncLLM behind uvicorn) and, with ``vllm``, `vllm serve`, both up at
    once. Each round runs the distinct and the repeated wave on every server, the
    servers in alternating order, on that round's own images (the same images for
    every server): the box's speed drifts between minutes, and alternation puts
    that drift on both sides. Each wave waits for an idle box (wait_idle). Per
    server and workload: the walls and their median."""
    import asyncio

    import httpx

    from bench.lib import launch

    def hits(base: str) -> int:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                       if ln.startswith("conveyor_encoder_cache_hits_total")))

    servers: dict[str, tuple[Any, Callable[[str], int] | None]] = {"served": (ours_server(path), hits)}
    if vllm:
        servers["served_vllm"] = (vllm_server(path), None)
    walls: dict[str, dict[str, list[float]]] = {k: {"distinct": [], "repeated": []} for k in servers}
    cache_hits: dict[str, list[int]] = {"distinct": [], "repeated": []}
    bases: dict[str, str] = {}
    try:
        for key, (server, _) in servers.items():
            bases[key] = launch.start(server, os.path.join(REPO, "bench", "out"), 300)
        warm = [_image_url(i) for i in images(reqs, 9)]
        for key in servers:  # a full wave each, once every server is up (the later start evicts pages)
            wait_idle()
            asyncio.run(_wave(bases[key], warm, reqs, output))
        for r in range(repeats):
            urls = {"distinct": [_image_url(i) for i in images(reqs, 100 + r)],
                    "repeated": [_image_url(i) for i in images(1, 200 + r)]}
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for key in order:
                count = servers[key][1]
                for name in ("distinct", "repeated"):
                    h0 = count(bases[key]) if count else 0
                    wait_idle()
                    walls[key][name].append(asyncio.run(_wave(bases[key], urls[name], reqs, output)))
                    if count:
                        cache_hits[name].append(count(bases[key]) - h0)
    finally:
        for server, _ in servers.values():
            launch.stop(server)
    out: dict[str, Any] = {}
    for key in servers:
        out[key] = {name: _median_row(w, reqs, output) for name, w in walls[key].items()}
    for name in ("distinct", "repeated"):
        out["served"][name]["encoder_cache_hits"] = cache_hits[name]
        if vllm:
            out["served_vllm"][name]["conveyor_vs_vllm"] = round(
                out["served"][name]["images_per_s"] / out["served_vllm"][name]["images_per_s"], 2)
    return out


def ours_server(path: str) -> Any:
    """One AsyncLLM behind uvicorn, the offline run's engine settings."""
    from bench.lib import launch

    return launch.uvicorn_engine(path, 18731, {"model": {"max_model_len": 1024},
                                               "cache": {"enable_prefix_caching": False},
                                               "scheduler": {"max_num_batched_tokens": BATCHED_TOKENS},
                                               "serve": {"served_model_name": "llava", "max_body_bytes": 8 << 20}})


def vllm_server(path: str) -> Any:
    """`vllm serve` of the peer venv on both cores, the same settings."""
    from bench.lib import launch

    server = launch.vllm_serve(path, 18732, "llava", 1024, 256, {**launch.peer_env(bind="0-1"), **peer_vision_env()})
    server.argv += ["--no-enable-prefix-caching", "--max-num-batched-tokens", str(BATCHED_TOKENS),
                    "--limit-mm-per-prompt", json.dumps({"image": 1})]
    return server


def hf_peer(path: str, reqs: int, output: int) -> dict[str, Any]:
    """The distinct workload in transformers (fp32, greedy, one batch): wall, rates, tokens."""
    import torch
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(path)
    per_image = (model.config.vision_config.image_size // model.config.vision_config.patch_size) ** 2
    batch = prompts(reqs, images(reqs, 1), 1)
    ids = []
    for b in batch:
        at = b["prompt_token_ids"].index(IMAGE_ID)
        toks = b["prompt_token_ids"]
        ids.append(toks[:at] + [IMAGE_ID] * per_image + toks[at + 1:])
    pixels = proc([b["multi_modal_data"]["image"] for b in batch], return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        model.generate(input_ids=input_ids[:2], pixel_values=pixels[:2], max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                             max_new_tokens=output, min_new_tokens=output, do_sample=False)
        wall = time.perf_counter() - t
    return {"wall_s": round(wall, 3), "images_per_s": round(reqs / wall, 2),
            "output_tok_per_s": round(reqs * output / wall, 1),
            "tokens": [row[input_ids.shape[1]:].tolist() for row in out]}


def peer_vision_env() -> dict[str, str]:
    """The peer's environment for a VL model: torchvision on its path, stubbed (peer_site)."""
    from bench.lib import launch

    return {"PEER_TORCHVISION_STUB": "1",
            "PYTHONPATH": os.pathsep.join([os.path.join(launch.PEERS, "peer_site"), PEER_TORCHVISION])}


def vllm_peer(path: str, reqs: int, output: int) -> dict[str, Any]:
    """Both workloads through vLLM's CPU build (bench/peers/vllm_mm_peer.py, the peer venv, 2 threads)."""
    import subprocess

    from bench.lib import launch

    env = {**os.environ, **launch.peer_env(bind="0-1"), **peer_vision_env()}
    cmd = [launch.peer_python(), os.path.join(launch.PEERS, "vllm_mm_peer.py"), path, "--requests", str(reqs),
           "--output", str(output), "--max-num-batched-tokens", str(BATCHED_TOKENS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"the vLLM peer failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def compare(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """Per workload: the peer's rates, its tokens against ours, and our ratio."""
    out = {}
    for key in ("distinct", "repeated"):
        row = dict(peer[key])
        row["same_tokens"] = sum(list(a) == b for a, b in zip(ours[key]["tokens"], row.pop("tokens")))
        row["conveyor_vs_vllm"] = round(ours[key]["images_per_s"] / row["images_per_s"], 2)
        out[key] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="4 requests, 8 tokens, 2+2 layers")
    ap.add_argument("--served", action="store_true", help="also over HTTP (uvicorn + AsyncLLM)")
    ap.add_argument("--served-repeats", type=int, default=3,
                    help="served rounds (each: both waves on every server, the order alternating); medians count")
    ap.add_argument("--vllm", action="store_true", help="both workloads through vLLM's CPU build, the peer row")
    ap.add_argument("--hf", action="store_true", help="transformers' generate on the distinct workload, the peer row")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.output, args.layers, args.vision_layers = 4, 8, 2, 2
    from conveyor import LLM

    with tempfile.TemporaryDirectory() as d:
        path = build(os.path.join(d, "llava"), args.layers, args.vision_layers)
        with LLM(model=path, max_model_len=1024, enable_prefix_caching=False,
                 max_num_batched_tokens=BATCHED_TOKENS) as llm:
            run(llm, prompts(2, images(2, 9), 9), 2)  # warm-up: kernels, the processor
            results = {"distinct": run(llm, prompts(args.requests, images(args.requests, 1), 1), args.output),
                       "repeated": run(llm, prompts(args.requests, images(1, 2), 2), args.output)}
            alone = run(llm, prompts(args.requests, images(1, 2), 2)[-1:], args.output)
        if args.served:
            results.update(served_rounds(path, args.requests, args.output, args.served_repeats, args.vllm))
        if args.vllm:
            results["vllm"] = compare(results, vllm_peer(path, args.requests, args.output))
        if args.hf:
            hf = hf_peer(path, args.requests, args.output)
            ours = results["distinct"]["tokens"]
            hf["same_tokens"] = sum(list(a) == b for a, b in zip(ours, hf.pop("tokens")))
            hf["conveyor_vs_transformers"] = round(results["distinct"]["images_per_s"] / hf["images_per_s"], 2)
            results["transformers"] = hf
    assert results["repeated"]["tokens"][-1] == alone["tokens"][0], "a cached image changed the tokens"
    for key in ("distinct", "repeated"):
        results[key].pop("tokens")
    results["config"] = vars(args)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

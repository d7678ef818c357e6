"""A tiny random LLaVA checkpoint with its tokenizer and image processor,
built on the spot (never downloaded), and transformers' greedy reference
through its own LlavaProcessor.

The tokenizer is the tests' tiny BPE one plus "<image>" as a special token
(id 512); the CLIP tower takes 30x30 images in 6x6 patches, so an image is
25 placeholder tokens (the CLS position dropped: strategy "default")."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from tokenizers import AddedToken

IMAGE = "<image>"
IMAGE_ID = 512
IMAGE_TOKENS = 25
PATCH = 6


def make_tiny_llava(path: str, seed: int = 0) -> str:
    from tiny_models import _randomize_defaults
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from conveyor.cluster.demo.model import build_tiny_tokenizer, save_tokenizer

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=30, patch_size=PATCH, projection_dim=32, hidden_act="quick_gelu")
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=520, max_position_embeddings=1024,
                       rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=3,
                       initializer_range=0.05)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
                         image_seq_length=IMAGE_TOKENS, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # CLIP's init is tiny: widen so an image moves the logits
        for name, p in model.named_parameters():
            if p.dim() > 1:  # the text model as tests/cpu/tiny_models.py's (std 0.05)
                vision = "vision_tower" in name or "linear_1" in name
                p.copy_((0.2 if vision else 0.05) * torch.randn_like(p))
    _randomize_defaults(model)
    model.save_pretrained(path)
    tok = build_tiny_tokenizer(512)
    tok.add_special_tokens([AddedToken(IMAGE, special=True, normalized=False)])
    assert tok.token_to_id(IMAGE) == IMAGE_ID
    save_tokenizer(tok, path)
    CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}).save_pretrained(path)
    return path


def image(seed: int, size: tuple[int, int] = (40, 32)):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype(np.uint8))


@lru_cache(maxsize=2)
def hf_llava(path: str):
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaForConditionalGeneration, LlavaProcessor

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = LlavaProcessor(image_processor=CLIPImageProcessorPil.from_pretrained(path),
                          tokenizer=AutoTokenizer.from_pretrained(path), patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return model, proc


def hf_generate(path: str, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy tokens (EOS ignored) and its top-5 ids at each."""
    model, proc = hf_llava(path)
    inputs = proc(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=3, output_scores=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    top5 = [set(s[0].topk(5).indices.tolist()) for s in out.scores]
    return out.sequences[0, n:].tolist(), top5


# ---- Qwen2.5-VL ---------------------------------------------------------------------------
# The tiny tokenizer plus Qwen's vision tokens (ids 512-515); 2x2-pixel patches, 2x2 merged
# into a token, windows of 8 pixels (2x2 tokens): a 20x30 image is 10x16 patches = 40 tokens.

QWEN_VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMAGE_ID = 514
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def make_tiny_qwen_vl(path: str, seed: int = 0) -> str:
    from tiny_models import _randomize_defaults
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from conveyor.cluster.demo.model import build_tiny_tokenizer, save_tokenizer

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=520, max_position_embeddings=1024, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=1, pad_token_id=3,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=8, out_hidden_size=64, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, vision_start_token_id=512,
                              vision_end_token_id=513, image_token_id=QWEN_IMAGE_ID, video_token_id=515)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_((0.2 if "visual" in name else 0.05) * torch.randn_like(p))
    _randomize_defaults(model)
    model.save_pretrained(path)
    tok = build_tiny_tokenizer(512)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_VISION])
    assert tok.token_to_id("<|image_pad|>") == QWEN_IMAGE_ID
    save_tokenizer(tok, path)
    Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=64,
                             max_pixels=4096).save_pretrained(path)
    return path


@lru_cache(maxsize=2)
def hf_qwen_vl(path: str):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, Qwen2VLImageProcessorPil.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def hf_generate_qwen(path: str, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy tokens and top-5s. Each <|image_pad|> becomes
    grid.prod() / 4 of them, Qwen2_5_VLProcessor's rule (its video half needs
    torchvision, which the tests do not install)."""
    model, proc, tok = hf_qwen_vl(path)
    kwargs: dict = {}
    ids = tok(prompt)["input_ids"]
    if images:
        px = proc(images=images, return_tensors="pt")
        grids = iter(px["image_grid_thw"].prod(-1).tolist())
        ids = [t for i in ids for t in ([i] * (next(grids) // 4) if i == QWEN_IMAGE_ID else [i])]
        kwargs = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}
    input_ids = torch.tensor([ids])
    kwargs["mm_token_type_ids"] = (input_ids == QWEN_IMAGE_ID).int()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=3, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
    top5 = [set(s[0].topk(5).indices.tolist()) for s in out.scores]
    return out.sequences[0, len(ids):].tolist(), top5

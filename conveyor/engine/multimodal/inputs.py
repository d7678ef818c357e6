"""A request's images, from PIL images to the features the core schedules.

`ImageInputs.for_model(config)` is None for a text-only model (an image is
then refused naming that), else it knows the model's placeholder token and
runs the checkpoint's own transformers image processor (resize, rescale,
normalise: the pixels transformers would give the model), one image at a
time, so images of any size mix. Every placeholder token of the prompt
becomes as many tokens as the image has encoder rows (LLaVA: patches, less
the CLS position with the "default" strategy; Qwen2.5-VL: the image's patch
grid over spatial_merge_size^2, its grid sent along), as transformers'
processor expands it. Refusals are `MultiModalInputError`s (HTTP 400) naming the
problem. Callers run this off the event loop and off the engine's step
thread (the server's prep pool; LLM.generate's own thread).
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.engine.multimodal.media import MediaError, MediaTooLarge, mm_hash


class MultiModalInputError(ValueError):
    """Images a request may not have (HTTP 400)."""


# model_type -> (the key of the placeholder token id in config.json, its default)
_FAMILIES: dict[str, tuple[str, int]] = {"llava": ("image_token_index", 32000),
                                         "qwen2_5_vl": ("image_token_id", 151655)}


def split_prompt(prompt: Any) -> tuple[Any, list[Any]]:
    """(the text or token ids, the images) of a prompt; a dict prompt is
    {"prompt": str} or {"prompt_token_ids": [...]}, with optional
    "multi_modal_data": {"image": image or [images]}."""
    if not isinstance(prompt, dict):
        return prompt, []
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise ValueError(f"a prompt dict takes prompt or prompt_token_ids and multi_modal_data, "
                         f"got {sorted(unknown)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of prompt and prompt_token_ids")
    body = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise MultiModalInputError(f"multi_modal_data takes only 'image', got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data.get("image")
    if images is None:
        return body, []
    return body, list(images) if isinstance(images, (list, tuple)) else [images]


class ImageInputs:
    def __init__(self, model_dir: str, hf: dict[str, Any], config: EngineConfig) -> None:
        key, default = _FAMILIES[hf["model_type"]]
        self.model_dir = model_dir
        self.image_token_id = int(hf.get(key, default))
        vision = hf.get("vision_config") or {}
        self.patch_size = int(vision.get("patch_size", 32))
        self.keep_cls = hf.get("vision_feature_select_strategy", "default") == "full"
        # Qwen2.5-VL: patch rows with a grid, merge^2 patches a token; the
        # placeholder sits between its vision start and end tokens.
        self.merge = int(vision.get("spatial_merge_size", 2)) if hf["model_type"] == "qwen2_5_vl" else 0
        self.placeholder_ids = ([int(hf.get("vision_start_token_id", 151652)), self.image_token_id,
                                 int(hf.get("vision_end_token_id", 151653))] if self.merge
                                else [self.image_token_id])
        mm = config.multimodal
        self.limit = mm.limit_per_prompt
        self.max_pixels = mm.max_image_pixels
        self.max_rows = min(mm.encoder_cache_tokens, config.scheduler.max_num_encoder_input_tokens)
        self._processor: Any = None
        self._lock = threading.Lock()
        self.seconds = 0.0  # preprocessing time, all images so far
        self.count = 0

    @classmethod
    def for_model(cls, config: EngineConfig) -> ImageInputs | None:
        path = os.path.join(config.model.path, "config.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
        return cls(config.model.path, hf, config) if hf.get("model_type") in _FAMILIES else None

    def processor(self) -> Any:
        with self._lock:
            if self._processor is None:
                from transformers import AutoImageProcessor

                self._processor = AutoImageProcessor.from_pretrained(self.model_dir)
            return self._processor

    def expand(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt with each placeholder token expanded, and one feature per image."""
        found = ids.count(self.image_token_id)
        if len(images) > self.limit:
            raise MultiModalInputError(f"{len(images)} images in one prompt; the limit is {self.limit} "
                                       "(multimodal.limit_per_prompt)")
        if found != len(images):
            raise MultiModalInputError(f"the prompt has {found} image placeholder token(s) "
                                       f"(id {self.image_token_id}) for {len(images)} image(s)")
        out: list[int] = []
        features: list[MultiModalFeature] = []
        it = iter(images)
        for t in ids:
            if t != self.image_token_id:
                out.append(t)
                continue
            f = self.feature(next(it), len(out))
            features.append(f)
            out.extend([t] * f.length)
        return out, features

    def feature(self, image: Any, offset: int) -> MultiModalFeature:
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise MultiModalInputError(f"an image must be a PIL.Image, got {type(image).__name__}")
        w, h = image.size
        if w * h > self.max_pixels:
            raise MediaTooLarge(f"image is {w}x{h} = {w * h} pixels; the limit is {self.max_pixels} "
                                "(multimodal.max_image_pixels)")
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        t0 = time.perf_counter()
        try:
            out = self.processor()(images=[rgb], return_tensors="np")
        except (ValueError, OSError) as e:
            raise MediaError(f"image could not be preprocessed: {e}") from e
        self.seconds += time.perf_counter() - t0
        self.count += 1
        grid: list[int] | None = None
        if self.merge:  # patch rows [t*h*w, C*T*P*P] and the grid
            pixels, grid = out["pixel_values"], [int(x) for x in out["image_grid_thw"][0]]
            rows = grid[0] * grid[1] * grid[2] // self.merge ** 2
        else:
            pixels = out["pixel_values"][0]
            _, ph, pw = pixels.shape
            rows = (ph // self.patch_size) * (pw // self.patch_size) + (1 if self.keep_cls else 0)
        if rows > self.max_rows:
            raise MultiModalInputError(f"an image takes {rows} encoder rows; the engine encodes at most "
                                       f"{self.max_rows} (scheduler.max_num_encoder_input_tokens, "
                                       "multimodal.encoder_cache_tokens)")
        return MultiModalFeature(mm_hash(rgb), offset, rows, pixels.astype("float32").tobytes(),
                                 list(pixels.shape), grid_thw=grid)

"""What a request carries for each image, from the frontend to the workers.

The frontend runs the model's image processor and sends, per image, its
content hash, where its placeholder tokens sit in the prompt, and the
processed pixels. The scheduler reads only `mm_hash`, `offset` and `length`
(the encoder budget, the encoder cache, the block hashes); the pixels travel
on to the workers, which run the encoder when the scheduler says so.
"""
from __future__ import annotations

import msgspec


class MultiModalFeature(msgspec.Struct, array_like=True, frozen=True, gc=False):
    mm_hash: str  # content hash of the decoded image (conveyor/engine/multimodal/media.py)
    # Prompt positions [offset, offset + length) are this image's placeholder
    # tokens; the encoder's output has exactly `length` rows, one per position.
    offset: int
    length: int
    data: bytes  # the processed pixels, C order
    shape: list[int]
    dtype: str = "float32"
    # Qwen2.5-VL: the image's (t, h, w) in patches (its pixels are patch rows).
    grid_thw: list[int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def overlapping(features: list[MultiModalFeature], start: int, end: int) -> list[MultiModalFeature]:
    """The features whose placeholders meet positions [start, end)."""
    return [f for f in features if f.offset < end and start < f.end]

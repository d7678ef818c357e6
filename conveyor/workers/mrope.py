"""M-RoPE positions of a prompt with images (transformers' Qwen2.5-VL
get_rope_index; conveyor/workers/models/qwen2_5_vl.py explains the scheme)."""
from __future__ import annotations

import numpy as np

from conveyor.engine.multimodal.features import MultiModalFeature


def mrope_positions(num_tokens: int, features: list[MultiModalFeature], merge: int) -> tuple[np.ndarray, int]:
    """([3, num_tokens] positions of a prompt, delta = the position after the
    prompt minus its length)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    pos = idx = 0
    for f in features:
        n = f.offset - idx  # text before the image
        out[:, idx:f.offset] = pos + np.arange(n)
        pos += n
        assert f.grid_thw is not None  # the frontend sets it for this family
        t, h, w = f.grid_thw[0], f.grid_thw[1] // merge, f.grid_thw[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, f.offset:f.end] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + pos
        pos += max(h, w)
        idx = f.end
    out[:, idx:] = pos + np.arange(num_tokens - idx)
    return out, int(out.max()) + 1 - num_tokens if num_tokens else 0

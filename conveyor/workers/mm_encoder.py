"""The workers' side of the encoder stage (vLLM V1's _execute_mm_encoder and
_gather_mm_embeddings).

The encoder cache maps mm_hash -> that image's encoder output [length,
hidden]; it changes only as the SchedulerOutput says: entries named in
`free_encoder_mm_hashes` go first, then the images of
`scheduled_encoder_inputs` are encoded (each distinct image once, by the
model's encode_images). The forward's input embeddings are the token
embeddings with each scheduled placeholder position replaced by its row of
the image's output, so a prefill chunk that cuts through an image reads the
rows of its part and the next chunk reads the rest from the cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from conveyor.engine.contracts import SchedulerOutput
from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.workers.mrope import mrope_positions

if TYPE_CHECKING:
    from conveyor.workers.input_batch import CachedRequestState


def pixels_of(f: MultiModalFeature, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    arr = np.frombuffer(f.data, dtype=np.dtype(f.dtype)).reshape(f.shape)
    return torch.from_numpy(arr.copy()).to(device=device, dtype=dtype)


class EncoderRunner:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.cache: dict[str, torch.Tensor] = {}
        # M-RoPE models: each image request's prompt positions [3, P] and delta.
        self.merge = model.vision.merge if getattr(model, "uses_mrope", False) else 0
        self._mrope: dict[str, tuple[np.ndarray, int]] = {}

    def free(self, mm_hashes: list[str]) -> None:
        for h in mm_hashes:
            self.cache.pop(h, None)

    def execute(self, so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
        """Encode the step's scheduled images into the cache."""
        todo: dict[str, MultiModalFeature] = {}
        for rid, inputs in so.scheduled_encoder_inputs.items():
            for i in inputs:
                f = requests[rid].mm_features[i]
                if f.mm_hash not in self.cache:
                    todo[f.mm_hash] = f
        if not todo:
            return
        feats = list(todo.values())
        out = self.model.encode_images([pixels_of(f, self.dtype, self.device) for f in feats], feats)
        for f, rows in zip(feats, out):
            if rows.shape[0] != f.length:
                raise RuntimeError(f"image {f.mm_hash[:12]}: the encoder gave {rows.shape[0]} rows "
                                   f"for {f.length} placeholder tokens")
            self.cache[f.mm_hash] = rows

    def gather(self, states: list[CachedRequestState], num_computed: np.ndarray, num_sched: np.ndarray,
               query_start: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat positions in the step, their rows) of every placeholder token
        scheduled this step; None when there is none."""
        index: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        for row, st in enumerate(states):
            if not st.mm_features:
                continue
            start = int(num_computed[row])
            end = start + int(num_sched[row])
            for f in st.mm_features:
                lo, hi = max(f.offset, start), min(f.end, end)
                if lo >= hi:
                    continue
                rows.append(self.cache[f.mm_hash][lo - f.offset:hi - f.offset])
                base = int(query_start[row]) - start
                index.append(np.arange(base + lo, base + hi, dtype=np.int64))
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(index)).to(self.device), torch.cat(rows)

    def forget(self, req_id: str) -> None:
        self._mrope.pop(req_id, None)

    def mrope(self, states: list[CachedRequestState], num_computed: np.ndarray, num_sched: np.ndarray,
              query_start: np.ndarray, positions: np.ndarray) -> torch.Tensor | None:
        """[3, T] positions of an M-RoPE model's step: a text row's (p, p, p);
        an image request's prompt positions from its table, later tokens at
        index + delta. None when no row has an image (the plain positions are
        the same)."""
        if not self.merge or not any(st.mm_features for st in states):
            return None
        out = np.broadcast_to(positions.astype(np.int64), (3, len(positions))).copy()
        for row, st in enumerate(states):
            if not st.mm_features:
                continue
            if st.req_id not in self._mrope:
                self._mrope[st.req_id] = mrope_positions(len(st.prompt_token_ids), st.mm_features, self.merge)
            table, delta = self._mrope[st.req_id]
            a, q0 = int(num_computed[row]), int(query_start[row])
            b, n_prompt = a + int(num_sched[row]), table.shape[1]
            if a < n_prompt:
                out[:, q0:q0 + min(b, n_prompt) - a] = table[:, a:min(b, n_prompt)]
            if b > n_prompt:
                first = max(a, n_prompt)
                out[:, q0 + first - a:q0 + b - a] = np.arange(first, b) + delta
        return torch.from_numpy(out).to(self.device)

    def inputs_embeds(self, requests: dict[str, CachedRequestState],
                      req_ids: list[str], num_computed: np.ndarray, num_sched: np.ndarray,
                      query_start: np.ndarray, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings with image rows in place (the images
        were encoded as the diff was applied); None when no placeholder token
        is scheduled (the model embeds the ids itself)."""
        got = self.gather([requests[r] for r in req_ids], num_computed, num_sched, query_start)
        if got is None:
            return None
        index, rows = got
        embeds = self.model.embed_input_ids(input_ids)
        return embeds.index_copy(0, index, rows.to(embeds.dtype))

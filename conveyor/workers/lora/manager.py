"""LoRAManager: wraps a model's projections and keeps max_loras adapters in
slots, filled and evicted least-recently-used, with up to max_cpu_loras
parsed adapters cached in host memory.

Every TP rank and PP stage sees the same sequence of steps, so each makes the
same slot choices without talking to the others. The scheduler never puts
more distinct adapters in a step than there are slots, so a step's adapters
always fit (evicting only adapters the step does not use).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open

from conveyor.engine.config import LoRAConfig
from conveyor.engine.lora import TARGET_MODULES, LoRARequest, ModelDims, check_adapter
from conveyor.workers.lora.layers import ColumnParallelLinearWithLoRA, LoRALinear, RowParallelLinearWithLoRA
from conveyor.workers.lora.mapping import LoRAMapping
from conveyor.workers.models.utils import PPMissingLayer

if TYPE_CHECKING:
    from conveyor.workers.models.llama import LlamaForCausalLM

# (layer, HF module) -> (lora_A [r, in], lora_B [out, r] * scale), full tensors on the host
AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def wrap_model(model: LlamaForCausalLM, num_slots: int, max_rank: int) -> dict[tuple[int, str], LoRALinear]:
    """Replace this stage's four projections per decoder layer with LoRA
    wrappers; returns them keyed by (layer index, our module name)."""
    from conveyor.workers.models.llama import LlamaMLP

    out: dict[tuple[int, str], LoRALinear] = {}
    for idx, layer in enumerate(model.model.layers):
        if isinstance(layer, PPMissingLayer):
            continue
        targets = [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
        if isinstance(layer._mlp, LlamaMLP):  # a mixture of experts takes no adapter (attention only)
            targets += [(layer._mlp, "gate_up_proj"), (layer._mlp, "down_proj")]
        for parent, name in targets:
            base = getattr(parent, name)
            cls = RowParallelLinearWithLoRA if name in ("o_proj", "down_proj") else ColumnParallelLinearWithLoRA
            wrapped = cls(base, num_slots, max_rank)
            setattr(parent, name, wrapped)
            out[(idx, name)] = wrapped
    return out


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, config: LoRAConfig, dims: ModelDims,
                 device: torch.device) -> None:
        self.config = config
        self.dims = dims
        self.device = device
        self.num_slots = config.max_loras
        self.layers = wrap_model(model, config.max_loras, config.max_lora_rank)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.free_slots = list(range(self.num_slots))
        self.cpu_cache: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.max_cpu = config.max_cpu_loras or config.max_loras
        self.dtype = next(iter(self.layers.values())).a_t.dtype if self.layers else torch.float32

    # ---- per step ----------------------------------------------------------------

    def step_mapping(self, req_loras: list[LoRARequest | None],
                     req_indices: np.ndarray) -> LoRAMapping | None:
        """Load the step's adapters into slots and map each token to its slot."""
        if all(lr is None for lr in req_loras):
            return None
        ids = {lr.lora_int_id: lr for lr in req_loras if lr is not None}
        if len(ids) > self.num_slots:
            raise RuntimeError(f"{len(ids)} adapters in one step, only {self.num_slots} slots")
        for lr in ids.values():
            self._activate(lr, set(ids))
        req_slots = np.array([-1 if lr is None else self.slot_of[lr.lora_int_id] for lr in req_loras],
                             dtype=np.int64)
        return LoRAMapping.build(req_slots[req_indices], self.num_slots, self.device)

    def _activate(self, lr: LoRARequest, in_step: set[int]) -> None:
        aid = lr.lora_int_id
        if aid in self.slot_of:
            self.slot_of.move_to_end(aid)
            return
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next(a for a in self.slot_of if a not in in_step)
            slot = self.slot_of.pop(victim)
        self._fill_slot(slot, self._weights(lr))
        self.slot_of[aid] = slot

    def remove(self, adapter_id: int) -> None:
        """Forget an adapter (unloaded): its slot frees, its host copy goes."""
        self.cpu_cache.pop(adapter_id, None)
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    # ---- weights -------------------------------------------------------------------

    def _weights(self, lr: LoRARequest) -> AdapterWeights:
        aid = lr.lora_int_id
        w = self.cpu_cache.get(aid)
        if w is None:
            w = self._read(lr.lora_path)
            self.cpu_cache[aid] = w
            while len(self.cpu_cache) > self.max_cpu:
                self.cpu_cache.popitem(last=False)
        else:
            self.cpu_cache.move_to_end(aid)
        return w

    def _read(self, path: str) -> AdapterWeights:
        spec = check_adapter(path, self.config.max_lora_rank, self.dims)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        with safe_open(f"{path}/adapter_model.safetensors", framework="pt", device="cpu") as f:
            for key, (layer, module, ab) in spec.tensors.items():
                pairs.setdefault((layer, module), {})[ab] = f.get_tensor(key).float()
        return {k: (v["A"], v["B"] * spec.scale) for k, v in pairs.items()}

    def _fill_slot(self, slot: int, weights: AdapterWeights) -> None:
        for each in self.layers.values():
            each.clear_slot(slot)
        for (layer, module), (a, b) in weights.items():
            _, ours, sub = TARGET_MODULES[module]
            wrapped = self.layers.get((layer, ours))
            if wrapped is None:
                continue  # a layer of another PP stage
            if isinstance(wrapped, RowParallelLinearWithLoRA):
                start, size = wrapped.a_cols()
                a = a[:, start:start + size]
            else:
                start, size = wrapped.b_rows(sub)
                b = b[start:start + size]
            wrapped.set_sub(slot, sub, a.to(self.device, self.dtype), b.to(self.device, self.dtype))

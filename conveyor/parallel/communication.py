"""Activations passed between pipeline stages, and their point-to-point transfer.

Wire protocol of one `send_tensor_dict` (both sides must agree, nothing is pickled):
  1. over the CPU (gloo) group: a 1-element int64 tensor = length L of the header;
  2. over the CPU group: the int64 header of length L (see `_encode_header`);
  3. over the device group: each non-empty tensor's data, in header order.
Peers are global ranks, as torch.distributed.send/recv expect.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import overload

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from conveyor.parallel import state

# Wire codes are indexes into this list: append only, never reorder.
_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]


class IntermediateTensors:
    """Named tensors a non-last PP stage hands to the next one
    (for our decoder models: "hidden_states" and "residual", each [T, hidden])."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    @overload
    def __getitem__(self, key: str) -> torch.Tensor: ...
    @overload
    def __getitem__(self, key: slice) -> IntermediateTensors: ...

    def __getitem__(self, key: str | slice) -> torch.Tensor | IntermediateTensors:
        # A slice cuts every tensor along the token dimension (e.g. to drop padding).
        if isinstance(key, slice):
            return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def keys(self):  # noqa: ANN201 - dict view
        return self.tensors.keys()

    def items(self):  # noqa: ANN201 - dict view
        return self.tensors.items()

    def to(self, device: torch.device | str) -> IntermediateTensors:
        return IntermediateTensors({k: v.to(device) for k, v in self.tensors.items()})

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"IntermediateTensors({shapes})"


def _encode_header(td: dict[str, torch.Tensor]) -> torch.Tensor:
    """[n, then per tensor: len(name), *utf8 bytes, dtype code, ndim, *shape]."""
    out: list[int] = [len(td)]
    for name, t in td.items():
        raw = name.encode("utf-8")
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send tensor {name!r} of dtype {t.dtype}")
        out += [len(raw), *raw, _DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(out, dtype=torch.int64)


def _decode_header(h: list[int]) -> list[tuple[str, torch.dtype, list[int]]]:
    specs: list[tuple[str, torch.dtype, list[int]]] = []
    pos = 1
    for _ in range(h[0]):
        n = h[pos]
        name = bytes(h[pos + 1:pos + 1 + n]).decode("utf-8")
        pos += 1 + n
        dtype, ndim = _DTYPES[h[pos]], h[pos + 1]
        shape = h[pos + 2:pos + 2 + ndim]
        pos += 2 + ndim
        specs.append((name, dtype, shape))
    return specs


def _as_dict(td: IntermediateTensors | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return td.tensors if isinstance(td, IntermediateTensors) else td


def send_tensor_dict(td: IntermediateTensors | dict[str, torch.Tensor], dst: int,
                     group: ProcessGroup | None = None,
                     cpu_group: ProcessGroup | None = None) -> None:
    """Send named tensors to global rank `dst` (default groups: this rank's PP groups).

    Blocking: returns once the transfers are handed to the backend; the
    matching `recv_tensor_dict(src)` must run on `dst`.
    """
    group = group or state.get_pp_group()
    cpu_group = cpu_group or state.get_pp_cpu_group()
    tensors = _as_dict(td)
    header = _encode_header(tensors)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64), dst, group=cpu_group)
    dist.send(header, dst, group=cpu_group)
    for t in tensors.values():
        if t.numel() > 0:  # the receiver knows the shape; nothing to move
            dist.send(t.contiguous(), dst, group=group)


def _group_device(group: ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def recv_tensor_dict(src: int, group: ProcessGroup | None = None,
                     cpu_group: ProcessGroup | None = None,
                     device: torch.device | None = None) -> IntermediateTensors:
    """Receive what `send_tensor_dict(..., dst=this rank)` sent from global rank `src`.

    Tensors land on `device` (default: the device group's device — the current
    CUDA device for nccl, CPU for gloo).
    """
    group = group or state.get_pp_group()
    cpu_group = cpu_group or state.get_pp_cpu_group()
    device = device or _group_device(group)
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src, group=cpu_group)
    header = torch.empty(int(length.item()), dtype=torch.int64)
    dist.recv(header, src, group=cpu_group)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in _decode_header(header.tolist()):
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel() > 0:
            dist.recv(t, src, group=group)
        out[name] = t
    return IntermediateTensors(out)

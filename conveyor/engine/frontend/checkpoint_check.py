"""A checkpoint directory checked before any worker loads it, so a broken
download is one line naming the file and the fix, not a worker traceback.

Reads only config.json and each safetensors header (8-byte length, JSON): the
tensor data is never touched, so the check costs milliseconds for any size.
"""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

from conveyor.engine.config import ConfigError

_INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own bound on the JSON header
# Sizes that must be positive integers when config.json has them.
_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "num_key_value_heads", "max_position_embeddings")
_FIX = "re-download or re-convert the checkpoint"


def check_checkpoint(model_dir: str, source: str = "<config>") -> None:
    """Raise ConfigError naming the first problem: config.json missing or not
    a JSON object, a size that is not a positive integer, no weights, or a
    safetensors file that is truncated or not safetensors at all."""
    where = f"{source}: model.path"
    cfg = _read_json(os.path.join(model_dir, "config.json"), where)
    for key in _POSITIVE:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"{where}: config.json: {key} must be a positive integer, got "
                              f"{json.dumps(v)}: fix config.json or {_FIX}")
    for path in _weight_files(model_dir, where):
        _check_safetensors(path, where)


def _read_json(path: str, where: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} not found: point model.path at a Hugging Face "
                          "checkpoint directory") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {path} is not valid JSON ({e}): {_FIX}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: {path} must hold a JSON object: {_FIX}")
    return obj


def _weight_files(model_dir: str, where: str) -> list[str]:
    index = os.path.join(model_dir, _INDEX)
    if os.path.exists(index):
        weight_map = _read_json(index, where).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{where}: {index}: no weight_map: {_FIX}")
        files = [os.path.join(model_dir, str(n)) for n in sorted(set(weight_map.values()))]
        for f in files:
            if not os.path.isfile(f):
                raise ConfigError(f"{where}: {f} (named by {_INDEX}) not found: {_FIX}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"{where}: no *.safetensors weights in {model_dir} (only safetensors "
                          "checkpoints are loaded; convert .bin weights with transformers' save_pretrained)")
    return files


def _check_safetensors(path: str, where: str) -> None:
    size = os.path.getsize(path)
    bad = f"{where}: {path} is not a complete safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{bad} ({size} bytes): {_FIX}")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ConfigError(f"{bad} (its header length {n} does not fit in {size} bytes): {_FIX}")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ConfigError(f"{bad} (its header is not JSON): {_FIX}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{bad} (its header is not a JSON object): {_FIX}")
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offs = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise ConfigError(f"{bad} (tensor {name!r} has no data_offsets): {_FIX}")
        end = max(end, offs[1])
    if 8 + n + end > size:
        raise ConfigError(f"{bad}: truncated ({size} bytes, its tensors need {8 + n + end}): {_FIX}")

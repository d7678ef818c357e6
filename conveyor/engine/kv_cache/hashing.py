"""Chained block hashes for prefix caching.

hash(block i) = sha256(msgpack((hash(block i-1), tokens of block i, extra keys))).
The salt, and the LoRA adapter's id when there is one (two adapters never
share KV), are mixed into block 0 only: every later block inherits them
through the chain. A block that holds image placeholder tokens also mixes in
those images' content hashes (mm_hash) with the offsets at which they start:
two images behind the same text never share a block, and, through the
chain, neither do the blocks after them; the same image at the same place
does. A text-only block's hash is unchanged. Hashes are stable across
processes and runs (no Python hash()).
"""
from __future__ import annotations

import hashlib

import msgspec

from conveyor.engine.core.request import Request
from conveyor.engine.multimodal.features import MultiModalFeature, overlapping

_enc = msgspec.msgpack.Encoder()


def hash_block(parent: bytes | None, tokens: list[int], extra: object = None) -> bytes:
    return hashlib.sha256(_enc.encode((parent, tokens, extra))).digest()


class BlockHasher:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def extend(self, request: Request) -> None:
        """Hash every block of `request` that became full since the last call."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes) * bs
        while start + bs <= len(tokens):
            parent = hashes[-1] if hashes else None
            extra = _first_block_extra(request) if start == 0 else None
            mm = getattr(request, "mm_features", None)  # stand-ins of a Request may lack it
            if mm:
                extra = mm_block_extra(extra, mm, start, start + bs)
            hashes.append(hash_block(parent, tokens[start:start + bs], extra))
            start += bs


def mm_block_extra(extra: object, features: list[MultiModalFeature], start: int, end: int) -> object:
    """A block's extra key with the images whose placeholders meet [start, end)."""
    images = [(f.mm_hash, f.offset) for f in overlapping(features, start, end)]
    return extra if not images else (extra, "mm", images)


def first_block_extra(cache_salt: str | None, lora_int_id: int | None) -> object:
    """Block 0's extra key; the router (conveyor/engine/dp/router/policy.py) hashes with it too.
    Without an adapter the key is the salt alone, as before LoRA existed."""
    return cache_salt if lora_int_id is None else (cache_salt, "lora", lora_int_id)


def _first_block_extra(request: Request) -> object:
    lr = request.lora_request
    return first_block_extra(request.cache_salt, None if lr is None else lr.lora_int_id)

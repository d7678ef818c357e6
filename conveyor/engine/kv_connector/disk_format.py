"""The disk tier's files and the model identity that names their folder.

One file per block: <root>/<model id>/<block key hex>.kvb, holding
b"CVKV", a little-endian u32 header length, a msgpack DiskHeader, then the
block's raw bytes (every layer of the block, as the worker lays it out).
Written to a temporary name and renamed, so a reader sees a whole file or
none; verified on every read (magic, header, key, model, size, crc32), so a
torn, truncated or foreign file is a miss, never KV. No pickle anywhere.
"""
from __future__ import annotations

import hashlib
import os
import threading
import zlib
from pathlib import Path

import msgspec

MAGIC = b"CVKV"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
_TMP = ".tmp"


class DiskHeader(msgspec.Struct, array_like=True, gc=False):
    version: int
    key: bytes
    model_id: str
    nbytes: int
    crc32: int


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(DiskHeader)


def weights_fingerprint(model_dir: str) -> str:
    """Names, sizes and the first and last 64 KiB of every weight file, plus
    config.json: cheap, and different for any two checkpoints in practice."""
    h = hashlib.sha256()
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")) + [root / "config.json"]
    for f in files:
        if not f.is_file():
            continue
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(1 << 16))
            fh.seek(max(size - (1 << 16), 0))
            h.update(fh.read(1 << 16))
    return h.hexdigest()


def model_identity(model_dir: str, kv_dtype: str, block_size: int, bytes_per_block: int,
                   tp_pp_rank: tuple[int, int, int]) -> str:
    """What a stored block's bytes depend on besides its token chain (the salt
    and the LoRA adapter are in the chain): the weights, the KV dtype and
    layout, the block size and the tensor/pipeline layout with this rank."""
    parts = (FORMAT_VERSION, weights_fingerprint(model_dir), kv_dtype, block_size, bytes_per_block,
             *tp_pp_rank)
    return hashlib.sha256(_enc.encode(parts)).hexdigest()[:32]


def block_path(folder: Path, key: bytes) -> Path:
    return folder / (key.hex() + SUFFIX)


def encode(key: bytes, model_id: str, payload: bytes | memoryview) -> bytes:
    header = _enc.encode(DiskHeader(FORMAT_VERSION, key, model_id, len(payload), zlib.crc32(payload)))
    return b"".join((MAGIC, len(header).to_bytes(4, "little"), header, bytes(payload)))


def decode(data: bytes, key: bytes, model_id: str, nbytes: int) -> bytes | None:
    """The payload, or None when anything about the file is wrong."""
    if len(data) < 8 or data[:4] != MAGIC:
        return None
    hlen = int.from_bytes(data[4:8], "little")
    try:
        hd = _dec.decode(data[8:8 + hlen])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    payload = data[8 + hlen:]
    if (hd.version != FORMAT_VERSION or hd.key != key or hd.model_id != model_id
            or hd.nbytes != nbytes or len(payload) != nbytes or zlib.crc32(payload) != hd.crc32):
        return None
    return payload


def write_atomic(folder: Path, key: bytes, data: bytes) -> None:
    path = block_path(folder, key)
    tmp = path.with_name(f"{path.name}{_TMP}{os.getpid()}.{threading.get_ident()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(folder: Path, key: bytes) -> bytes | None:
    try:
        return block_path(folder, key).read_bytes()
    except OSError:
        return None


def rank_folder(folder: Path, rank: int, world_size: int) -> Path:
    """Where one rank keeps its shard of each block: the folder itself on a
    one-rank engine, <folder>/rank<r> with several (same keys in each)."""
    return folder if world_size == 1 else folder / f"rank{rank}"


def scan_ranks(folder: Path, world_size: int) -> list[bytes]:
    """Keys whose shard every rank wrote, least recently written first (by rank 0's files)."""
    keys = scan(rank_folder(folder, 0, world_size))
    for r in range(1, world_size):
        held = set(scan(rank_folder(folder, r, world_size)))
        keys = [k for k in keys if k in held]
    return keys


def scan(folder: Path) -> list[bytes]:
    """Keys stored in folder, least recently written first; leftover
    temporary files (a writer died mid-file) are removed."""
    found: list[tuple[float, bytes]] = []
    if not folder.is_dir():
        return []
    for p in folder.iterdir():
        if _TMP in p.name:
            p.unlink(missing_ok=True)
            continue
        if p.suffix != SUFFIX:
            continue
        try:
            found.append((p.stat().st_mtime, bytes.fromhex(p.stem)))
        except (OSError, ValueError):
            continue
    return [k for _, k in sorted(found)]

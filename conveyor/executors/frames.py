"""Sealed frames: what one data-plane message is inside the CURVE session.

A message is three ZMQ frames: [header, mac, payload].

- header  = msgpack FrameHeader(direction, msg_type, sender, seq)
- mac     = HMAC-SHA256(mac_key, len(header) as 4 bytes || header || payload)
- payload = the msgpack message

CURVE already authenticates and encrypts each connection; the MAC binds a
frame to its route (direction and message type) and its sender's sequence
number, so a frame copied from one socket to another, or sent twice, is
recognised and dropped. Sequence numbers start at 1 and strictly increase per
(sender, route): a receiver accepts a frame only when its seq is above the last
one it accepted from that sender. Gaps are fine (a send that found no peer
consumed a number); going back is not.

A frame that fails any check is dropped and counted by reason, never raised:
a peer can at worst waste the receiver's time, not kill it.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
from collections import Counter
from typing import Any

import msgspec

log = logging.getLogger(__name__)

# Drop reasons, the keys of Opener.dropped.
MALFORMED = "malformed"  # not three frames, or a header that does not decode
BAD_MAC = "mac"
WRONG_DIRECTION = "direction"
WRONG_TYPE = "type"
REPLAYED = "replay"
UNDECODABLE = "decode"  # authentic header, payload not the route's message type


class Route(msgspec.Struct, frozen=True, array_like=True):
    """Which way a channel's messages go and what they are."""
    direction: str  # e.g. "executor->worker"
    msg_type: str  # e.g. "WorkerCommand"


class FrameHeader(msgspec.Struct, frozen=True, array_like=True):
    direction: str
    msg_type: str
    sender: str
    seq: int


_HEADER_DEC = msgspec.msgpack.Decoder(FrameHeader)
_ENC = msgspec.msgpack.Encoder()


def frame_mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    h = hmac.new(key, struct.pack(">I", len(header)), hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()


class Sealer:
    """Seals payloads for one sender on one route. `lock` (reentrant) guards
    the sequence number; a sender holds it across seal-then-send, or a later
    seq could overtake an earlier one on the wire and be taken for a replay."""

    def __init__(self, key: bytes, route: Route, sender: str) -> None:
        self._key = key
        self._route = route
        self._sender = sender
        self._seq = 0
        self.lock = threading.RLock()

    def seal(self, payload: bytes) -> list[bytes]:
        with self.lock:
            self._seq += 1
            seq = self._seq
        header = _ENC.encode(FrameHeader(self._route.direction, self._route.msg_type, self._sender, seq))
        return [header, frame_mac(self._key, header, payload), payload]


class Opener:
    """Checks and decodes frames arriving on one route (one receiving socket)."""

    def __init__(self, key: bytes, route: Route, recv_type: type, where: str = "") -> None:
        self._key = key
        self._route = route
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(recv_type)
        self._last_seq: dict[str, int] = {}
        self.where = where
        self.dropped: Counter[str] = Counter()

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def open(self, frames: list[bytes]) -> Any | None:
        """The message, or None when the frame was dropped (and counted)."""
        if len(frames) != 3:
            return self._drop(MALFORMED)
        header_bytes, mac, payload = frames
        if not hmac.compare_digest(bytes(mac), frame_mac(self._key, header_bytes, payload)):
            return self._drop(BAD_MAC)
        try:
            header = _HEADER_DEC.decode(header_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._drop(MALFORMED)
        if header.direction != self._route.direction:
            return self._drop(WRONG_DIRECTION)
        if header.msg_type != self._route.msg_type:
            return self._drop(WRONG_TYPE)
        if header.seq <= self._last_seq.get(header.sender, 0):
            return self._drop(REPLAYED)
        try:
            msg = self._dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._drop(UNDECODABLE)
        self._last_seq[header.sender] = header.seq
        return msg

    def _drop(self, reason: str) -> Any | None:  # always None: `return self._drop(...)` reads as one step
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n == 1 or n % 1000 == 0:  # a flood must not flood the log too
            log.warning("dropped a data-plane frame on %s (%s; %d so far)", self.where, reason, n)
        return None

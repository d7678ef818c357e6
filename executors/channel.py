"""Authenticated msgspec messages over ZMQ: the per-step data plane between an
executor and its workers (and between a frontend and an EngineCoreActor).

Every message is two frames: HMAC-SHA256(secret, payload) and the msgpack
payload. A message whose MAC does not verify is dropped and logged; nothing is
ever unpickled.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)


def sign(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


class AuthError(ValueError):
    pass


class Channel:
    """One ZMQ socket that sends and/or receives signed msgspec messages."""

    def __init__(self, ctx: zmq.Context, kind: int, secret: bytes, recv_type: type | None = None,
                 bind_host: str | None = None, connect: str | None = None) -> None:
        self.secret = secret
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind_host is not None:
            port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
            self.address = f"tcp://{bind_host}:{port}"
        elif connect is not None:
            self.sock.connect(connect)
            self.address = connect
        else:
            raise ValueError("bind_host or connect is required")
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None
        self.rejected = 0

    def send(self, msg: Any) -> None:
        self.send_bytes(self._enc.encode(msg))

    def send_bytes(self, payload: bytes) -> None:
        """Send an already-encoded payload (encode once, send to many)."""
        self.sock.send_multipart((sign(self.secret, payload), payload), copy=False)

    def try_send_bytes(self, payload: bytes, mac: bytes | None = None) -> bool:
        """Non-blocking send; False when no peer can take it now (none
        connected yet, a dead one, or a full queue). `mac` lets a broadcast
        to channels sharing the secret sign once."""
        try:
            self.sock.send_multipart((mac or sign(self.secret, payload), payload),
                                     flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def encode(self, msg: Any) -> bytes:
        return self._enc.encode(msg)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next authentic message, or None on timeout. Forged ones are dropped."""
        while True:
            if timeout_ms is not None and not self.poll(timeout_ms):
                return None
            frames = self.sock.recv_multipart()
            if len(frames) == 2 and hmac.compare_digest(frames[0], sign(self.secret, frames[1])):
                assert self._dec is not None
                return self._dec.decode(frames[1])
            self.rejected += 1
            log.warning("dropped a message that failed HMAC verification on %s", self.address)

    def close(self) -> None:
        self.sock.close(linger=0)

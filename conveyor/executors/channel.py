"""The data plane: authenticated, encrypted msgspec messages over ZMQ between an
executor and its workers, and between a frontend and an EngineCoreActor.

Two layers (DESIGN §5 asks that nothing unauthenticated be accepted):
- Transport: every socket speaks ZMQ CURVE (libsodium, shipped with pyzmq).
  The side that binds is the CURVE server and runs a ZAP authenticator that
  admits only the plane's client public key; a peer without the keys never
  completes the handshake, so it can neither take a message from a PUSH socket
  nor put one into a PULL socket, and nothing crosses the network in plaintext.
- Frames (conveyor/executors/frames.py): each message is MAC'd together with its route
  (direction, message type) and its sender's sequence number; a frame that is
  replayed, misrouted, truncated or undecodable is dropped and counted.

Keys (PlaneKeys) are generated per plane by whoever binds or starts the peers
and handed to the peers through process arguments or Ray actor arguments,
never over the plane itself. Nothing is ever unpickled.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from conveyor.executors.frames import Opener, Route, Sealer

log = logging.getLogger(__name__)


class PlaneKeys(msgspec.Struct, frozen=True):
    """The secrets of one data plane. Keys are Z85 CURVE keys (40 bytes)."""
    mac: bytes
    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes = b""  # only the binding side holds it

    @classmethod
    def generate(cls) -> PlaneKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(os.urandom(32), server_public, client_public, client_secret, server_secret)

    def for_clients(self) -> PlaneKeys:
        """What a connecting peer gets: everything but the server's secret key."""
        return msgspec.structs.replace(self, server_secret=b"")


class _AllowedClients:
    """ZAP credentials provider: admits exactly the plane's client key."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.denied = 0

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if z85_key in self.allowed:
            return True
        self.denied += 1
        if self.denied == 1 or self.denied % 1000 == 0:  # peers retry every 100 ms
            log.warning("refused a data-plane handshake from an unknown CURVE key (%d so far)", self.denied)
        return False


class Channel:
    """One CURVE socket that either sends (PUSH, with a Sealer) or receives
    (PULL, with an Opener) sealed msgspec messages."""

    def __init__(self, sock: zmq.Socket, address: str, sealer: Sealer | None = None,
                 opener: Opener | None = None) -> None:
        self.sock = sock
        self.address = address
        self._sealer = sealer
        self._opener = opener
        # Channels sharing a sealer share its lock: seal-then-send stays in
        # seq order on every socket (and a ZMQ socket is not thread-safe).
        self._lock = sealer.lock if sealer is not None else threading.RLock()
        self._enc = msgspec.msgpack.Encoder()
        self.closed = False

    # ---- sending ---------------------------------------------------------------------

    def encode(self, msg: Any) -> bytes:
        return self._enc.encode(msg)

    def send(self, msg: Any) -> None:
        assert self._sealer is not None, "a receive-only channel cannot send"
        payload = self._enc.encode(msg)
        with self._lock:
            self._send_frames(self._sealer.seal(payload), 0)

    def try_send_payload(self, payload: bytes) -> bool:
        """Seal and send without blocking; False when no peer can take it now
        (none connected yet, a dead one, or a full queue)."""
        assert self._sealer is not None, "a receive-only channel cannot send"
        with self._lock:
            return self._try(self._sealer.seal(payload))

    def try_send_frames(self, frames: list[bytes]) -> bool:
        """Send frames sealed by this channel's sealer (a broadcast seals once)."""
        with self._lock:
            return self._try(frames)

    def _try(self, frames: list[bytes]) -> bool:
        try:
            self._send_frames(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _send_frames(self, frames: list[bytes], flags: int) -> None:
        self.sock.send_multipart(frames, flags=flags, copy=False)

    # ---- receiving -------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next authentic message, or None on timeout. Bad frames are
        dropped and counted (see `dropped`), never raised."""
        assert self._opener is not None, "a send-only channel cannot receive"
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            if deadline is not None:
                left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not self.poll(left_ms):
                    return None
            msg = self._opener.open(self.sock.recv_multipart())
            if msg is not None:
                return msg

    @property
    def dropped(self) -> dict[str, int]:
        """Dropped frames by reason (conveyor.executors.frames); empty for a sender."""
        return dict(self._opener.dropped) if self._opener is not None else {}

    @property
    def dropped_total(self) -> int:
        return self._opener.dropped_total if self._opener is not None else 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close(linger=0)


class DataPlane:
    """One process's end of a data plane: a zmq.Context whose sockets all use
    CURVE with one PlaneKeys. The server side (it binds) authenticates peers."""

    def __init__(self, keys: PlaneKeys, server: bool) -> None:
        if server and not keys.server_secret:
            raise ValueError("the binding side of a data plane needs the server secret key")
        self.keys = keys
        self.server = server
        self.ctx = zmq.Context()
        self._channels: list[Channel] = []
        self._auth: ThreadAuthenticator | None = None
        self._allowed = _AllowedClients({keys.client_public})
        if server:  # the ZAP handler must run before any peer can connect
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", self._allowed)

    @property
    def denied(self) -> int:
        """Handshakes refused because the peer's CURVE key is not the plane's."""
        return self._allowed.denied

    def sealer(self, route: Route, sender: str) -> Sealer:
        return Sealer(self.keys.mac, route, sender)

    def push(self, sealer: Sealer, bind_host: str | None = None, connect: str | None = None) -> Channel:
        sock, address = self._socket(zmq.PUSH, bind_host, connect)
        return self._track(Channel(sock, address, sealer=sealer))

    def pull(self, route: Route, recv_type: type, bind_host: str | None = None,
             connect: str | None = None) -> Channel:
        sock, address = self._socket(zmq.PULL, bind_host, connect)
        return self._track(Channel(sock, address, opener=Opener(self.keys.mac, route, recv_type, address)))

    def _track(self, ch: Channel) -> Channel:
        self._channels.append(ch)
        return ch

    def _socket(self, kind: int, bind_host: str | None, connect: str | None) -> tuple[zmq.Socket, str]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.server:
            sock.curve_secretkey = self.keys.server_secret
            sock.curve_publickey = self.keys.server_public
            sock.curve_server = True
        else:
            sock.curve_secretkey = self.keys.client_secret
            sock.curve_publickey = self.keys.client_public
            sock.curve_serverkey = self.keys.server_public
        if bind_host is not None:
            port = sock.bind_to_random_port(f"tcp://{bind_host}")
            return sock, f"tcp://{bind_host}:{port}"
        if connect is not None:
            sock.connect(connect)
            return sock, connect
        sock.close(linger=0)
        raise ValueError("bind_host or connect is required")

    def close(self) -> None:
        """Close every channel, stop the authenticator, end the context."""
        for ch in self._channels:
            ch.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()

"""A free TCP port: for torch.distributed rendezvous and for local servers.

Ports come from below the kernel's ephemeral range. A port taken from that range
(bind to 0) can be handed to any outbound connection opened before the caller
binds it: Ray's start-up opens dozens, and one took a demo's HTTP port in CI.
Ports below the range are only ever taken by an explicit bind.
"""
from __future__ import annotations

import random
import socket

# Ray's worker ports are 10002-19999 by default; stay above them.
_LOW = 20000
_TRIES = 64
_RNG = random.SystemRandom()  # not the global generator: tests seed it alike in every worker


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now ("" = every interface). Another process may
    still bind it before the caller does: callers that can retry do."""
    high = _ephemeral_low()
    if high - _LOW > 1000:
        for _ in range(_TRIES):
            port = _RNG.randrange(_LOW, high)
            if port_free(host, port):
                return port
    with socket.socket() as s:  # a crowded or odd range: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]

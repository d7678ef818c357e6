"""A free TCP port: for torch.distributed rendezvous and for local servers."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now ("" = every interface). Another process may
    take it before the caller binds it: callers that can retry do."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

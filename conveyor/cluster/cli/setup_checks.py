"""What `conveyor serve` / `generate` check before any Ray or worker work,
so a setup mistake is one line naming the problem and the fix (exit code 2)
instead of a deploy that fails a minute later or a worker traceback."""
from __future__ import annotations

import errno
import os
import socket

from conveyor.engine.config import ConfigError, EngineConfig, check_model_dir
from conveyor.engine.frontend.checkpoint_check import check_checkpoint


def check_engine_setup(config: EngineConfig, source: str) -> None:
    """The checkpoint directory exists and its config.json and weights are sane."""
    check_model_dir(config, source)
    if config.model.path:
        check_checkpoint(config.model.path, source)


def check_serve_setup(config: EngineConfig, source: str, binds_port: bool) -> None:
    """The API key's variable is set here (the replicas of a local cluster
    inherit this environment) and, when this process starts Serve's proxy,
    serve.port is free on serve.host."""
    env = config.serve.api_key_env
    if env and not os.environ.get(env):
        raise ConfigError(f"{source}: serve.api_key_env names {env!r}, which is not set (or empty) "
                          f"in this environment: export {env}=<key> before `conveyor serve`, or drop "
                          "serve.api_key_env to serve without a key")
    if binds_port:
        check_port_free(config.serve.host, config.serve.port, source)
    check_engine_setup(config, source)


def check_port_free(host: str, port: int, source: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"{source}: serve.port {port} on {host} is already in use: stop what "
                                  "holds it or pick another port (--port / serve.port)") from None
            raise ConfigError(f"{source}: serve.host {host!r}, port {port}: cannot bind ({e.strerror}): "
                              "use an address of this machine") from None

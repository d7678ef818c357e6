"""free_port hands out ports that outbound connections cannot take first."""
from __future__ import annotations

import socket

from conveyor.parallel import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    low = ports._ephemeral_low()
    got = {ports.free_port() for _ in range(20)}
    assert all(ports._LOW <= p < low for p in got), (sorted(got), low)
    assert len(got) > 1  # drawn at random, not one fixed port every process would race for
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out(monkeypatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    real = ports._RNG.randrange
    draws = [0]

    def taken_first(a: int, b: int) -> int:  # the held port three times, then real draws
        draws[0] += 1
        return taken if draws[0] <= 3 else real(a, b)

    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 60000)
    monkeypatch.setattr(ports._RNG, "randrange", taken_first)
    try:
        assert ports.free_port() != taken
        assert draws[0] >= 4
    finally:
        held.close()

"""The data plane against a foreign peer: every ZMQ socket is CURVE-encrypted
and admits only the engine's own key, and a frame that is replayed, misrouted,
truncated or undecodable is dropped and counted, never fatal.

Unit tests of the channel layer first, then TP=2 engines on executor `mp` and
`ray` with foreign PULL/PUSH sockets on every port their processes bind and an
insider (holding the client key) that sends garbage and replayed frames."""
from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
import ray
import zmq
from llm_utils import make_checkpoint, random_prompts
from zmq.utils.monitor import recv_monitor_message

from conveyor.cluster.engine_actor.actor import TO_CORE, TO_FRONTEND, CoreInput
from conveyor.engine import LLM, SamplingParams
from conveyor.executors import frames as fr
from conveyor.executors.channel import DataPlane, PlaneKeys
from conveyor.executors.frames import Route, Sealer
from conveyor.executors.messages import TO_EXECUTOR, TO_WORKERS, WorkerReply, rank_sender

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH}
HANDSHAKE_DONE = HANDSHAKE_FAILED | {zmq.EVENT_HANDSHAKE_SUCCEEDED}
ENC = msgspec.msgpack.Encoder()


def wait_until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for a counter another thread or process updates."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class ForeignPeers:
    """A peer without the engine's keys: for every address a PULL and a PUSH
    socket without CURVE and a PULL and a PUSH with a CURVE key of its own."""

    def __init__(self, addresses: list[str], server_public: bytes | None) -> None:
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []
        for addr in addresses:
            for kind in (zmq.PULL, zmq.PUSH):
                for curve in (False, True):
                    s = self.ctx.socket(kind)
                    s.setsockopt(zmq.LINGER, 0)
                    if curve:
                        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
                        s.curve_serverkey = server_public or zmq.curve_keypair()[0]
                    self._monitors.append(s.get_monitor_socket())
                    s.connect(addr)
                    self.socks.append(s)

    def first_handshakes(self, timeout_ms: int = 20000) -> list[int]:
        """The first handshake outcome of every socket (an event, not a sleep)."""
        out = []
        for mon in self._monitors:
            while True:
                assert mon.poll(timeout_ms), "no handshake outcome"
                ev = recv_monitor_message(mon)["event"]
                if ev in HANDSHAKE_DONE:
                    out.append(ev)
                    break
        return out

    def send_all(self, frame_lists: list[list[bytes]]) -> None:
        for s in self.socks:
            if s.socket_type == zmq.PUSH:
                for frames in frame_lists:
                    try:
                        s.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # no handshake completed: nowhere to send

    def received(self) -> int:
        n = 0
        for s in self.socks:
            while s.socket_type == zmq.PULL and s.poll(0):
                s.recv_multipart()
                n += 1
        return n

    def close(self) -> None:
        for s in (*self._monitors, *self.socks):
            s.close(linger=0)
        self.ctx.term()


def insider_push(keys: PlaneKeys, address: str) -> tuple[DataPlane, zmq.Socket]:
    """A CURVE client holding the plane's client key; the test sends raw
    frames on its socket (its sealer is never used)."""
    plane = DataPlane(keys.for_clients(), server=False)
    ch = plane.push(plane.sealer(Route("raw", "raw"), "insider"), connect=address)
    return plane, ch.sock


def bad_frames(key: bytes, route: Route, wrong: Route, replay_sender: str
               ) -> tuple[list[list[bytes]], dict[str, int]]:
    """Garbage, truncated, forged-MAC, wrong-route, replayed and undecodable
    frames for a receiver on `route`, with the drop counts they must cause."""
    payload = ENC.encode({"not": "a message"})
    other = Sealer(key, Route(route.direction, wrong.msg_type), "intruder")
    frames = [
        [b"\x00garbage"],  # one frame
        Sealer(key, route, "intruder").seal(payload)[:2],  # truncated
        [b"h", b"m" * 32, payload],  # forged MAC
        Sealer(b"x" * 32, route, "intruder").seal(payload),  # another engine's key
        Sealer(key, wrong, "intruder").seal(payload),  # wrong direction
        other.seal(payload),  # wrong message type
        Sealer(key, route, replay_sender).seal(payload),  # seq 1 again: a replay
        Sealer(key, route, "intruder").seal(b"\xc1"),  # authentic, undecodable
    ]
    return frames, {fr.MALFORMED: 2, fr.BAD_MAC: 2, fr.WRONG_DIRECTION: 1, fr.WRONG_TYPE: 1,
                    fr.REPLAYED: 1, fr.UNDECODABLE: 1}


# ---- the channel layer ---------------------------------------------------------------------


@pytest.fixture()
def plane_pair():
    keys = PlaneKeys.generate()
    server = DataPlane(keys, server=True)
    client = DataPlane(keys.for_clients(), server=False)
    yield keys, server, client
    client.close()
    server.close()


def _tap(ch, captured: list[list[bytes]]):
    """Copy every frame list the channel sends into `captured`; returns the undo."""
    send = ch._send_frames

    def tapped(frames, flags):
        send(frames, flags)
        captured.append(list(frames))
    ch._send_frames = tapped
    return lambda: delattr(ch, "_send_frames")


def test_bad_frames_are_dropped_and_counted(plane_pair):
    keys, server, client = plane_pair
    rx = server.pull(TO_EXECUTOR, WorkerReply, bind_host="127.0.0.1")
    tx = client.push(client.sealer(TO_EXECUTOR, rank_sender(0)), connect=rx.address)
    captured: list[list[bytes]] = []
    _tap(tx, captured)
    tx.send(WorkerReply(0, 1))
    assert rx.recv(timeout_ms=10000) == WorkerReply(0, 1)
    frames, expected = bad_frames(keys.mac, TO_EXECUTOR, TO_WORKERS, rank_sender(0))
    frames[6] = captured[0]  # the replay: the real frame, captured on the way out
    for f in frames:
        tx.sock.send_multipart(f)  # one connection: delivered in order
    tx.send(WorkerReply(0, 2))
    assert rx.recv(timeout_ms=10000) == WorkerReply(0, 2)
    assert rx.dropped == expected
    assert rx.recv(timeout_ms=50) is None


def test_broadcast_seq_shared_across_ranks(plane_pair):
    """A command sealed once for every rank: each rank takes it once, and a
    frame copied from one rank's socket to another's is a replay there."""
    keys, server, client = plane_pair
    sealer = server.sealer(TO_WORKERS, "executor")
    tx = [server.push(sealer, bind_host="127.0.0.1") for _ in range(2)]
    rx = [client.pull(TO_WORKERS, dict, connect=t.address) for t in tx]
    sent = sealer.seal(ENC.encode({"step": 1}))
    for t in tx:
        t.sock.send_multipart(sent)  # blocks until that rank's handshake is done
    tx[1].sock.send_multipart(sent)  # rank 0's frame, copied onto rank 1's socket
    tx[1].send({"step": 2})
    assert rx[0].recv(timeout_ms=10000) == {"step": 1}
    assert [rx[1].recv(timeout_ms=10000) for _ in range(2)] == [{"step": 1}, {"step": 2}]
    assert rx[1].dropped == {fr.REPLAYED: 1} and rx[0].dropped == {}


def test_unknown_peers_never_complete_a_handshake(plane_pair):
    keys, server, client = plane_pair
    out = server.push(server.sealer(TO_FRONTEND, "core"), bind_host="127.0.0.1")
    inp = server.pull(TO_CORE, CoreInput, bind_host="127.0.0.1")
    foreign = ForeignPeers([out.address, inp.address], keys.server_public)
    try:
        assert set(foreign.first_handshakes()) <= HANDSHAKE_FAILED
        foreign.send_all([[b"garbage"], [b"a", b"b", b"c"]])
        good = client.pull(TO_FRONTEND, dict, connect=out.address)
        for i in range(8):
            out.send({"i": i})  # PUSH round-robins over completed handshakes only
        assert [good.recv(timeout_ms=10000) for _ in range(8)] == [{"i": i} for i in range(8)]
        assert foreign.received() == 0
        assert inp.recv(timeout_ms=50) is None and inp.dropped_total == 0
        assert server.denied >= 2  # the CURVE clients with keys of their own
    finally:
        foreign.close()


def test_client_half_of_the_keys_cannot_serve():
    with pytest.raises(ValueError, match="server secret"):
        DataPlane(PlaneKeys.generate().for_clients(), server=True)


# ---- whole engines ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("qwen2", str(tmp_path_factory.mktemp("dps") / "m"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 1, 40, seed=5)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _attack(addresses: list[str], server_public: bytes | None, replays: list[list[bytes]]
            ) -> ForeignPeers:
    foreign = ForeignPeers(addresses, server_public)
    outcomes = foreign.first_handshakes()
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in outcomes, "a foreign peer completed a handshake"
    foreign.send_all([[b"\x00garbage"], [b"a", b"b", b"c"], *replays])
    return foreign


def test_mp_engine_survives_foreign_peers(ckpt, prompts):
    llm = LLM(model=ckpt, executor="mp", tensor_parallel_size=2, enable_prefix_caching=False)
    foreign = plane = None
    try:
        ex = llm.engine.executor
        captured: list[list[bytes]] = []
        untap = _tap(ex._cmds[0], captured)  # real step commands, to replay
        clean = _generate(llm, prompts)
        untap()
        addresses = ex.listen_addresses()
        assert len(addresses) == 3  # replies + one command socket per rank
        foreign = _attack(addresses, ex.keys.server_public, captured[:4])
        # An insider on the reply socket: commands replayed there, garbage,
        # a replay of rank 0's first reply, misrouted and undecodable frames.
        plane, sock = insider_push(ex.keys, addresses[0])
        frames, expected = bad_frames(ex.keys.mac, TO_EXECUTOR, TO_WORKERS, rank_sender(0))
        for f in frames + captured[:4]:
            sock.send_multipart(f)
        expected[fr.WRONG_DIRECTION] += 4
        wait_until(lambda: sum(v for k, v in ex.data_plane_stats().items()
                               if k != "denied_handshakes") >= sum(expected.values()))
        assert _generate(llm, prompts) == clean
        stats = ex.data_plane_stats()
        assert foreign.received() == 0
        assert {k: v for k, v in stats.items() if k != "denied_handshakes"} == expected
        assert stats["denied_handshakes"] >= len(addresses)
        llm.engine.executor.check_health()
    finally:
        for p in (foreign, plane):
            if p is not None:
                p.close()
        llm.shutdown()


def test_ray_engine_survives_foreign_peers(ray_local, ckpt, prompts):
    llm = LLM(model=ckpt, executor="ray", tensor_parallel_size=2, enable_prefix_caching=False)
    foreign = foreign_exec = foreign_front = plane = None
    try:
        client = llm.engine.client
        captured: list[list[bytes]] = []
        untap = _tap(client.link.inp, captured)  # real "add" inputs, to replay
        clean = _generate(llm, prompts)
        untap()
        # An attached frontend (an ingress replica of conveyor/cluster/engine_pool.py):
        # its channel pair, on a plane of its own, is probed like the rest.
        front_keys = PlaneKeys.generate()
        _, front_in, front_out, _ = ray.get(client.actor.attach.remote(msgspec.msgpack.encode(front_keys)))
        addresses = ray.get(client.actor.listen_addresses.remote())
        # actor in/out, executor replies + 2 commands, the attached frontend's in/out
        assert len(addresses) == 7 and addresses[5:] == [front_in, front_out]
        # The actor's plane with its real server key (ZAP refuses the client
        # key); the executor's inside the actor with a wrong one; the attached
        # frontend's plane with its real server key.
        foreign = _attack(addresses[:2], client.keys.server_public, captured)
        foreign_exec = _attack(addresses[2:5], None, captured)
        foreign_front = _attack(addresses[5:], front_keys.server_public, captured)
        plane, sock = insider_push(client.keys, addresses[0])
        frames, expected = bad_frames(client.keys.mac, TO_CORE, TO_FRONTEND, "frontend")
        for f in frames + captured:  # every captured add, replayed
            sock.send_multipart(f)
        expected[fr.REPLAYED] += len(captured)

        def dropped() -> dict[str, int]:
            stats = ray.get(client.actor.data_plane_stats.remote())
            return {k[3:]: v for k, v in stats.items() if k.startswith("in_")}

        wait_until(lambda: sum(dropped().values()) >= sum(expected.values()))
        assert _generate(llm, prompts) == clean
        assert foreign.received() == 0 and foreign_exec.received() == 0 and foreign_front.received() == 0
        assert dropped() == expected
        stats = ray.get(client.actor.data_plane_stats.remote())
        assert stats["denied_handshakes"] >= 2 and stats["frontends_denied_handshakes"] >= 2
        assert not any(k.startswith("executor_") and k != "executor_denied_handshakes" for k in stats)
        llm.engine.client.check_health()
    finally:
        for p in (foreign, foreign_exec, foreign_front, plane):
            if p is not None:
                p.close()
        llm.shutdown()

"""The frontends of one EngineCoreActor: the one that started it, and the
ingress replicas attached later (conveyor/cluster/engine_pool.py).

Frontend 0 is the actor's own input/output channel pair, made at start-up
with the keys its starter generated. Each attached frontend brings keys of its
own (generated in that frontend, handed over through Ray) and gets a channel
pair on a plane of its own: its own CURVE server key and client key, its own
MAC key, so no frontend can read or forge another's traffic.

Outputs are routed back by owner: a request belongs to the frontend whose
channel added it (frontend 0 when none is recorded); the rest of a message
(scheduler stats, the router's KV events, an engine error) goes to every
frontend, so each ingress replica's router indexes the blocks cached through
any of them. With no attached frontend nothing here runs: `send` is the
channel's own blocking send, as before.

Threads: `recv` runs on the actor's input thread only, `send` on its step
thread only, `attach`/`detach` on Ray's call threads: the frontend list is
replaced whole (copy on write) and each socket is used by one thread.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from conveyor.engine.contracts import EngineCoreOutputs
from conveyor.executors.channel import Channel, DataPlane, PlaneKeys
from conveyor.executors.frames import Route

log = logging.getLogger(__name__)


@dataclass
class Frontend:
    fid: int
    inp: Channel
    out: Channel
    plane: DataPlane | None = None  # None for frontend 0 (the actor owns its plane)
    dropped: int = 0  # outputs it could not take (gone, or its queue full)


class Frontends:
    def __init__(self, inp: Channel, out: Channel, routes: tuple[Route, Route], in_type: type) -> None:
        self._routes, self._in_type = routes, in_type  # (to core, to frontend)
        self._list: tuple[Frontend, ...] = (Frontend(0, inp, out),)
        self._lock = threading.Lock()  # attach/detach against each other
        self._next = 1
        self.owner: dict[str, int] = {}  # request id -> attached frontend (absent: 0)
        self._poller: tuple[tuple[Frontend, ...], zmq.Poller] | None = None
        self._planes: list[DataPlane] = []  # every attached plane, closed with the actor

    # ---- attach / detach (Ray call threads) -----------------------------------------

    def attach(self, keys_bytes: bytes, host: str) -> tuple[int, str, str]:
        """A new frontend with its own plane keys: (its id, input address, output address)."""
        keys = msgspec.msgpack.decode(keys_bytes, type=PlaneKeys)
        plane = DataPlane(keys, server=True)
        to_core, to_front = self._routes
        inp = plane.pull(to_core, self._in_type, bind_host=host)
        out = plane.push(plane.sealer(to_front, "core"), bind_host=host)
        with self._lock:
            fid, self._next = self._next, self._next + 1
            self._list = self._list + (Frontend(fid, inp, out, plane),)
            self._planes.append(plane)
        log.info("frontend %d attached", fid)
        return fid, inp.address, out.address

    def detach(self, fid: int) -> list[str]:
        """Stop serving frontend fid; returns the ids of the requests it still
        owned (the caller aborts them). Its sockets close with the actor."""
        with self._lock:
            self._list = tuple(f for f in self._list if f.fid != fid)
        ids = [rid for rid, f in list(self.owner.items()) if f == fid]
        for rid in ids:
            self.owner.pop(rid, None)
        return ids

    @property
    def attached(self) -> int:
        return len(self._list) - 1

    def listen_addresses(self) -> list[str]:
        """The sockets each attached frontend's plane binds (input, output)."""
        return [a for f in self._list[1:] for a in (f.inp.address, f.out.address)]

    def plane_stats(self) -> dict[str, int]:
        """Over the attached frontends: frames their inputs dropped (by
        reason) and handshakes their planes refused."""
        stats: dict[str, int] = {"denied_handshakes": 0}
        for f in self._list[1:]:
            for k, v in f.inp.dropped.items():
                stats[k] = stats.get(k, 0) + v
            if f.plane is not None:
                stats["denied_handshakes"] += f.plane.denied
        return stats

    # ---- inputs (the actor's input thread) -----------------------------------------------

    def recv(self, timeout_ms: int) -> Any | None:
        """The next input from any frontend (None on timeout). An add records
        its owner before the core sees it; an abort forgets it."""
        fronts = self._list
        if len(fronts) == 1:
            return fronts[0].inp.recv(timeout_ms=timeout_ms)
        if self._poller is None or self._poller[0] is not fronts:
            poller = zmq.Poller()
            for f in fronts:
                poller.register(f.inp.sock, zmq.POLLIN)
            self._poller = (fronts, poller)
        ready = dict(self._poller[1].poll(timeout_ms))
        for f in fronts:
            if f.inp.sock in ready:
                msg = f.inp.recv(timeout_ms=0)
                if msg is not None:
                    self._note(f.fid, msg)
                    return msg
        return None

    def _note(self, fid: int, msg: Any) -> None:
        if msg.kind == "add" and msg.request is not None and fid:
            self.owner[msg.request.request_id] = fid
        elif msg.kind == "abort":
            for rid in msg.request_ids:
                self.owner.pop(rid, None)

    # ---- outputs (the actor's step thread) -----------------------------------------------

    def send(self, outs: EngineCoreOutputs) -> None:
        fronts = self._list
        if len(fronts) == 1 and not self.owner:
            fronts[0].out.send(outs)
            return
        by_front: dict[int, list] = {}
        owner = self.owner
        for o in outs.outputs:
            f = owner.get(o.request_id, 0)
            by_front.setdefault(f, []).append(o)
            if o.finished:
                owner.pop(o.request_id, None)
        shared = outs.scheduler_stats is not None or outs.kv_events is not None or outs.engine_error
        for f in fronts:
            mine = by_front.get(f.fid, [])
            if not mine and not shared:
                continue
            part = msgspec.structs.replace(outs, outputs=mine)
            if f.fid == 0:
                f.out.send(part)  # the starter's channel: as before (it blocks)
            elif not f.out.try_send_payload(f.out.encode(part)):
                # Never block the engine on one frontend (gone, or far behind):
                # KV events it misses show as a gap (it asks for a snapshot).
                f.dropped += 1
                if f.dropped == 1 or f.dropped % 1000 == 0:
                    log.warning("frontend %d did not take %d outputs", f.fid, f.dropped)

    def close(self) -> None:
        with self._lock:
            self._list = self._list[:1]
            planes, self._planes = self._planes, []
        for plane in planes:
            plane.close()

"""An EngineCoreActor's frontends (conveyor/cluster/engine_actor/frontends.py), without Ray: each
request's outputs go back to the frontend that added it, stats and KV events
to every frontend, an attached frontend that cannot take a message never
blocks the engine, and a detached one's requests are handed back for abort."""
from __future__ import annotations

import msgspec

from conveyor.cluster.engine_actor.actor import TO_CORE, TO_FRONTEND, CoreInput
from conveyor.cluster.engine_actor.frontends import Frontend, Frontends
from conveyor.engine.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from conveyor.engine.dp.router.events import KVEvents
from conveyor.engine.sampling_params import SamplingParams


class _Out:
    def __init__(self, full: bool = False) -> None:
        self.got: list[EngineCoreOutputs] = []
        self.full = full

    def send(self, outs: EngineCoreOutputs) -> None:
        self.got.append(outs)

    def encode(self, outs: EngineCoreOutputs) -> bytes:
        return msgspec.msgpack.encode(outs)

    def try_send_payload(self, payload: bytes) -> bool:
        if self.full:
            return False
        self.got.append(msgspec.msgpack.decode(payload, type=EngineCoreOutputs))
        return True


def _add(rid: str) -> CoreInput:
    return CoreInput("add", EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                              sampling_params=SamplingParams(max_tokens=4)))


def test_outputs_go_to_their_frontend_and_events_to_all() -> None:
    outs = [_Out(), _Out(), _Out(full=True)]
    fr = Frontends(None, outs[0], (TO_CORE, TO_FRONTEND), CoreInput)  # type: ignore[arg-type]
    one = EngineCoreOutputs([EngineCoreOutput("a", [5])])
    fr.send(one)
    assert outs[0].got == [one]  # one frontend: sent as is
    fr._list += tuple(Frontend(i, None, o) for i, o in ((1, outs[1]), (2, outs[2])))  # type: ignore[arg-type]
    fr._note(1, _add("b"))
    fr._note(2, _add("c"))
    ev = KVEvents(epoch=3, seq=1, stored=[b"h"])
    fr.send(EngineCoreOutputs([EngineCoreOutput("a", [6]), EngineCoreOutput("b", [7], FinishReason.LENGTH),
                               EngineCoreOutput("c", [8])], kv_events=ev))
    assert [o.request_id for o in outs[0].got[-1].outputs] == ["a"]
    assert [o.request_id for o in outs[1].got[-1].outputs] == ["b"]
    assert all(f.got[-1].kv_events == ev for f in outs[:2])
    assert fr._list[2].dropped == 1  # never blocked on the full one
    assert "b" not in fr.owner and fr.owner == {"c": 2}  # finished: forgotten
    fr.send(EngineCoreOutputs([EngineCoreOutput("a", [9])]))
    assert len(outs[1].got) == 1  # nothing of its own, no shared part: nothing sent
    fr._note(1, _add("d"))
    fr._note(1, CoreInput("abort", request_ids=["d"]))  # an abort forgets its owner
    assert fr.detach(2) == ["c"] and fr.attached == 1 and fr.owner == {}

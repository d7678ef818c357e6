"""The engine core in a Ray actor: actor.py (EngineCoreActor), link.py (one
actor's sockets and lifecycle), client.py (RayCoreClient: the frontend's side,
with recovery), cpu_layout.py (frontend/engine CPU split)."""
from conveyor.cluster.engine_actor.actor import EngineCoreActor

__all__ = ["EngineCoreActor"]

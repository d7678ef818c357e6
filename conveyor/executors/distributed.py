"""Driver side of a multi-rank executor: one CURVE-encrypted ZMQ command
socket per worker, one reply socket (conveyor/executors/channel.py), a receiver thread that resolves step futures in
order and turns any worker error or death into EngineDeadError.

Subclasses start the workers (processes or Ray actors) and say whether they
are alive; everything per step goes over ZMQ, never a per-worker RPC.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from abc import abstractmethod
from concurrent.futures import Future
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import KVCacheInfo, ModelRunnerOutput, SchedulerOutput
from conveyor.executors.base import EngineDeadError, Executor
from conveyor.executors.channel import DataPlane, PlaneKeys
from conveyor.executors.messages import EXECUTOR_SENDER, TO_EXECUTOR, TO_WORKERS, WorkerCommand, WorkerReply
from conveyor.executors.worker_proc import WorkerSpec
from conveyor.parallel.ports import free_port

log = logging.getLogger(__name__)


class DistributedExecutor(Executor):
    rpc_timeout_s = 600.0  # model loading can be slow

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1",
                 worker_class: str = "conveyor.workers.worker:Worker") -> None:
        self.config = config
        self.worker_class = worker_class
        self.world_size = config.world_size
        self.max_concurrent_batches = config.parallel.pipeline_parallel_size
        # This engine's data-plane keys; workers get the client half.
        self.keys = PlaneKeys.generate()
        self._plane = DataPlane(self.keys, server=True)
        self._replies = self._plane.pull(TO_EXECUTOR, WorkerReply, bind_host=host)
        # One sealer for all ranks: a command is sealed once, and each rank
        # sees the same strictly increasing sequence numbers.
        self._cmd_sealer = self._plane.sealer(TO_WORKERS, EXECUTOR_SENDER)
        self._cmds = [self._plane.push(self._cmd_sealer, bind_host=host) for _ in range(self.world_size)]
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._step_futures: dict[int, Future] = {}
        # step id -> time.monotonic() by which its reply must be back.
        self._deadlines: dict[int, float] = {}
        self._step_timeout_s = config.parallel.step_timeout_s
        self._first_step_extra_s: float | None = config.parallel.first_step_extra_s
        self._rpc_replies: dict[int, list[WorkerReply]] = {}
        self._rpc_done = threading.Condition(self._lock)
        self._last_step: Future | None = None
        self._last_step_id = 0
        self._dead: str | None = None
        # The rank a failure was traced to (a subclass sets it), for the logs.
        self.failed_rank: int | None = None
        self._closing = False
        self._receiver: threading.Thread | None = None

    # ---- subclass hooks ----------------------------------------------------------

    @abstractmethod
    def _start_workers(self) -> None:
        """Start world_size workers running run_worker_loop (see _specs)."""

    @abstractmethod
    def _dead_workers(self) -> str | None:
        """A message naming dead workers, or None while all are alive."""

    @abstractmethod
    def _stop_workers(self) -> None: ...

    def rank_location(self, rank: int) -> str:
        """Where a rank runs, for the logs (node and pid)."""
        return f"node {socket.gethostname()} (local), pid {self._local_pids().get(rank, '?')}"

    def _local_pids(self) -> dict[int, int]:
        """rank -> pid of the ranks on this machine (their /proc is readable)."""
        return dict(enumerate(self.worker_process_ids()))

    def _init_method(self) -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    def _specs(self, init_method: str | None = None, local_ranks: list[int] | None = None,
               parent_pid: int | None = None) -> list[WorkerSpec]:
        init = init_method or self._init_method()
        local = local_ranks or list(range(self.world_size))
        return [WorkerSpec(rank, local[rank], init, self._cmds[rank].address, self._replies.address,
                           self.keys.for_clients(), parent_pid, self.worker_class) for rank in range(self.world_size)]

    # ---- start-up ------------------------------------------------------------------

    def initialize(self) -> KVCacheInfo:
        check_parallel_sizes(self.config)
        self._start_workers()
        self._receiver = threading.Thread(target=self._receive_loop, name="conveyor-replies", daemon=True)
        self._receiver.start()
        self._rpc("init_device")
        self._rpc("load_model")
        num_blocks = min(_value(r) for r in self._rpc("determine_num_blocks"))
        self._rpc("initialize_cache", num_blocks)
        infos = [r.kv_info for r in self._rpc("kv_info", num_blocks) if r.kv_info is not None]
        return infos[(self.config.parallel.pipeline_parallel_size - 1) * self.config.parallel.tensor_parallel_size]

    def _rpc(self, method: str, *args: int) -> list[WorkerReply]:
        """Run a Worker method on every rank; replies ordered by rank."""
        sid = next(self._ids)
        with self._lock:
            self._rpc_replies[sid] = []
        self._broadcast(WorkerCommand("rpc", sid, method=method, args=list(args)),
                        timeout_s=self.rpc_timeout_s)
        deadline = time.monotonic() + self.rpc_timeout_s
        with self._rpc_done:
            while len(self._rpc_replies[sid]) < self.world_size:
                if self._dead is not None:
                    raise EngineDeadError(f"{method} failed: {self._dead}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineDeadError(f"{method} timed out after {self.rpc_timeout_s:.0f}s")
                self._rpc_done.wait(timeout=min(left, 0.5))
            replies = self._rpc_replies.pop(sid)
        return sorted(replies, key=lambda r: r.rank)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        out = []
        for r in self._rpc(method, *args):
            out.append(r.value if r.value is not None else r.floats if r.floats is not None else r.kv_info)
        return out

    # ---- per step --------------------------------------------------------------------

    def _broadcast(self, cmd: WorkerCommand, timeout_s: float | None = None) -> None:
        """timeout_s: how long a rank may take to accept (default the step
        bound; start-up RPCs wait for workers that are still starting)."""
        payload = self._cmds[0].encode(cmd)
        timeout_s = self._step_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cmd_sealer.lock:  # seal once; every rank gets it in seq order
            frames = self._cmd_sealer.seal(payload)
            for rank, ch in enumerate(self._cmds):
                # A PUSH socket blocks while its worker is not connected (starting
                # up, or dead): wait, but give up as soon as the engine is dead
                # or the rank has not taken a command for step_timeout_s.
                while not ch.try_send_frames(frames):
                    if self._closing:
                        return
                    if self._dead is not None:
                        raise EngineDeadError(self._dead)
                    if time.monotonic() > deadline:
                        self._fail(f"rank {rank} took no command for {timeout_s:g}s: it is wedged, "
                                   f"treated as dead (parallel.step_timeout_s bounds a step)")
                        raise EngineDeadError(self._dead)
                    time.sleep(0.0005)

    def _step_deadline(self, forward: bool) -> float:
        """The first forward step also gets first_step_extra_s (lazy compiles)."""
        extra = 0.0
        if forward and self._first_step_extra_s is not None:
            extra, self._first_step_extra_s = self._first_step_extra_s, None
        return time.monotonic() + self._step_timeout_s + extra

    def _overdue_step(self) -> str | None:
        """A message naming the oldest step past its deadline, or None."""
        now = time.monotonic()
        with self._lock:
            late = [sid for sid, t in self._deadlines.items() if t < now]
        if not late:
            return None
        stopped = [r for r, pid in self._local_pids().items() if process_stopped(pid)]
        if stopped:
            self.failed_rank = stopped[0]
        which = f"rank {', '.join(map(str, stopped))} is stopped" if stopped else "a worker rank is wedged"
        return (f"step {min(late)} got no reply within its {self._step_timeout_s:g}s bound "
                f"(parallel.step_timeout_s): {which}, treated as dead")

    def execute_model(self, so: SchedulerOutput, non_block: bool = False
                      ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        sid = next(self._ids)
        fut: Future = Future()
        with self._lock:
            self._step_futures[sid] = fut
            self._deadlines[sid] = self._step_deadline(so.total_num_scheduled_tokens > 0)
        self._last_step = fut
        self._last_step_id = sid
        self._broadcast(WorkerCommand("step", sid, scheduler_output=so))
        if so.total_num_scheduled_tokens == 0:
            return fut if non_block else fut.result()
        return fut if non_block else None

    def sample_tokens(self, grammar_output: Any = None, non_block: bool = False
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        fut = self._last_step
        if fut is None:
            raise RuntimeError("sample_tokens() without execute_model()")
        if grammar_output is not None:  # the ranks of a structured step wait for it
            self._broadcast(WorkerCommand("grammar", self._last_step_id, grammar_output=grammar_output))
        return fut if non_block else fut.result()

    # ---- replies and failures ------------------------------------------------------------

    def _receive_loop(self) -> None:
        try:
            while not self._closing:
                reply = self._replies.recv(timeout_ms=200)
                if reply is None:
                    dead = self._dead_workers() or self._overdue_step()
                    if dead is not None and not self._closing:
                        self._fail(dead)
                        return
                    continue
                self._route(reply)
        except Exception as e:  # noqa: BLE001
            if not self._closing:
                self._fail(f"reply channel failed: {e!r}")

    def _route(self, reply: WorkerReply) -> None:
        if reply.error is not None:
            self._fail(self._cause_of(reply.rank, reply.error))
            return
        with self._lock:
            fut = self._step_futures.pop(reply.step_id, None)
            self._deadlines.pop(reply.step_id, None)
            if fut is None and reply.step_id in self._rpc_replies:
                self._rpc_replies[reply.step_id].append(reply)
                self._rpc_done.notify_all()
                return
        if fut is not None:
            fut.set_result(reply.output)

    def _cause_of(self, rank: int, error: str, wait_s: float = 1.0) -> str:
        """A rank's error is often the echo of a peer's death (a collective's
        connection reset): the dead peer, if one shows within wait_s, is the
        cause; else the rank that raised is."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = self._dead_workers()
            if dead is not None:
                first = error.strip().splitlines()[0][:200] if error.strip() else ""
                return f"{dead}; rank {rank} failed after it ({first})"
            if time.monotonic() > deadline or self._closing:
                self.failed_rank = rank
                return error
            time.sleep(0.05)

    def _fail(self, message: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = message
                if not self._closing:
                    log.error("engine failed: %s", message)
            futs = list(self._step_futures.values())
            self._step_futures.clear()
            self._deadlines.clear()
            self._rpc_done.notify_all()
        for f in futs:
            if not f.done():
                f.set_exception(EngineDeadError(message))

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        dead = self._dead_workers() or self._overdue_step()
        if dead is not None:
            self._fail(dead)
            raise EngineDeadError(dead)

    @property
    def failure(self) -> str | None:
        return None if self._closing else self._dead

    def describe_failure(self) -> str:
        rank = self.failed_rank
        where = f"rank {rank} on {self.rank_location(rank)}" if rank is not None else "an unknown rank"
        return f"{where}: {self._dead or 'no failure seen'}"

    def listen_addresses(self) -> list[str]:
        """Every ZMQ endpoint this executor binds (the reply socket first)."""
        return [self._replies.address, *(ch.address for ch in self._cmds)]

    def data_plane_stats(self) -> dict[str, int]:
        """Frames dropped on the reply socket (by reason) and refused handshakes."""
        return {**self._replies.dropped, "denied_handshakes": self._plane.denied}

    def shutdown(self) -> None:
        if self._closing:
            return
        payload = self._cmds[0].encode(WorkerCommand("shutdown"))
        self._closing = True  # a broadcast waiting for a peer gives up now
        with self._cmd_sealer.lock:
            frames = self._cmd_sealer.seal(payload)
            for ch in self._cmds:
                ch.try_send_frames(frames)
        self._stop_workers()
        self._fail(self._dead or "engine shut down")
        if self._receiver is not None:
            self._receiver.join(timeout=5)
        self._plane.close()


def process_stopped(pid: int) -> bool:
    """True when a local process is stopped (SIGSTOP, a debugger): alive but
    never going to answer. False when unknown (not local, gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def check_parallel_sizes(config: EngineConfig) -> None:
    """Fail before any process starts when the model cannot be split this way."""
    import json

    path = os.path.join(config.model.path, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        hf = json.load(f)
    hf = hf.get("text_config", hf)
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads", heads)
    layers = hf.get("num_hidden_layers")
    if heads and heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp})")
    if kv and kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another")
    if layers and pp > layers:
        raise ValueError(f"pipeline_parallel_size ({pp}) is larger than num_hidden_layers ({layers})")


def _value(reply: WorkerReply) -> int:
    """The int a value-returning RPC answered (a reply without one is a protocol error)."""
    if reply.value is None:
        raise RuntimeError(f"worker rank {reply.rank} answered without a value")
    return reply.value

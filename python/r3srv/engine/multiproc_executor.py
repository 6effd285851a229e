"""Tensor and expert parallelism over worker processes, one rank per device.

Rank 0 is the engine's own process (vLLM's in-process driver worker): it holds its shard of
the model, schedules, samples and captures the routed experts, so tokens and rows need no
hop back. Ranks 1..N-1 are worker processes that hold their shards and follow rank 0's
commands (`StepChannel`: one broadcast per step). Every rank runs the same forward, with the
parallel layers' collectives (one all-reduce per row-parallel layer, the LM head's gather).

`MultiprocExecutor` stands where the loaded model stands at one device (the same methods:
forward, init_kv_cache, free_kv_cache, move_weights, ...), so the engine drives N ranks as it
drives one model. At tensor_parallel_size 1 none of this runs: no process, no hop.

Faults: a worker that exits (an exception, a kill) is seen by a monitor thread within a
poll; the executor then fails every later call, stops the other workers and calls its
`on_failure` callbacks (the server answers /health with 503 and exits non-zero). Workers
die with their parent (PR_SET_PDEATHSIG), so a killed server leaves no orphans. A worker that
fails while starting sends its error to rank 0 before it exits, and rank 0 joins the process
group while watching this node's workers: the executor then fails at once with that error,
instead of waiting for a rank that will never come.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from r3srv import settings
from r3srv.engine.step_channel import Command, StepChannel, decode_text, encode_text, pack_batch, unpack_batch
from r3srv.engine.weight_sync import WeightSync, WeightSyncError, run_weight_command, settle_weight_command
from r3srv.errors import ConfigError, R3srvError
from r3srv.heap import freeze_startup_heap
from r3srv.models.batch import ForwardBatch
from r3srv.models.parallel import ParallelState

if TYPE_CHECKING:
    from r3srv.models.loader import NamedTensors

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_RENDEZVOUS_TIMEOUT = timedelta(minutes=10)


class WorkerError(R3srvError, RuntimeError):
    """A tensor-parallel rank failed: the model can no longer run (the server answers 503).

    Its message names the lost rank and nothing of the transport's internals (gloo's and NCCL's
    texts stay in the server's log): it reaches the clients of the requests in flight."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (torch.distributed's TCP rendezvous) and which of them run here."""

    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node only)
    nnodes: int = 1
    node_rank: int = 0
    enable_expert_parallel: bool = False
    ep_dispatch: str = "all_reduce"  # rank 0's setting, carried to every rank (they must agree)

    @property
    def local_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        first = self.node_rank * self.local_size
        return range(first, first + self.local_size)

    def state(self, rank: int) -> ParallelState:
        ep = self.world_size if self.enable_expert_parallel else 1
        return ParallelState(tp_rank=rank, tp_size=self.world_size, ep_rank=rank if ep > 1 else 0, ep_size=ep,
                             ep_dispatch=self.ep_dispatch)


@dataclass(frozen=True)
class ModelSpec:
    """What every rank loads: the checkpoint, the device kind and the dtype."""

    path: str | None
    device: str  # "cpu", "cuda" or "cuda:N" (the first of the node's devices)
    dtype: str  # "auto" or a dtype name
    batch_invariant: bool = False  # the engine's --batch-invariant: every rank's ops chosen for it


def rank_setup(config) -> tuple[ModelSpec, Rendezvous]:
    """An EngineConfig's model and rendezvous, as every rank needs them."""
    par = config.parallel
    rendezvous = Rendezvous(par.tensor_parallel_size, par.master_addr, par.master_port, par.nnodes, par.node_rank,
                            par.enable_expert_parallel, settings.current().ep_dispatch)
    device = config.device if config.device.startswith("cuda") else "cpu"
    return ModelSpec(config.model, device, config.dtype, config.batch_invariant), rendezvous


def rank_device(device: str, rank: int, rendezvous: Rendezvous) -> torch.device:
    """A rank's device: cuda:(first + local rank) where `device` is cuda:first (cuda: from 0)."""
    if device.startswith("cuda"):
        return torch.device("cuda", (torch.device(device).index or 0) + rank % rendezvous.local_size)
    return torch.device("cpu")


def host_store(rendezvous: Rendezvous) -> tuple[Rendezvous, dist.TCPStore]:
    """Rank 0's rendezvous store, listening before any worker learns its port.

    With no --master-port the store binds port 0 itself: a port picked, freed and bound again
    later could be taken meanwhile by another process (EADDRINUSE while the workers start)."""
    if not rendezvous.master_port and rendezvous.nnodes > 1:
        raise ConfigError("--master-port is required with --nnodes > 1 (every node must name the same port)")
    store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size, is_master=True,
                          timeout=_RENDEZVOUS_TIMEOUT, wait_for_workers=False)
    return replace(rendezvous, master_port=store.port), store


def init_process_group(rank: int, rendezvous: Rendezvous, device: torch.device,
                       store: dist.TCPStore | None = None) -> None:
    """Join the ranks' group through rank 0's store (`store` on rank 0, a client of it elsewhere)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is None:
        store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size,
                              is_master=False, timeout=_RENDEZVOUS_TIMEOUT)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                            world_size=rendezvous.world_size, rank=rank, timeout=_RENDEZVOUS_TIMEOUT)


def load_shard(spec: ModelSpec, rank: int, rendezvous: Rendezvous, device: torch.device):
    from r3srv.models.loader import load_model

    parallel = replace(rendezvous.state(rank), sum_in_rank_order=spec.batch_invariant)
    return load_model(spec.path, device=device, dtype=spec.dtype, parallel=parallel,
                      batch_invariant=spec.batch_invariant)


# ---- a worker process ---------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux); elsewhere the parent's exit closes
    the rendezvous sockets and the next collective fails."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def worker_main(rank: int, spec: ModelSpec, rendezvous: Rendezvous, parent_pid: int, log_level: int,
                errors=None) -> None:
    """A worker's life; `errors`: where it reports (rank, error) if it fails (a queue rank 0 reads)."""
    _die_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        device = rank_device(spec.device, rank, rendezvous)
        init_process_group(rank, rendezvous, device)
        model, _ = load_shard(spec, rank, rendezvous, device)
        weight_sync = WeightSync(device, timeout=0.0, tp_rank=rank, tp_size=rendezvous.world_size)
        freeze_startup_heap()  # a full collection mid-step would hold up every rank's collectives
        _serve_commands(model, StepChannel(device if device.type == "cuda" else torch.device("cpu")), weight_sync)
        dist.destroy_process_group()
    except BaseException as exc:
        # the traceback goes to the inherited stderr: the server's log names the worker's error
        print(f"r3srv tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if errors is not None:
            errors.put((rank, f"{type(exc).__name__}: {exc}"[:2000]))
        os._exit(1)


def _serve_commands(model, channel: StepChannel, weight_sync: WeightSync) -> None:
    while True:
        msg = channel.receive()
        if msg.command is Command.STEP:
            model.forward(unpack_batch(msg.args, msg.payload, model.device))
        elif msg.command is Command.INIT_KV_CACHE:
            model.init_kv_cache(*msg.args[:4])
        elif msg.command is Command.FREE_KV_CACHE:
            model.free_kv_cache()
        elif msg.command is Command.WEIGHTS_TO_HOST:
            model.move_weights("cpu")
        elif msg.command is Command.WEIGHTS_TO_DEVICE:
            model.move_weights(model.device)
        elif msg.command is Command.LOAD_WEIGHTS:
            from r3srv.models.loader import load_weights_from_dir

            load_weights_from_dir(model, decode_text(msg.payload))
        elif msg.command in WEIGHT_COMMANDS:
            _weight_command_on_worker(weight_sync, model, channel, msg.command, json.loads(decode_text(msg.payload)))
        elif msg.command is Command.ENABLE_LORA:
            model.enable_lora(msg.args[0])
        elif msg.command is Command.LOAD_LORA_SLOT:
            model.load_lora_slot(msg.args[0], _broadcast_adapter(None, channel.device))
        elif msg.command is Command.CLEAR_LORA_SLOT:
            model.clear_lora_slot(msg.args[0])
        elif msg.command is Command.SHUTDOWN:
            return


def _broadcast_adapter(adapter, device: torch.device):
    """Rank 0's LoRA adapter (its whole pairs: each rank cuts its own slices), on every rank."""
    box = [adapter]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


WEIGHT_COMMANDS = frozenset({
    Command.JOIN_WEIGHT_GROUP, Command.LEAVE_WEIGHT_GROUP, Command.RECEIVE_WEIGHTS, Command.DROP_STAGED_WEIGHTS,
    Command.CHECK_STAGED_WEIGHTS, Command.APPLY_STAGED_WEIGHTS,
})


def _weight_command_on_worker(sync: WeightSync, model, channel: StepChannel, command: Command, call: dict) -> None:
    """A failure (a dead trainer, a timeout, a shard that does not fit) is this rank's vote,
    not its death: the ranks settle it together."""
    try:
        run_weight_command(sync, model, command, call)
        ok = True
    except Exception as exc:
        logger.warning("%s failed on this rank: %s", command.name, exc)
        ok = False
    settle_weight_command(sync, command, call, channel.agree(ok))


def _rank_of(proc: mp.Process) -> int:
    return int(proc.name.removeprefix("r3srv-tp-rank"))


def spawn_workers(spec: ModelSpec, rendezvous: Rendezvous, ranks: range, errors=None) -> list[mp.Process]:
    ctx = mp.get_context("spawn")  # never fork a process holding threads (and CUDA)
    procs = []
    for rank in ranks:
        proc = ctx.Process(target=worker_main, name=f"r3srv-tp-rank{rank}", daemon=True,
                           args=(rank, spec, rendezvous, os.getpid(), logging.getLogger().level, errors))
        proc.start()
        procs.append(proc)
    return procs


def run_node(spec: ModelSpec, rendezvous: Rendezvous) -> int:
    """A node other than the first (--node-rank > 0): its ranks' workers, until they end."""
    procs = spawn_workers(spec, rendezvous, rendezvous.local_ranks)
    for proc in procs:
        proc.join()
    return max((p.exitcode or 0) for p in procs)


# ---- rank 0 ---------------------------------------------------------------------------------
class MultiprocExecutor:
    """Rank 0's shard of the model plus the workers that hold the others, driven as one model."""

    def __init__(self, spec: ModelSpec, rendezvous: Rendezvous) -> None:
        if rendezvous.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run run_node")
        if rendezvous.world_size % rendezvous.nnodes:
            raise ConfigError(f"tensor_parallel_size={rendezvous.world_size} does not split over nnodes={rendezvous.nnodes}")
        rendezvous, self._store = host_store(rendezvous)
        self.rendezvous = rendezvous
        self.device = rank_device(spec.device, 0, rendezvous)
        self.failure: WorkerError | None = None
        self.on_failure: list[Callable[[WorkerError], None]] = []
        self._closing = False
        self._lock = threading.Lock()
        self._started = False  # until then a worker's death is a start-up error, told in full
        self._errors = mp.get_context("spawn").SimpleQueue()  # (rank, error) of a worker that failed
        self._reported: dict[int, str] = {}
        self.workers = spawn_workers(spec, rendezvous, rendezvous.local_ranks[1:], self._errors)
        atexit.register(self.shutdown)
        try:
            self._join_watching_workers(rendezvous)
            threading.Thread(target=self._monitor, name="r3srv-tp-monitor", daemon=True).start()
            self.model, self.tokenizer = load_shard(spec, 0, rendezvous, self.device)
            self._check_alive()  # a worker that failed to load its shard meanwhile
        except BaseException:
            self._stop_workers()
            if dist.is_initialized():  # joined before the failure: leave the group, as shutdown does
                dist.destroy_process_group()
            atexit.unregister(self.shutdown)
            raise
        self.config = self.model.config
        self.dtype = self.model.dtype
        self.weight_sync = WeightSync(self.device, timeout=0.0, tp_rank=0, tp_size=rendezvous.world_size)
        self.channel = StepChannel(self.device if self.device.type == "cuda" else torch.device("cpu"))
        self._started = True

    def _join_watching_workers(self, rendezvous: Rendezvous) -> None:
        """Rank 0 joins the process group (whose store waits for every rank) while watching this
        node's workers: one that dies first is the start-up's error, raised at once."""
        joined = threading.Event()
        failures: list[BaseException] = []

        def join() -> None:
            try:
                init_process_group(0, rendezvous, self.device, self._store)
            except BaseException as exc:
                failures.append(exc)
            finally:
                joined.set()

        # a daemon: if a worker died, it stays blocked in the store's wait until its timeout
        threading.Thread(target=join, name="r3srv-tp-rendezvous", daemon=True).start()
        while not joined.wait(0.1):
            dead = next((p for p in self.workers if not p.is_alive()), None)
            if dead is not None:
                raise WorkerError(self._death(dead, "while starting"))
        if failures:
            raise failures[0]

    def _death(self, proc: mp.Process, when: str = "") -> str:
        """What a worker's exit says, with the error it reported if any."""
        proc.join(timeout=5)
        while not self._errors.empty():
            rank, error = self._errors.get()
            self._reported[rank] = error
        error = self._reported.get(_rank_of(proc))
        return (f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
                + (f" {when}" if when else "") + (f": {error}" if error else ""))

    # ---- the model's methods, on every rank ------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        args, payload = pack_batch(batch)
        return self._everywhere(Command.STEP, args, payload, lambda: self.model.forward(batch))

    def init_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 8, num_state_snapshots: int = 0) -> None:
        args = (num_blocks, block_size, num_state_slots, num_state_snapshots)
        self._everywhere(Command.INIT_KV_CACHE, args, None, lambda: self.model.init_kv_cache(*args))

    def free_kv_cache(self) -> None:
        self._everywhere(Command.FREE_KV_CACHE, (), None, self.model.free_kv_cache)

    def move_weights(self, device: torch.device | str) -> None:
        to_host = torch.device(device).type == "cpu" and self.device.type != "cpu"
        command = Command.WEIGHTS_TO_HOST if to_host else Command.WEIGHTS_TO_DEVICE
        self._everywhere(command, (), None, lambda: self.model.move_weights(device))

    def load_weights(self, source: str | NamedTensors) -> None:
        """A directory: rank 0 checks and loads first (a ConfigError leaves every rank
        unchanged), then the others. Tensors a trainer pushed: each rank's staged ones (which
        `source` stands for), checked on every rank before any rank copies its shard."""
        from r3srv.models.loader import NamedTensors, load_weights_from_dir

        self._check_alive()
        if isinstance(source, NamedTensors):
            self._weights_everywhere(Command.CHECK_STAGED_WEIGHTS, {}, "checking the staged weights")
            self._weights_everywhere(Command.APPLY_STAGED_WEIGHTS, {}, "copying the staged weights")
            return
        load_weights_from_dir(self.model, source)
        self._everywhere(Command.LOAD_WEIGHTS, (), encode_text(str(source)), lambda: None)

    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        """Rank 0's answer stands for all (the same parameters, each cut the same way);
        CHECK_STAGED_WEIGHTS asks every rank before an update."""
        from r3srv.models.loader import plan_named_tensors

        return plan_named_tensors(self.model, named, complete=False).missing

    # ---- a trainer's weight push: every rank joins and receives (engine/weight_sync.py) -----
    def join_weight_group(self, timeout: float, **group) -> str:
        self._weights_everywhere(Command.JOIN_WEIGHT_GROUP, {**group, "timeout": timeout},
                                 f"joining {group['group_name']!r}", param="master_address")
        ranks = range(group["rank_offset"], group["rank_offset"] + self.rendezvous.world_size)
        return (f"joined {group['group_name']!r} as ranks {ranks.start}..{ranks.stop - 1} of {group['world_size']} "
                f"({group['backend']}; one per tensor-parallel rank)")

    def leave_weight_group(self, group_name: str) -> None:
        self._weights_everywhere(Command.LEAVE_WEIGHT_GROUP, {"group_name": group_name}, f"leaving {group_name!r}",
                                 param="group_name")

    def receive_weights(self, group_name: str, named: NamedTensors | None, packing: dict | None = None, *,
                        announced: bool = False, whole: bool = False) -> None:
        """`announced`: prime-rl's push, whose names come with the tensors (named is None);
        `whole`: every rank stages the tensors whole (a LoRA adapter's), not its shard's pieces."""
        names = list(named.metas) if named is not None else []
        metas = named.metas if named is not None else {}
        call = {"group_name": group_name, "names": names, "dtypes": [str(metas[n][1]) for n in names],
                "shapes": [list(metas[n][0]) for n in names], "packing": packing, "announced": announced,
                "whole": whole}
        self._weights_everywhere(Command.RECEIVE_WEIGHTS, call, "the broadcast from the trainer", param="names",
                                 after=f"; the served weights are unchanged and group {group_name!r} is destroyed")

    def drop_staged_weights(self) -> None:
        self._weights_everywhere(Command.DROP_STAGED_WEIGHTS, {}, "dropping the staged weights")

    def _weights_everywhere(self, command: Command, call: dict, what: str, *, param: str = "names",
                            after: str = "") -> None:
        """Every rank runs its part, then all vote; if any failed, every rank undoes its part
        (settle_weight_command) and rank 0's error, or the failed ranks, is raised. A failure
        of the ranks' own channel is the engine's death, as for a step."""
        self._check_alive()
        error: Exception | None = None
        try:
            self.channel.send(command, (), encode_text(json.dumps(call)))
            try:
                run_weight_command(self.weight_sync, self.model, command, call)
            except Exception as exc:  # raised once the ranks have settled
                error = exc
            failed = self.channel.agree(error is None)
            settle_weight_command(self.weight_sync, command, call, failed)
        except BaseException as exc:
            self._fail(self._lost(exc), f"tensor-parallel {command.name} failed on rank 0: {exc!r}")
            raise WorkerError(str(self.failure)) from exc
        if error is not None:
            raise error
        where = f"tensor-parallel rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
        if failed and command is Command.APPLY_STAGED_WEIGHTS:  # some shards new, some old: no policy to serve
            message = f"{what} failed on {where}, leaving the ranks on mixed weights"
            self._fail(WorkerError(message), message)
            raise WorkerError(str(self.failure))
        if failed and command is Command.CHECK_STAGED_WEIGHTS:  # nothing copied: as a checkpoint that does not fit
            raise ConfigError(f"the staged weights do not fill {where}'s shards (the server's log names them)")
        if failed:
            raise WeightSyncError(f"{what} failed on {where} (the server's log has the error){after}", param=param)

    # ---- LoRA adapters (r3srv.lora): the same slots on every rank ---------------------------
    def enable_lora(self, num_slots: int):
        return self._everywhere(Command.ENABLE_LORA, (num_slots,), None, lambda: self.model.enable_lora(num_slots))

    def check_lora(self, adapter, param: str) -> None:
        """Rank 0's check stands for all: each rank cuts the same shapes from the whole pairs."""
        self.model.check_lora(adapter, param)

    def load_lora_slot(self, slot: int, adapter) -> None:
        def here() -> None:
            _broadcast_adapter(adapter, self.channel.device)
            self.model.load_lora_slot(slot, adapter)

        self._everywhere(Command.LOAD_LORA_SLOT, (slot,), None, here)

    def clear_lora_slot(self, slot: int) -> None:
        self._everywhere(Command.CLEAR_LORA_SLOT, (slot,), None, lambda: self.model.clear_lora_slot(slot))

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_cache_bytes_per_block(block_size)

    def state_bytes_per_slot(self) -> int:
        return self.model.state_bytes_per_slot()

    def _everywhere(self, command: Command, args, payload, local: Callable):
        """Send the command, then run its rank-0 part. Any failure is final: a rank that
        stopped half-way through a step leaves the others waiting in a collective."""
        self._check_alive()
        try:
            self.channel.send(command, args, payload)
            return local()
        except BaseException as exc:
            self._fail(self._lost(exc), f"a tensor-parallel step failed on rank 0: {exc!r}")
            raise WorkerError(str(self.failure)) from exc

    # ---- faults and shutdown --------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.failure is not None:
            raise WorkerError(str(self.failure))

    def _monitor(self) -> None:
        sentinels = {p.sentinel: p for p in self.workers}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        proc = sentinels[ready[0]]
        if not self._started:  # the start-up's caller gets the worker's own error
            detail = self._death(proc, "while starting")
            self._fail(WorkerError(detail), detail)
            return
        self._fail(WorkerError(f"{self._rank_name(_rank_of(proc))} was lost: the server is stopping"), self._death(proc))

    def _rank_name(self, rank: int) -> str:
        node = f" (node {rank // self.rendezvous.local_size})" if self.rendezvous.nnodes > 1 else ""
        return f"tensor-parallel rank {rank}{node}"

    def _lost(self, exc: BaseException) -> WorkerError:
        """What a failed collective or channel says to clients: the rank that was lost. A worker of
        this node that died is named (its exit may reach the monitor a moment after the collective
        fails); else the ranks of the other nodes, whose loss a collective sees first; else rank 0."""
        for _ in range(20):
            dead = [_rank_of(p) for p in self.workers if not p.is_alive()]
            if dead or self.rendezvous.nnodes > 1:
                break
            time.sleep(0.1)
        remote = [r for r in range(self.rendezvous.world_size) if r not in self.rendezvous.local_ranks]
        lost = dead or remote or [0]
        names = ", ".join(self._rank_name(r) for r in lost)
        return WorkerError(f"{names} {'was' if len(lost) == 1 else 'were'} lost: the server is stopping")

    def _fail(self, error: WorkerError, detail: str) -> None:
        """Record the failure clients will see (`error`) and log what happened (`detail`)."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = error
        logger.error("%s; stopping the other ranks", detail)
        self._stop_workers()
        for callback in self.on_failure:
            callback(error)

    def _stop_workers(self) -> None:
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
        for proc in self.workers:
            proc.join(timeout=5)

    def shutdown(self) -> None:
        """Stop the workers (they finish the command in flight first) and leave the group."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.failure is None:
            try:
                self.channel.send(Command.SHUTDOWN)
            except Exception:  # a worker already gone: killed below
                pass
            for proc in self.workers:
                proc.join(timeout=10)
        self._stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None  # its port is free again
        atexit.unregister(self.shutdown)

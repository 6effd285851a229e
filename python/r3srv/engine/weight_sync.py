"""Weights pushed by a trainer over torch.distributed (SGLang's /init_weights_update_group and
/update_weights_from_distributed; vLLM's NCCL weight transfer is mapped onto the same groups).

The trainer is rank 0 of a process group of its own (not the server's default group, which it
may not have): it hosts the TCPStore rendezvous at master_address:master_port, the server joins
as rank rank_offset, and every tensor is a broadcast from rank 0, in the order of the names it
announced. Tensors land in staging buffers, never in the model: the model is overwritten only
once every parameter has arrived (by the engine thread, under the same rules as a disk update),
so a trainer that dies or stalls mid-broadcast (the group's timeout) leaves the served weights
untouched and the group torn down.

Under tensor parallelism every rank joins, as SGLang's and vLLM's workers do: rank
rank_offset + tp_rank of a group whose world_size counts them all. Each rank receives every
broadcast in full (one broadcast per tensor, nothing relayed through rank 0), stages it, and
at the update loads its own shard of it as from a checkpoint. `WeightSync` is one rank's part
(the server's own at one device; engine/multiproc_executor.py runs one per rank on the engine
thread, which `RankedWeightSync` drives).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from r3srv.engine.prime_rl_broadcast import receive_state_dicts
from r3srv.engine.process_groups import broadcast_from_trainer, destroy_group, init_custom_process_group
from r3srv.engine.step_channel import Command
from r3srv.engine.vllm_transfer import Packing, join_vllm_group, receive_packed
from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.models.loader import NamedTensors

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
VLLM_GROUP = "weight_update_group"  # vLLM's init_info names no group: the SGLang default
PRIME_RL_GROUP = "prime_rl_broadcast"  # the group /init_broadcaster joins


class WeightSyncError(InvalidRequestError):
    """A weight sync that failed; the served weights are unchanged."""


def check_group_ranks(rank_offset: int, world_size: int, tp_size: int) -> None:
    """The trainer is rank 0; this engine's ranks are rank_offset .. rank_offset + tp_size - 1."""
    if not 0 < rank_offset < world_size:
        raise InvalidRequestError(
            f"rank_offset must be in [1, world_size) (rank 0 is the trainer), got {rank_offset} of {world_size}",
            param="rank_offset",
        )
    if rank_offset + tp_size > world_size:
        raise InvalidRequestError(
            f"world_size {world_size} leaves no room for this engine's {tp_size} tensor-parallel ranks: they join "
            f"as ranks {rank_offset}..{rank_offset + tp_size - 1}, so world_size must be at least {rank_offset + tp_size}",
            param="world_size",
        )


RENDEZVOUS = ("torch", "vllm")  # init_custom_process_group (SGLang's), or vLLM's StatelessProcessGroup store


@dataclass
class _Group:
    group: Any  # a torch process group, or vLLM's NCCL communicator on CUDA (engine/vllm_transfer.py)
    rank: int
    world_size: int
    backend: str
    packing: Packing | None = None  # vLLM's packed broadcasts, agreed at the rendezvous


@dataclass
class WeightSync:
    """One rank's update groups and the tensors it received but has not applied yet."""

    device: torch.device
    timeout: float  # seconds a rendezvous or a broadcast may wait for the trainer
    tp_rank: int = 0  # this rank joins as rank_offset + tp_rank
    tp_size: int = 1
    groups: dict[str, _Group] = field(default_factory=dict)
    # tensors of an update that arrives in several calls (SGLang trainers send buckets)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one rendezvous or receive at a time

    def backend_for(self, backend: str) -> str:
        """gloo on the CPU, NCCL on CUDA: a trainer asking for the other one is a 400."""
        want = "nccl" if self.device.type == "cuda" else "gloo"
        if backend != want:
            raise InvalidRequestError(
                f"backend {backend!r} cannot move tensors to this server's {self.device.type} weights: use {want!r}",
                param="backend",
            )
        return backend

    def join(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str, rendezvous: str = "torch", packing: dict | None = None,
             rendezvous_timeout: float | None = None) -> str:
        """Blocking: run it off the event loop. The trainer joins too, at the same time.
        `rendezvous`: "torch" (SGLang's) or "vllm" (vLLM's trainer store, engine/vllm_transfer.py);
        `packing`: Packing's fields, when the trainer broadcasts vLLM's packed chunks;
        `rendezvous_timeout`: the trainer's own bound on the rendezvous (at most the server's)."""
        backend = self.backend_for(backend)
        self.check_join(rank_offset=rank_offset, world_size=world_size, group_name=group_name)
        rank = rank_offset + self.tp_rank
        wait = min(self.timeout, rendezvous_timeout) if rendezvous_timeout else self.timeout
        with self._lock:
            try:
                if rendezvous == "vllm":
                    group = join_vllm_group(master_address=master_address, master_port=master_port, rank=rank,
                                            world_size=world_size, device=self.device, timeout=wait)
                else:
                    group = init_custom_process_group(
                        master_address=master_address, master_port=master_port, rank=rank, world_size=world_size,
                        group_name=group_name, backend=backend, timeout=wait,
                    )
            except InvalidRequestError:
                raise
            except Exception as exc:  # the rendezvous timed out, the address is wrong, the store is not vLLM's
                raise WeightSyncError(f"could not join {group_name!r} at {master_address}:{master_port}: {exc}",
                                      param="master_address") from exc
            self.groups[group_name] = _Group(group, rank, world_size, backend,
                                             None if packing is None else Packing(**packing))
        logger.info("joined weight update group %s as rank %d of %d (%s)", group_name, rank, world_size, backend)
        ranks = str(rank_offset) if self.tp_size == 1 else f"{rank_offset}..{rank_offset + self.tp_size - 1}"
        return f"joined {group_name!r} as rank{'s' if self.tp_size > 1 else ''} {ranks} of {world_size} ({backend})"

    def check_join(self, *, rank_offset: int, world_size: int, group_name: str) -> None:
        """A 400 naming the field before anyone waits at the rendezvous."""
        if not group_name:
            raise InvalidRequestError("group_name must not be empty", param="group_name")
        check_group_ranks(rank_offset, world_size, self.tp_size)
        if group_name in self.groups:
            raise InvalidRequestError(f"group {group_name!r} already exists: destroy it first", param="group_name")

    def leave(self, group_name: str) -> None:
        with self._lock:
            self._destroy(group_name)

    def forget(self, group_name: str) -> None:
        """Leave `group_name` if this rank is in it, and drop what it staged (another rank failed)."""
        with self._lock:
            self.staged.clear()
            if group_name in self.groups:
                self._destroy(group_name)

    def staged_tensors(self) -> NamedTensors:
        return NamedTensors.of(self.staged)

    def take_staged(self) -> NamedTensors:
        """The staged set, handed to an update: staging no longer holds it."""
        named, self.staged = self.staged_tensors(), {}
        return named

    def drop_staged(self) -> None:
        self.staged.clear()

    def _destroy(self, group_name: str) -> None:
        known = self.groups.pop(group_name, None)
        if known is None:
            raise InvalidRequestError(f"no weight update group named {group_name!r}", param="group_name")
        self.staged.clear()
        try:
            destroy_group(known.group)
        except Exception as exc:  # a group broken by a dead trainer: forget it anyway
            logger.warning("destroying weight update group %s: %s", group_name, exc)

    def group(self, group_name: str) -> _Group:
        known = self.groups.get(group_name)
        if known is None:
            raise InvalidRequestError(
                f"no weight update group named {group_name!r}: call /init_weights_update_group first",
                param="group_name",
            )
        return known

    def receive(self, group_name: str, named: NamedTensors,
                keep: Callable[[NamedTensors], dict[str, Any]] | None = None, packing: dict | None = None) -> None:
        """Blocking: every announced tensor, broadcast from rank 0 in order (one broadcast each,
        or vLLM's packed chunks: `packing`, else the group's), into new buffers on this rank's
        device, staged once all arrived (`keep`: what of them to stage; default all). On a
        failure (the trainer died, or stalled past the timeout) the group is destroyed, as it
        can no longer be trusted, and WeightSyncError says so; nothing received is kept."""
        def fetch(group: _Group, arrived: Callable[[int], None]) -> dict[str, torch.Tensor]:
            packed = Packing(**packing) if packing is not None else group.packing
            if packed is not None:
                return receive_packed(group.group, named.metas, packed, self.device, on_chunk=arrived)
            buffers = {name: torch.empty(shape, dtype=dtype, device=self.device)
                       for name, (shape, dtype) in named.metas.items()}
            broadcast_from_trainer(group.group, buffers.values(), arrived)
            return buffers

        self._receive(group_name, fetch, keep, f" of {len(named.metas)}")

    def receive_announced(self, group_name: str, check: Callable[[NamedTensors], Any],
                          keep: Callable[[NamedTensors], dict[str, Any]] | None = None) -> int:
        """prime-rl's push (engine/prime_rl_broadcast.py): the names arrive with the tensors, and
        `check` sees each state dict's before its tensors come. Returns how many tensors arrived;
        failures as receive's."""
        def fetch(group: _Group, arrived: Callable[[int], None]) -> dict[str, torch.Tensor]:
            return receive_state_dicts(group.group, self.device, lambda metas: check(NamedTensors(metas)), arrived)

        return self._receive(group_name, fetch, keep, "")

    def _receive(self, group_name: str, fetch, keep, of_total: str) -> int:
        with self._lock:
            known = self.group(group_name)
            done = 0

            def arrived(count: int) -> None:
                nonlocal done
                done = count

            try:
                buffers = fetch(known, arrived)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            except Exception as exc:
                self._destroy(group_name)  # drops the staged tensors too
                raise WeightSyncError(
                    f"the broadcast from the trainer failed after {done}{of_total} tensors ({exc}); "
                    f"the served weights are unchanged and group {group_name!r} is destroyed",
                    param="names",
                ) from exc
            self.staged.update(buffers if keep is None else keep(NamedTensors.of(buffers)))
            return len(buffers)


def named_tensor_metas(names: list[str], dtypes: list[str], shapes: list[list[int]], *, dtypes_param: str) -> NamedTensors:
    """The announced tensors of one call, each name once, every dtype a torch dtype name
    ("bfloat16" or "torch.bfloat16"); an InvalidRequestError names the field at fault."""
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequestError(
            f"names, {dtypes_param} and shapes must have the same length, got {len(names)}, {len(dtypes)}, {len(shapes)}",
            param=dtypes_param if len(dtypes) != len(names) else "shapes",
        )
    metas: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, dtype_name, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidRequestError(f"{dtypes_param}: {dtype_name!r} (of {name}) is not a torch dtype", param=dtypes_param)
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise InvalidRequestError(f"shapes: {shape!r} (of {name}) is not a shape", param="shapes")
        if name in metas:
            raise InvalidRequestError(f"names: {name} appears twice", param="names")
        metas[name] = (tuple(shape), dtype)
    return NamedTensors(metas)


# ---- one rank's part of a command, under tensor parallelism --------------------------------
def run_weight_command(sync: WeightSync, model, command: Command, call: dict) -> None:
    """What every rank does for `command` (rank 0 has checked `call` first); raises on failure."""
    from r3srv.models.loader import load_named_tensors, plan_named_tensors
    from r3srv.models.staged_shards import keep_shard_pieces

    if command is Command.JOIN_WEIGHT_GROUP:
        sync.timeout = call["timeout"]
        sync.join(**{k: v for k, v in call.items() if k != "timeout"})
    elif command is Command.RECEIVE_WEIGHTS and call.get("announced"):  # prime-rl's: names come in-band
        sync.receive_announced(call["group_name"], check=lambda named: plan_named_tensors(model, named, complete=False),
                               keep=lambda arrived: keep_shard_pieces(model, arrived))
    elif command is Command.RECEIVE_WEIGHTS:
        named = named_tensor_metas(call["names"], call["dtypes"], call["shapes"], dtypes_param="dtypes")
        keep = None if call.get("whole") else (lambda arrived: keep_shard_pieces(model, arrived))  # whole: an adapter's
        sync.receive(call["group_name"], named, keep=keep, packing=call.get("packing"))
    elif command is Command.LEAVE_WEIGHT_GROUP:
        sync.leave(call["group_name"])
    elif command is Command.DROP_STAGED_WEIGHTS:
        sync.drop_staged()
    elif command is Command.CHECK_STAGED_WEIGHTS:  # this rank's shard of every parameter is staged
        plan_named_tensors(model, sync.staged_tensors(), complete=True)
    elif command is Command.APPLY_STAGED_WEIGHTS:
        load_named_tensors(model, sync.take_staged())
    else:
        raise ValueError(f"not a weight command: {command!r}")


def settle_weight_command(sync: WeightSync, command: Command, call: dict, failed: list[int]) -> None:
    """After every rank voted: if any failed, every rank undoes its part the same way, so the
    ranks never disagree on which groups exist or what is staged."""
    if not failed:
        return
    if command in (Command.JOIN_WEIGHT_GROUP, Command.RECEIVE_WEIGHTS):
        sync.forget(call["group_name"])
    elif command is Command.CHECK_STAGED_WEIGHTS:
        sync.drop_staged()


# ---- the receivers TrainerUpdates drives -----------------------------------------------------
class LocalReceiver:
    """One device: the server receives on a thread of its own while the engine keeps serving."""

    tp_size = 1

    def __init__(self, device: torch.device, timeout: float) -> None:
        self.sync = WeightSync(device, timeout)
        self.device = device

    @property
    def timeout(self) -> float:
        return self.sync.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.sync.timeout = seconds

    def check_group(self, group_name: str) -> None:
        self.sync.group(group_name)

    def has_group(self, group_name: str) -> bool:
        return group_name in self.sync.groups

    async def join(self, **group: Any) -> str:
        return await asyncio.to_thread(self.sync.join, **group)

    async def leave(self, group_name: str) -> None:
        await asyncio.to_thread(self.sync.leave, group_name)  # waits for a receive under way

    async def receive(self, group_name: str, named: NamedTensors, packing: dict | None = None,
                      whole: bool = False) -> None:
        await asyncio.to_thread(self.sync.receive, group_name, named, None, packing)  # one rank keeps it whole

    async def receive_announced(self, group_name: str, check: Callable[[NamedTensors], Any]) -> int:
        return await asyncio.to_thread(self.sync.receive_announced, group_name, check)

    def stage(self, tensors: dict[str, torch.Tensor]) -> None:
        self.sync.staged.update(tensors)

    def staged_tensors(self) -> NamedTensors:
        return self.sync.staged_tensors()

    async def take_staged(self) -> NamedTensors:
        return self.sync.take_staged()

    async def drop_staged(self) -> None:
        self.sync.drop_staged()


class RankedReceiver:
    """Tensor parallelism: every rank joins, receives and stages (engine/multiproc_executor.py),
    on the engine thread between steps, since the commands reach the workers over the channel
    the steps use; generation waits meanwhile, as in SGLang. Rank 0's WeightSync answers what
    needs no rank (known groups, what is staged), and checks every call before any rank waits."""

    def __init__(self, engine, timeout: float) -> None:
        self.engine = engine
        self.ranks = engine.core.executor.ranks
        self.sync: WeightSync = self.ranks.weight_sync
        self.device = self.sync.device
        self.tp_size = self.sync.tp_size
        self.timeout = timeout  # every rank's, from the next join

    def check_group(self, group_name: str) -> None:
        self.sync.group(group_name)

    def has_group(self, group_name: str) -> bool:
        return group_name in self.sync.groups

    async def join(self, *, backend: str, **group: Any) -> str:
        group["backend"] = self.sync.backend_for(backend)
        self.sync.check_join(rank_offset=group["rank_offset"], world_size=group["world_size"],
                             group_name=group["group_name"])
        return await self.engine.call_ranks(lambda ranks: ranks.join_weight_group(self.timeout, **group))

    async def leave(self, group_name: str) -> None:
        self.check_group(group_name)
        await self.engine.call_ranks(lambda ranks: ranks.leave_weight_group(group_name))

    async def receive(self, group_name: str, named: NamedTensors, packing: dict | None = None,
                      whole: bool = False) -> None:
        """whole: every rank stages every tensor whole (an adapter's, which rank 0 loads), rather
        than the pieces of its own shard."""
        await self.engine.call_ranks(lambda ranks: ranks.receive_weights(group_name, named, packing, whole=whole))

    async def receive_announced(self, group_name: str, check: Callable[[NamedTensors], Any]) -> int:
        await self.engine.call_ranks(lambda ranks: ranks.receive_weights(group_name, None, announced=True))
        return len(self.sync.staged_tensors().metas)  # every rank checked its own shard's pieces

    def stage(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError("tensors handed over in one process cannot reach every rank's staging")

    def staged_tensors(self) -> NamedTensors:
        return self.sync.staged_tensors()  # rank 0's: every rank received the same tensors

    async def take_staged(self) -> NamedTensors:
        return self.sync.staged_tensors()  # the update applies and clears every rank's staging

    async def drop_staged(self) -> None:
        await self.engine.call_ranks(lambda ranks: ranks.drop_staged_weights())


class TrainerUpdates:
    """The one road for weights a trainer sends by name (SGLang's distributed and tensor
    updates, vLLM's weight transfer): check the names, shapes and dtypes against the served
    model before anything arrives, stage what arrives, and hand the engine a complete set.

    A call may carry part of the model (trainers send buckets): its tensors are staged, and
    the update is applied when the staged tensors fill every parameter; between vLLM's
    start_weight_update and finish_weight_update, at finish_weight_update only (anything
    unfilled then is a 400). Until then the server serves the weights it had.

    `engine`: an AsyncLLM, or OfflineTrainerEngine for the offline LLM.
    """

    def __init__(self, engine, timeout: float) -> None:
        self.engine = engine
        self.sync: LocalReceiver | RankedReceiver = (
            LocalReceiver(engine.device, timeout) if engine.core.executor.ranks is None else RankedReceiver(engine, timeout))
        self.in_round = False  # between vLLM's start_weight_update and finish_weight_update
        self.session: str | None = None  # SGLang's begin_weight_update selector until end_weight_update
        self.last_vllm_info: Any = None  # vLLM's update_info with empty lists means the previous one again
        self._lock: asyncio.Lock | None = None  # one update call at a time (made on the server's loop)

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def check(self, named: NamedTensors) -> None:
        """A 400 naming the first tensor the served model cannot take, before any arrives."""
        try:
            await asyncio.to_thread(self.engine.unfilled_weights, named)
        except ConfigError as exc:
            raise InvalidRequestError(str(exc), param="names") from exc

    async def receive(self, group_name: str, named: NamedTensors, *, weight_version: str | None = None,
                      abort_running: bool = False, packing: dict | None = None) -> str:
        async with self.lock:
            self.sync.check_group(group_name)
            await self.check(named)
            await self.sync.receive(group_name, named, packing)
            return await self._staged(len(named.metas), weight_version, abort_running)

    async def take(self, tensors: dict[str, torch.Tensor], *, weight_version: str | None = None,
                   abort_running: bool = False) -> str:
        """Tensors already in this process (CUDA IPC): checked, copied into staging, staged."""
        named = NamedTensors.of(tensors)
        async with self.lock:
            await self.check(named)
            copies = await asyncio.to_thread(
                lambda: {name: t.to(self.sync.device, copy=True) for name, t in tensors.items()})
            self.sync.stage(copies)
            return await self._staged(len(copies), weight_version, abort_running)

    async def receive_adapter(self, group_name: str, named: NamedTensors) -> dict[str, torch.Tensor]:
        """A LoRA adapter's tensors broadcast over the group (/load_lora_adapter_from_distributed):
        received as weights are (on every rank under tensor parallelism), but handed back, on the
        host, rather than staged for the model. Refused while a weight update has tensors staged:
        the two would share the staging."""
        async with self.lock:
            self.sync.check_group(group_name)
            if self.in_round or self.sync.staged_tensors().metas:
                raise InvalidRequestError("a weight update has tensors staged: complete it (or end its session) "
                                          "before pushing an adapter", param="group_name")
            try:
                await self.sync.receive(group_name, named, whole=True)
            except ConfigError as exc:
                raise InvalidRequestError(str(exc), param="names") from exc
            received = self.sync.staged_tensors().tensors  # rank 0's: every rank received the same
            tensors = await asyncio.to_thread(lambda: {n: t.to("cpu", copy=True) for n, t in received.items()})
            await self.sync.drop_staged()
            return tensors

    async def receive_announced(self, group_name: str, *, weight_version: str | None) -> str:
        """prime-rl's push: every tensor it sends, its names checked against the served model as
        each state dict's metadata arrives; applied like an SGLang call that completes the model."""
        def check(named: NamedTensors) -> None:
            self.engine.unfilled_weights(named)  # a ConfigError names what the model cannot take

        async with self.lock:
            self.sync.check_group(group_name)
            arrived = await self.sync.receive_announced(group_name, check)
            return await self._staged(arrived, weight_version, False)

    async def receive_in_round(self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                               packing: dict | None = None) -> str:
        """One vLLM update_info between start_weight_update and finish_weight_update, over the
        group /init_weight_transfer_engine joined; empty lists repeat the previous call's names."""
        if not self.in_round:
            raise InvalidRequestError("call /start_weight_update before /update_weights", param="update_info")
        if names:
            self.last_vllm_info = (names, dtype_names, shapes)
        elif self.last_vllm_info is not None:
            names, dtype_names, shapes = self.last_vllm_info
        named = named_tensor_metas(names, dtype_names, shapes, dtypes_param="dtype_names")
        return await self.receive(VLLM_GROUP, named, packing=packing)

    async def start_round(self) -> None:
        async with self.lock:
            await self.sync.drop_staged()
            self.in_round = True

    async def finish_round(self, weight_version: str | None) -> str:
        async with self.lock:
            if not self.in_round:
                raise InvalidRequestError("no weight update was started: call /start_weight_update first")
            self.in_round = False
            return await self._apply(weight_version, abort_running=False, complete=True)

    async def begin_session(self, selector: str) -> None:
        """SGLang's /begin_weight_update: a session of update calls, each applied once the staged
        tensors fill the model (as without one), which /end_weight_update closes."""
        async with self.lock:
            if self.session is not None:
                raise InvalidRequestError("a weight-update session is already open; call /end_weight_update first")
            await self.sync.drop_staged()
            self.session = selector

    async def end_session(self) -> None:
        """Close the session; tensors still staged then (parameters never sent) are dropped, and
        the answer is a 400 naming the missing parameters: the served weights did not change."""
        async with self.lock:
            if self.session is None:
                raise InvalidRequestError("no weight-update session is open; call /begin_weight_update first")
            self.session = None
            staged = self.sync.staged_tensors()
            if not staged.metas:
                return
            unfilled = await asyncio.to_thread(self.engine.unfilled_weights, staged)
            await self.sync.drop_staged()
            raise InvalidRequestError(
                f"the session ended with {len(staged.metas)} tensors staged and {len(unfilled)} parameters never "
                f"sent, e.g. {', '.join(unfilled[:8])}; the served weights are unchanged", param="names")

    async def _staged(self, arrived: int, weight_version: str | None, abort_running: bool) -> str:
        if self.in_round:
            return (f"received {arrived} tensors; {len(self.sync.staged_tensors().metas)} staged until "
                    "/finish_weight_update")
        return await self._apply(weight_version, abort_running, complete=False)

    async def _apply(self, weight_version: str | None, abort_running: bool, *, complete: bool) -> str:
        staged = self.sync.staged_tensors()
        unfilled = await asyncio.to_thread(self.engine.unfilled_weights, staged)
        if unfilled and not complete:
            return (f"staged {len(staged.tensors)} tensors; the update is applied once the other "
                    f"{len(unfilled)} parameters arrive, e.g. {', '.join(unfilled[:4])}")
        if unfilled:
            await self.sync.drop_staged()
            raise InvalidRequestError(
                f"no weights arrived for {len(unfilled)} parameters, e.g. {', '.join(unfilled[:8])}; "
                "the served weights are unchanged", param="names")
        staged = await self.sync.take_staged()
        try:
            await self.engine.update_weights(staged, abort_running=abort_running, weight_version=weight_version)
        except ConfigError as exc:
            raise InvalidRequestError(str(exc), param="names") from exc
        return f"updated {len(staged.tensors)} tensors; prefix cache emptied; weight version {self.engine.weight_version}"


class OfflineTrainerEngine:
    """The offline LLM's engine as TrainerUpdates drives it: the caller's thread is the engine's."""

    def __init__(self, core) -> None:
        self.core = core
        self.device = core.device

    @property
    def weight_version(self) -> str:
        return self.core.weight_version

    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        return self.core.unfilled_weights(named)

    async def update_weights(self, named: NamedTensors, *, abort_running: bool, weight_version: str | None) -> None:
        self.core.update_weights(named, weight_version)

    async def call_ranks(self, call):
        return self.core.call_ranks(call)

"""collective_rpc: a fixed table of method names, each mapped onto r3srv's own weight commands.

vLLM's /collective_rpc calls any method of its workers by name (its development mode; SkyRL adds
its own through --worker-extension-cls). r3srv answers only the names below, the weight-sync
methods SkyRL's trainer calls (SkyRL's `NewInferenceWorkerWrap`, its vLLM worker extension);
any other name is a 400 naming `method`. Arguments are JSON, checked against each method's
Struct (positional args fill its fields in order); nothing is looked up by name on an object,
nothing is unpickled. The answer is vLLM's: one result per rank (each None here).

The HTTP route (server/routes/control.py) is a thin caller of `collective_rpc`; an in-process
API can call it the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import Struct

from r3srv.engine.vllm_transfer import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from r3srv.engine.weight_sync import TrainerUpdates
from r3srv.errors import InvalidRequestError


class StartWeightUpdate(Struct, kw_only=True, forbid_unknown_fields=True):
    is_checkpoint_format: bool = True  # checkpoint (Hugging Face) names; False: the engine's own layout


class NcclUpdateInfo(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM 0.26's NCCLWeightTransferUpdateInfo (SkyRL's pin): the packed layout rides here."""

    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


class UpdateWeightsNccl(Struct, kw_only=True, forbid_unknown_fields=True):
    update_info: NcclUpdateInfo


class UpdateWeightsIpc(Struct, kw_only=True, forbid_unknown_fields=True):
    update_info: dict[str, Any]


class NoArguments(Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class SleepForWeightSync(Struct, kw_only=True, forbid_unknown_fields=True):
    offload_kv: bool = True


class WakeForWeightSync(Struct, kw_only=True, forbid_unknown_fields=True):
    tags: list[str]


async def _start(updates: TrainerUpdates, call: StartWeightUpdate) -> None:
    if not call.is_checkpoint_format:
        raise InvalidRequestError("is_checkpoint_format=false (the engine's own tensor layout) is not supported: "
                                  "send checkpoint names", param="kwargs.is_checkpoint_format")
    await updates.start_round()


async def _receive(updates: TrainerUpdates, call: UpdateWeightsNccl) -> None:
    info = call.update_info
    for name in ("packed_buffer_size_bytes", "packed_num_buffers"):
        if getattr(info, name) < 1:
            raise InvalidRequestError(f"{name} must be positive, got {getattr(info, name)}",
                                      param=f"kwargs.update_info.{name}")
    packing = {"buffer_size_bytes": info.packed_buffer_size_bytes, "num_buffers": info.packed_num_buffers}
    await updates.receive_in_round(info.names, info.dtype_names, info.shapes, packing if info.packed else None)


async def _finish(updates: TrainerUpdates, call: NoArguments) -> None:
    await updates.finish_round(None)


async def _refuse_ipc(updates: TrainerUpdates, call: UpdateWeightsIpc) -> None:
    raise InvalidRequestError("update_weights_ipc hands over pickled CUDA IPC handles, which r3srv never unpickles: "
                              "sync over NCCL (update_weights_nccl)", param="method")


async def _keep_memory(updates: TrainerUpdates, call: SleepForWeightSync) -> None:
    """r3srv keeps the weights and KV resident across a sync (staging needs room for the new
    tensors either way); the frozen requests are retracted by the update and recompute after it."""


async def _check_wake(updates: TrainerUpdates, call: WakeForWeightSync) -> None:
    unknown = sorted(set(call.tags) - {"weights", "kv_cache"})
    if unknown:
        raise InvalidRequestError(f"tags: {unknown} unknown; known: weights, kv_cache", param="kwargs.tags")


@dataclass(frozen=True)
class RpcMethod:
    arguments: type[Struct]
    run: Callable[[TrainerUpdates, Any], Awaitable[None]]


METHODS: dict[str, RpcMethod] = {
    "skyrl_start_weight_update": RpcMethod(StartWeightUpdate, _start),
    "update_weights_nccl": RpcMethod(UpdateWeightsNccl, _receive),
    "skyrl_finish_weight_update": RpcMethod(NoArguments, _finish),
    "update_weights_ipc": RpcMethod(UpdateWeightsIpc, _refuse_ipc),
    "skyrl_sleep_for_weight_sync": RpcMethod(SleepForWeightSync, _keep_memory),
    "skyrl_wake_for_weight_sync": RpcMethod(WakeForWeightSync, _check_wake),
}


def arguments(method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The method's checked arguments; a 400 naming `method`, or the argument at fault."""
    entry = METHODS.get(method)
    if entry is None:
        raise InvalidRequestError(f"method {method!r} is not served: r3srv's /collective_rpc answers "
                                  f"{', '.join(sorted(METHODS))}", param="method")
    fields = [f.encode_name for f in msgspec.structs.fields(entry.arguments)]
    if len(args) > len(fields):
        raise InvalidRequestError(f"{method} takes at most {len(fields)} positional arguments, got {len(args)}",
                                  param="args")
    twice = sorted(set(fields[:len(args)]) & set(kwargs))
    if twice:
        raise InvalidRequestError(f"{method}: {twice[0]} given both positionally and by name", param="args")
    try:
        return msgspec.convert({**dict(zip(fields, args)), **kwargs}, entry.arguments, strict=True)
    except msgspec.ValidationError as exc:
        path = str(exc).rpartition("`$.")[2].rstrip("`") if "`$." in str(exc) else ""
        raise InvalidRequestError(f"{method}: {exc}", param=f"kwargs.{path}" if path else "kwargs") from None


async def collective_rpc(updates: TrainerUpdates, method: str, args: list[Any], kwargs: dict[str, Any]) -> list[None]:
    """Run `method` of the table (on every rank, as r3srv's weight commands do); one None per rank."""
    call = arguments(method, args, kwargs)
    await METHODS[method].run(updates, call)
    return [None] * updates.sync.tp_size

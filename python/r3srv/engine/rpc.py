"""collective_rpc: a fixed table of method names, each mapped onto r3srv's own weight commands.

vLLM's `collective_rpc(method, timeout, args, kwargs)` calls any method of its workers by name
(its development mode over HTTP; RL frameworks add theirs through a worker extension class, which
reaches into vLLM's model runner). r3srv answers only the names below, the weight-sync calls
those frameworks make, each run by r3srv's own trainer-update road (engine/weight_sync.py:
announced tensors checked against the served model, staged until every parameter arrived, then
one update between steps); any other name is an InvalidRequestError (a 400) naming `method`.
Arguments fill each method's Struct (positional ones in field order) and are checked there;
nothing is looked up by name on an object, nothing is unpickled, no callable a caller passed is
called except torch's own CUDA tensor rebuild. The answer is vLLM's: one result per rank.

| method | from | what |
|---|---|---|
| `skyrl_start_weight_update`, `update_weights_nccl`, `skyrl_finish_weight_update` | SkyRL's vLLM worker extension (HTTP) | vLLM's weight transfer round, packed chunks |
| `skyrl_sleep_for_weight_sync`, `skyrl_wake_for_weight_sync` | SkyRL | accepted; weights and KV stay resident |
| `update_weights_ipc` | SkyRL | refused: pickled CUDA IPC handles |
| `init_process_group` | OpenRLHF's vLLM worker extension | join the trainer's group (as rank_offset + rank) |
| `update_weight` | OpenRLHF | receive one broadcast tensor by name |
| `update_weight_cuda_ipc` | OpenRLHF | one tensor from a CUDA IPC handle (GPU only, in-process) |
| `init_weights_update_group`, `update_weights_from_distributed`, `destroy_weights_update_group` | SGLang's engine | the same group calls under SGLang's names (many tensors per call) |
| `update_weights_from_tensors` | in-process trainers (verl, NeMo-RL buckets) | `[(name, tensor), ...]` held in this process |

The HTTP route (server/routes/control.py) and the in-process fronts (r3srv.compat.vllm's LLM and
AsyncLLM) are thin callers of `collective_rpc`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from msgspec import Struct

from r3srv.engine.vllm_transfer import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from r3srv.engine.weight_sync import TrainerUpdates, named_tensor_metas
from r3srv.errors import InvalidRequestError

DEFAULT_GROUP = "weight_update_group"
OPENRLHF_TIMEOUT_MINUTES = 120  # OpenRLHF's default rendezvous and broadcast bound


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


class UpdateWeight(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    dtype: Any  # a torch.dtype or its name
    shape: Any  # a torch.Size or a list of ints
    empty_cache: bool = False


class UpdateWeightCudaIpc(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    dtype: Any
    shape: Any
    ipc_handles: Any = None  # {physical GPU id: (rebuild function, its arguments)}
    empty_cache: bool = False


class InitWeightsUpdateGroup(Struct, kw_only=True, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class InitProcessGroup(InitWeightsUpdateGroup, kw_only=True, forbid_unknown_fields=True):
    """OpenRLHF's: SGLang's fields in the same order, then its own two."""

    use_ray: bool = False
    timeout_minutes: float = OPENRLHF_TIMEOUT_MINUTES


class UpdateWeightsFromDistributed(Struct, kw_only=True, forbid_unknown_fields=True):
    names: list[str]
    dtypes: list[Any]
    shapes: list[Any]
    group_name: str = DEFAULT_GROUP
    weight_version: str | None = None


class DestroyWeightsUpdateGroup(Struct, kw_only=True, forbid_unknown_fields=True):
    group_name: str = DEFAULT_GROUP


class UpdateWeightsFromTensors(Struct, kw_only=True, forbid_unknown_fields=True):
    named_tensors: Any  # [(name, torch.Tensor), ...] or {name: tensor}
    weight_version: str | None = None


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


async def _join(updates: TrainerUpdates, call: InitProcessGroup | InitWeightsUpdateGroup) -> str:
    if getattr(call, "use_ray", False):
        raise InvalidRequestError("use_ray=True (ray.util.collective groups) is not supported by r3srv: use a "
                                  "torch.distributed group (use_ray=False)", param="use_ray")
    if isinstance(call, InitProcessGroup):
        updates.sync.timeout = call.timeout_minutes * 60.0
    return await updates.sync.join(master_address=call.master_address, master_port=call.master_port,
                                   rank_offset=call.rank_offset, world_size=call.world_size,
                                   group_name=call.group_name, backend=call.backend)


async def _update_weight(updates: TrainerUpdates, call: UpdateWeight) -> str:
    named = named_tensor_metas([call.name], [str(call.dtype)], [list(call.shape)], dtypes_param="dtype")
    return await updates.receive(_only_group(updates), named)


async def _update_weight_cuda_ipc(updates: TrainerUpdates, call: UpdateWeightCudaIpc) -> str:
    if updates.sync.device.type != "cuda":
        raise InvalidRequestError("update_weight_cuda_ipc hands over CUDA IPC handles, which a CPU engine cannot "
                                  "open: send the tensor with update_weight", param="method")
    tensor = _rebuild_cuda_tensor(call.ipc_handles, updates.sync.device)
    if tensor.dtype != _dtype(call.dtype) or list(tensor.shape) != list(call.shape):
        raise InvalidRequestError(f"{call.name}: the handle holds a {tensor.dtype} tensor of shape "
                                  f"{list(tensor.shape)}, not the announced {call.dtype} {list(call.shape)}",
                                  param="ipc_handles")
    return await updates.take({call.name: tensor})


async def _update_from_distributed(updates: TrainerUpdates, call: UpdateWeightsFromDistributed) -> str:
    named = named_tensor_metas(call.names, [str(d) for d in call.dtypes], [list(s) for s in call.shapes],
                               dtypes_param="dtypes")
    return await updates.receive(call.group_name, named, weight_version=call.weight_version)


async def _leave(updates: TrainerUpdates, call: DestroyWeightsUpdateGroup) -> None:
    await updates.sync.leave(call.group_name)


async def _update_from_tensors(updates: TrainerUpdates, call: UpdateWeightsFromTensors) -> str:
    pairs = call.named_tensors.items() if isinstance(call.named_tensors, dict) else call.named_tensors
    tensors: dict[str, torch.Tensor] = {}
    for item in pairs:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise InvalidRequestError("named_tensors must be (name, torch.Tensor) pairs", param="named_tensors")
        tensors[item[0]] = item[1]
    return await updates.take(tensors, weight_version=call.weight_version)


@dataclass(frozen=True)
class RpcMethod:
    arguments: type[Struct]
    run: Callable[[TrainerUpdates, Any], Awaitable[Any]]


METHODS: dict[str, RpcMethod] = {
    "skyrl_start_weight_update": RpcMethod(StartWeightUpdate, _start),
    "update_weights_nccl": RpcMethod(UpdateWeightsNccl, _receive),
    "skyrl_finish_weight_update": RpcMethod(NoArguments, _finish),
    "update_weights_ipc": RpcMethod(UpdateWeightsIpc, _refuse_ipc),
    "skyrl_sleep_for_weight_sync": RpcMethod(SleepForWeightSync, _keep_memory),
    "skyrl_wake_for_weight_sync": RpcMethod(WakeForWeightSync, _check_wake),
    "init_process_group": RpcMethod(InitProcessGroup, _join),
    "update_weight": RpcMethod(UpdateWeight, _update_weight),
    "update_weight_cuda_ipc": RpcMethod(UpdateWeightCudaIpc, _update_weight_cuda_ipc),
    "init_weights_update_group": RpcMethod(InitWeightsUpdateGroup, _join),
    "update_weights_from_distributed": RpcMethod(UpdateWeightsFromDistributed, _update_from_distributed),
    "destroy_weights_update_group": RpcMethod(DestroyWeightsUpdateGroup, _leave),
    "update_weights_from_tensors": RpcMethod(UpdateWeightsFromTensors, _update_from_tensors),
}


def arguments(method: Any, args: tuple | list, kwargs: dict[str, Any] | None) -> Any:
    """The method's checked arguments; an InvalidRequestError naming `method`, or the argument at fault."""
    entry = METHODS.get(method) if isinstance(method, str) else None
    if entry is None:
        shown = method if isinstance(method, str) else f"a {type(method).__name__}"
        raise InvalidRequestError(f"method {shown!r} is not served: r3srv's collective_rpc answers "
                                  f"{', '.join(sorted(METHODS))} (a method name, never a callable)", param="method")
    kwargs = dict(kwargs or {})
    fields = [f.encode_name for f in msgspec.structs.fields(entry.arguments)]
    if len(args) > len(fields):
        raise InvalidRequestError(f"{method} takes at most {len(fields)} positional arguments, got {len(args)}",
                                  param="args")
    twice = sorted(set(fields[: len(args)]) & set(kwargs))
    if twice:
        raise InvalidRequestError(f"{method}: {twice[0]} given both positionally and by name", param="args")
    try:
        return msgspec.convert({**dict(zip(fields, args)), **kwargs}, entry.arguments, strict=True)
    except msgspec.ValidationError as exc:
        path = str(exc).rpartition("`$.")[2].rstrip("`") if "`$." in str(exc) else ""
        raise InvalidRequestError(f"{method}: {exc}", param=f"kwargs.{path}" if path else "kwargs") from None


async def collective_rpc(updates: TrainerUpdates, method: Any, args: tuple | list = (),
                         kwargs: dict[str, Any] | None = None) -> list[Any]:
    """Run `method` of the table (on every rank, as r3srv's weight commands do); one result per rank."""
    call = arguments(method, args, kwargs)
    result = await METHODS[method].run(updates, call)
    return [result] * updates.sync.tp_size


def _only_group(updates: TrainerUpdates) -> str:
    """OpenRLHF's update_weight names no group: the one its init_process_group made."""
    groups = list(updates.sync.sync.groups)  # rank 0's WeightSync (every rank joins the same groups)
    if len(groups) != 1:
        raise InvalidRequestError(f"update_weight needs exactly one weight update group, found {len(groups)}: "
                                  "call init_process_group first", param="method")
    return groups[0]


def _dtype(value: Any) -> torch.dtype:
    dtype = value if isinstance(value, torch.dtype) else getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"{value!r} is not a torch dtype", param="dtype")
    return dtype


def _rebuild_cuda_tensor(ipc_handles: Any, device: torch.device) -> torch.Tensor:
    """OpenRLHF's handle: {physical GPU id: (torch's rebuild_cuda_tensor, its arguments)}; only
    that function is called, with the device index set to this engine's (as OpenRLHF does)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(ipc_handles, dict) or not ipc_handles:
        raise InvalidRequestError("ipc_handles must map GPU ids to (rebuild_cuda_tensor, args)", param="ipc_handles")
    handle = ipc_handles.get(_physical_gpu_id(device), next(iter(ipc_handles.values())))
    if not (isinstance(handle, tuple | list) and len(handle) == 2 and handle[0] is rebuild_cuda_tensor
            and isinstance(handle[1], tuple | list)):
        raise InvalidRequestError("ipc_handles may only name torch's rebuild_cuda_tensor", param="ipc_handles")
    func, args = handle[0], list(handle[1])
    if len(args) < 7 or args[0] is not torch.Tensor or not isinstance(args[5], torch.dtype):
        raise InvalidRequestError("ipc_handles: not the arguments of a plain CUDA tensor", param="ipc_handles")
    args[6] = device.index or 0
    return func(*args)


def _physical_gpu_id(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)

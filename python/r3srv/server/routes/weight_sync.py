"""Weights pushed by a trainer, and vLLM's pause/resume names (all behind --enable-weight-updates).

SGLang's: POST /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /update_weights_from_tensor (CUDA IPC; on the CPU a 400).
vLLM 0.33's (rl/online/api_router.py): POST /pause?mode=abort|wait|keep, /resume,
/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
/shutdown_weight_transfer_engine, /update_weight_version, GET /weight_info. /update_weights
also takes prime-rl's {"weight_dir": ...} (a directory of safetensors shards): the body's
field decides. Every update follows /update_weights_from_disk's rules for requests in flight.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import msgspec
from litestar import Request, get, post
from litestar.params import JSONBody, QueryParameter

from r3srv.engine.tensor_unpickler import load_named_cuda_tensors
from r3srv.engine.weight_sync import PRIME_RL_GROUP, VLLM_GROUP, TrainerUpdates, named_tensor_metas
from r3srv.errors import InvalidRequestError
from r3srv.server.protocol import weight_sync as w
from r3srv.server.confinement import confinement
from r3srv.server.declare import Access, Feature, Fleet, Ranks
from r3srv.server.routes.common import server_state
from r3srv.server.routes.weights import update_weights_from_dir

VLLM_PAUSE_MODES = ("abort", "wait", "keep")


def trainer_updates(request: Request[Any, Any, Any]) -> TrainerUpdates:
    state = server_state(request)
    app_state = request.app.state
    if "trainer_updates" not in app_state:
        app_state["trainer_updates"] = TrainerUpdates(state.engine, timeout=state.options.weight_sync_timeout)
    return app_state["trainer_updates"]


async def _join(request: Request[Any, Any, Any], *, address_param: str = "master_address", **group: Any) -> str:
    """Join the trainer's group at `master_address`, once --allowed-trainer-hosts admits it (a 403
    naming `address_param` otherwise: server/confinement.py)."""
    hosts = confinement(request).trainer_hosts
    await asyncio.to_thread(hosts.check, group["master_address"], address_param)
    return await trainer_updates(request).sync.join(**group)


# ---------------------------------------------------------------- SGLang's


@post("/init_weights_update_group", status_code=200, summary="Join the trainer's process group (rank 0 broadcasts)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def init_weights_update_group(
    data: JSONBody[w.InitWeightsUpdateGroupRequest], request: Request[Any, Any, Any]
) -> w.SglangResult:
    message = await _join(request, master_address=data.master_address, master_port=data.master_port,
                          rank_offset=data.rank_offset, world_size=data.world_size, group_name=data.group_name,
                          backend=data.backend)
    return w.SglangResult(success=True, message=message)


@post("/destroy_weights_update_group", status_code=200, summary="Leave a weight update group",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def destroy_weights_update_group(
    data: JSONBody[w.DestroyWeightsUpdateGroupRequest], request: Request[Any, Any, Any]
) -> w.SglangResult:
    await trainer_updates(request).sync.leave(data.group_name)  # waits for a receive under way
    return w.SglangResult(success=True, message=f"left {data.group_name!r}")


@post("/update_weights_from_distributed", status_code=200, summary="Receive named tensors broadcast by the trainer",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def update_weights_from_distributed(
    data: JSONBody[w.UpdateWeightsFromDistributedRequest], request: Request[Any, Any, Any]
) -> w.SglangResult:
    named = named_tensor_metas(data.names, data.dtypes, data.shapes, dtypes_param="dtypes")
    message = await trainer_updates(request).receive(
        data.group_name, named, weight_version=data.weight_version, abort_running=data.abort_all_requests)
    return w.SglangResult(success=True, message=message)


@post("/update_weights_from_tensor", status_code=200, summary="Take CUDA tensors of a trainer on the same GPU",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def update_weights_from_tensor(
    data: JSONBody[w.UpdateWeightsFromTensorRequest], request: Request[Any, Any, Any]
) -> w.SglangResult:
    updates = trainer_updates(request)
    if updates.sync.device.type != "cuda":
        raise InvalidRequestError(
            "/update_weights_from_tensor hands over CUDA IPC handles, and this server runs on the "
            f"{updates.sync.device.type}: use /update_weights_from_distributed (gloo) or /update_weights_from_disk",
            param="serialized_named_tensors")
    if updates.sync.tp_size > 1:  # SGLang takes one payload per rank there, each opened on its rank's device
        raise InvalidRequestError(
            "/update_weights_from_tensor is not supported under tensor parallelism yet: use "
            "/update_weights_from_distributed", param="serialized_named_tensors")
    if len(data.serialized_named_tensors) != 1:
        raise InvalidRequestError(
            f"serialized_named_tensors needs one payload per tensor-parallel rank (1), got "
            f"{len(data.serialized_named_tensors)}", param="serialized_named_tensors")
    pairs = load_named_cuda_tensors(data.serialized_named_tensors[0])
    tensors = dict(pairs)
    if len(tensors) != len(pairs):
        raise InvalidRequestError("serialized_named_tensors names a tensor twice", param="serialized_named_tensors")
    message = await updates.take(tensors, weight_version=data.weight_version, abort_running=data.abort_all_requests)
    return w.SglangResult(success=True, message=message)


@post("/update_weight_version", status_code=200, summary="Rename the served weights (vLLM's and SGLang's)",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def update_weight_version(
    data: JSONBody[w.UpdateWeightVersionRequest], request: Request[Any, Any, Any]
) -> w.WeightVersionResult:
    state = server_state(request)
    if data.abort_all_requests:
        await state.abort_all()
    await state.engine.rename_weights(data.new_version)
    return w.WeightVersionResult(success=True, new_version=data.new_version)


@get("/weight_info", summary="The served weights' version (vLLM's)",
     access=Access.ADMIN, fleet=Fleet.ONE_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def weight_info(request: Request[Any, Any, Any]) -> w.WeightInfo:
    return w.WeightInfo(weight_version=server_state(request).engine.weight_version)


# ---------------------------------------------------------------- prime-rl's NCCL broadcaster


@post("/init_broadcaster", status_code=200, summary="Join prime-rl's NCCL weight broadcast (its server's route)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES,
      ranks=Ranks(world="inference_world_size", lowest_offset=0))
async def init_broadcaster(
    data: JSONBody[w.PrimeRlInitBroadcasterRequest], request: Request[Any, Any, Any]
) -> w.VllmStatus:
    """prime-rl's worker joins vLLM's store rendezvous as rank_offset + its rank + 1 of
    inference_world_size + 1 (the trainer is rank 0); /update_weights then receives its pushes."""
    updates = trainer_updates(request)
    backend = "nccl" if updates.sync.device.type == "cuda" else "gloo"  # gloo: the CPU's stand-in
    if updates.sync.has_group(PRIME_RL_GROUP):  # a restarted trainer: join its new rendezvous
        await updates.sync.leave(PRIME_RL_GROUP)
    await _join(request, address_param="host", master_address=data.host, master_port=data.port, rank_offset=data.rank_offset + 1,
                world_size=data.inference_world_size + 1, group_name=PRIME_RL_GROUP, backend=backend,
                rendezvous="vllm", rendezvous_timeout=data.timeout)
    return w.VllmStatus(status="ok")


# ---------------------------------------------------------------- vLLM's


@post("/pause", status_code=200, summary="Pause generation (vLLM's modes: abort, wait, keep)",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def pause(
    request: Request[Any, Any, Any],
    mode: Annotated[str, QueryParameter(name="mode")] = "abort",
    clear_cache: Annotated[bool, QueryParameter(name="clear_cache")] = True,
) -> w.VllmStatus:
    state = server_state(request)
    if mode not in VLLM_PAUSE_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(VLLM_PAUSE_MODES)}, got {mode!r}", param="mode")
    await state.engine.pause_generation(mode)
    if clear_cache and mode != "keep":  # vLLM ignores it in keep mode too: the frozen sequences hold their KV
        await state.engine.reset_prefix_cache()
    return w.VllmStatus(status="paused")


@post("/resume", status_code=200, summary="Resume generation after /pause",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def resume(request: Request[Any, Any, Any]) -> w.VllmStatus:
    await server_state(request).engine.continue_generation()
    return w.VllmStatus(status="resumed")


@post("/init_weight_transfer_engine", status_code=200, summary="Join the trainer's process group (vLLM's name)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def init_weight_transfer_engine(
    data: JSONBody[w.VllmInitRequest], request: Request[Any, Any, Any]
) -> w.VllmMessage:
    info = data.init_info
    backend = "nccl" if trainer_updates(request).sync.device.type == "cuda" else "gloo"  # gloo: the CPU's stand-in
    await _join(request, address_param="init_info.master_address", master_address=info.master_address,
                master_port=info.master_port, rank_offset=info.rank_offset, world_size=info.world_size, group_name=VLLM_GROUP, backend=backend,
                rendezvous="vllm", packing=info.packing())
    return w.VllmMessage(message="Weight transfer initialized")


@post("/shutdown_weight_transfer_engine", status_code=200, summary="Leave the trainer's process group (vLLM's name)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def shutdown_weight_transfer_engine(request: Request[Any, Any, Any]) -> w.VllmMessage:
    await trainer_updates(request).sync.leave(VLLM_GROUP)
    return w.VllmMessage(message="Weight transfer shut down")


@post("/start_weight_update", status_code=200, summary="Begin a weight update round (vLLM's)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def start_weight_update(request: Request[Any, Any, Any]) -> w.VllmMessage:
    await trainer_updates(request).start_round()
    return w.VllmMessage(message="Weight update started")


@post("/start_draft_weight_update", status_code=200, summary="Refused: r3srv serves no draft model",
      access=Access.ADMIN, fleet=Fleet.ONE_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def start_draft_weight_update(request: Request[Any, Any, Any]) -> w.VllmMessage:
    raise InvalidRequestError("/start_draft_weight_update: r3srv serves no draft model")


@post("/finish_weight_update", status_code=200, summary="Apply the tensors received since /start_weight_update",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.WEIGHT_UPDATES)
async def finish_weight_update(data: JSONBody[w.VllmFinishRequest], request: Request[Any, Any, Any]) -> w.VllmMessage:
    await trainer_updates(request).finish_round(data.weight_version)
    return w.VllmMessage(message="Weight update finished")


@post("/update_weights", status_code=200,
      summary="vLLM's weight transfer ({update_info}) or prime-rl's disk update ({weight_dir})",
      access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.WEIGHT_UPDATES)
async def update_weights(data: JSONBody[dict[str, Any]], request: Request[Any, Any, Any]) -> w.VllmMessage:
    if "weight_dir" in data:
        body = msgspec.convert(data, w.PrimeRlUpdateRequest)
        updates = trainer_updates(request)
        if updates.sync.has_group(PRIME_RL_GROUP):  # prime-rl's NCCL mode: the directory holds a marker only
            await updates.receive_announced(PRIME_RL_GROUP, weight_version=body.weight_dir)
            return w.VllmMessage(message="Weights updated")
        if body.weight_dir is None:
            raise InvalidRequestError("weight_dir null (prime-rl's NCCL transport) is not supported: name a directory",
                                      param="weight_dir")
        await update_weights_from_dir(request, body.weight_dir, param="weight_dir")
        return w.VllmMessage(message="Weights updated")
    if "update_info" not in data:
        raise InvalidRequestError("/update_weights needs weight_dir (a directory of safetensors shards) or update_info",
                                  param="update_info")
    info = msgspec.convert(data, w.VllmUpdateRequest).update_info
    if not isinstance(info, w.VllmUpdateInfo):
        raise InvalidRequestError("update_info as a list is not supported: send one object", param="update_info")
    await trainer_updates(request).receive_in_round(info.names, info.dtype_names, info.shapes)
    return w.VllmMessage(message="Weights updated")


"""LoRA adapters: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (plain-text
answers, as vLLM's), SGLang's POST /load_lora_adapter, /load_lora_adapter_from_tensors (a trainer
on the same GPU pushes an adapter from memory) and /unload_lora_adapter (LoRAUpdateOutput), and
r3srv's /load_lora_adapter_from_distributed (a trainer broadcasts an adapter over the
weight-update group, as full weights go). Served with --enable-lora; on a data-parallel fleet
every replica loads and unloads (a broadcast push: every replica joins the trainer's one group
with ranks of its own and receives the same broadcasts). An adapter
is then selected by `model` on vLLM's routes and by `lora_path` on SGLang's /generate, and
listed by /v1/models with its parent (docs/lora.md)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import torch
from litestar import MediaType, Request, Response, post
from litestar.params import JSONBody

from r3srv.engine.tensor_unpickler import load_cuda_tensor_dict
from r3srv.engine.weight_sync import named_tensor_metas
from r3srv.errors import InvalidRequestError
from r3srv.server import protocol as p
from r3srv.server.confinement import confinement
from r3srv.server.declare import Access, Feature, Fleet
from r3srv.server.routes.common import server_state
from r3srv.server.routes.weight_sync import trainer_updates

_LORA = dict(access=Access.ADMIN, fleet=Fleet.EVERY_REPLICA, requires=Feature.LORA)


def _check_name(request: Request[Any, Any, Any], name: str, *, replace: bool) -> None:
    state = server_state(request)
    if not replace and name in state.lora_names():
        raise InvalidRequestError(f"the LoRA adapter {name!r} has already been loaded; to replace it in place, set "
                                  "load_inplace", param="lora_name")
    if name == state.model_name:
        raise InvalidRequestError(f"{name!r} is the served model's name", param="lora_name")


async def _load(request: Request[Any, Any, Any], name: str, path: str, *, replace: bool, pinned: bool = False):
    state = server_state(request)
    _check_name(request, name, replace=replace)
    path = await asyncio.to_thread(confinement(request).weight_paths.confine, path, "lora_path")  # a 403 outside
    # the adapter is read off the event loop (the command reads it again on the core thread: the
    # directory may change between the two reads, and the core's read is the one that counts)
    from r3srv.lora.adapter import read_dir

    await asyncio.to_thread(read_dir, path)
    return await state.engine.load_lora_adapter(name, path, pinned=pinned)


@post("/v1/load_lora_adapter", status_code=200, media_type=MediaType.TEXT,
      summary="Load (or with load_inplace replace) a LoRA adapter from a PEFT save (vLLM)", **_LORA)
async def vllm_load_lora_adapter(
    data: JSONBody[p.VllmLoadLoraRequest], request: Request[Any, Any, Any]
) -> Response[str]:
    await _load(request, data.lora_name, data.lora_path, replace=data.load_inplace)
    return Response(f"Success: LoRA adapter '{data.lora_name}' added successfully.", media_type=MediaType.TEXT)


@post("/v1/unload_lora_adapter", status_code=200, media_type=MediaType.TEXT,
      summary="Unload a LoRA adapter (vLLM)", **_LORA)
async def vllm_unload_lora_adapter(
    data: JSONBody[p.VllmUnloadLoraRequest], request: Request[Any, Any, Any]
) -> Response[str]:
    await server_state(request).engine.unload_lora_adapter(data.lora_name)
    return Response(f"Success: LoRA adapter '{data.lora_name}' removed successfully.", media_type=MediaType.TEXT)


@post("/load_lora_adapter", status_code=200, summary="Load a LoRA adapter from a PEFT save (SGLang)", **_LORA)
async def sglang_load_lora_adapter(data: JSONBody[p.SglangLoadLoraRequest],
                                   request: Request[Any, Any, Any]) -> p.SglangLoraUpdateOutput:
    await _load(request, data.lora_name, data.lora_path, replace=False, pinned=data.pinned)
    return _loaded(request)


@post("/load_lora_adapter_from_tensors", status_code=200,
      summary="Load a LoRA adapter a trainer on the same GPU pushes from memory (SGLang)", **_LORA)
async def sglang_load_lora_adapter_from_tensors(data: JSONBody[p.SglangLoadLoraFromTensorsRequest],
                                                request: Request[Any, Any, Any]) -> p.SglangLoraUpdateOutput:
    state = server_state(request)
    param = "serialized_named_tensors"
    if state.engine.device.type != "cuda":
        raise InvalidRequestError(
            f"/load_lora_adapter_from_tensors hands over CUDA IPC handles, and this server runs on the "
            f"{state.engine.device.type}: use /load_lora_adapter with a PEFT save", param=param)
    if len(data.serialized_named_tensors) != 1:  # TP servers: from disk or over the group
        raise InvalidRequestError(f"{param} needs one payload per tensor-parallel rank (1), got "
                                  f"{len(data.serialized_named_tensors)}", param=param)
    _check_name(request, data.lora_name, replace=False)
    adapter = await asyncio.to_thread(_pushed_adapter, data)  # off the event loop: opens and copies tensors
    await state.engine.load_lora_adapter(data.lora_name, adapter=adapter, pinned=data.pinned)
    return _loaded(request)


@post("/load_lora_adapter_from_distributed", status_code=200,
      summary="Load or replace a LoRA adapter a trainer broadcasts over the weight-update group (r3srv's)",
      access=Access.ADMIN, fleet=Fleet.OWN_RANK, requires=Feature.LORA)
async def load_lora_adapter_from_distributed(data: JSONBody[p.LoadLoraFromDistributedRequest],
                                             request: Request[Any, Any, Any]) -> p.SglangLoraUpdateOutput:
    """The trainer's push between rollout batches: a name already loaded is replaced in place
    (its version + 1, its cached prefixes dropped), under the rules of any replacement (requests
    running under it must finish, or pause with mode retract or keep first). The announcement is
    checked against the model (names, rank, shapes) before any tensor is received."""
    from r3srv.lora.adapter import from_tensors

    state = server_state(request)
    _check_name(request, data.lora_name, replace=True)
    named = named_tensor_metas(data.names, data.dtypes, data.shapes, dtypes_param="dtypes")
    announced = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in named.metas.items()}
    state.engine.core.lora.check(from_tensors(data.config_dict, announced, param="names"), "names")
    tensors = await trainer_updates(request).receive_adapter(data.group_name, named)
    adapter = await asyncio.to_thread(from_tensors, data.config_dict, tensors, "names")
    await state.engine.load_lora_adapter(data.lora_name, adapter=adapter, pinned=data.pinned)
    return _loaded(request)


def _pushed_adapter(data: p.SglangLoadLoraFromTensorsRequest) -> Any:
    from r3srv.lora.manager import adapter_from_tensors

    # copied off the trainer's memory at once (to the host, as an adapter read from disk is held):
    # the adapter outlives the handles
    tensors = {name: t.detach().to("cpu", copy=True)
               for name, t in load_cuda_tensor_dict(data.serialized_named_tensors[0]).items()}
    if data.expected_checksums is not None:
        _check_sums(tensors, data.expected_checksums)
    return adapter_from_tensors(data.config_dict, tensors)


def _check_sums(tensors: dict[str, Any], expected: dict[str, str]) -> None:
    """SGLang's expected_checksums: the sha256 of each tensor's bytes, the same names both ways."""
    def digest(t: Any) -> str:
        return hashlib.sha256(t.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()

    wrong = sorted(set(expected) ^ set(tensors)) + sorted(n for n in expected if n in tensors and
                                                          digest(tensors[n]) != expected[n])
    if wrong:
        raise InvalidRequestError(f"expected_checksums: the pushed tensors differ (missing, extra or changed: "
                                  f"{wrong[:5]})", param="expected_checksums")


@post("/unload_lora_adapter", status_code=200, summary="Unload a LoRA adapter (SGLang)", **_LORA)
async def sglang_unload_lora_adapter(data: JSONBody[p.SglangUnloadLoraRequest],
                                     request: Request[Any, Any, Any]) -> p.SglangLoraUpdateOutput:
    await server_state(request).engine.unload_lora_adapter(data.lora_name)
    return _loaded(request)


def _loaded(request: Request[Any, Any, Any]) -> p.SglangLoraUpdateOutput:
    lora = server_state(request).engine.core.lora
    adapters = {name: entry.path or "__tensor__" for name, entry in lora.entries.items()}
    return p.SglangLoraUpdateOutput(success=True, loaded_adapters=adapters)

"""Discovery, health and load endpoints as SGLang 0.5.23 serves them, for the SGLang router and RL frameworks.

GET /server_info (/get_server_info): the server's configuration and live state; GET /model_info
(/get_model_info): the model and the weights now served; GET /get_weight_version;
GET /health_generate: a real one-token generation (503 if it fails); GET /v1/loads: SGLang's
per-replica load; GET /get_load: the older list that sglang-router 0.3.2's load monitor reads.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timezone
from typing import Annotated, Any

from litestar import MediaType, Request, Response, get
from litestar.params import FromQuery, QueryParameter

import r3srv
from r3srv.errors import InvalidRequestError
from r3srv.outputs import OutputKind
from r3srv.sampling_params import SamplingParams
from r3srv.server.protocol import fleet as fp
from r3srv.server.declare import Access, Fleet
from r3srv.server.errors import error_response
from r3srv.server.generation import ServerState
from r3srv.server.routes.common import server_state

# How long /health_generate waits for its token (a busy engine batches it with the others).
HEALTH_GENERATE_TIMEOUT_S = 20.0
# SGLang's LoadSnapshot sections; r3srv has only the core one, so the others are never present.
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def _tokenizer_path(state: ServerState) -> str | None:
    return state.engine.model_path if state.engine.tokenizer is not None else None


@get(["/server_info", "/get_server_info"], summary="Server configuration and live state (SGLang's)",
     access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def server_info(request: Request[Any, Any, Any]) -> fp.ServerInfo:
    state = server_state(request)
    engine = state.engine
    cfg = engine.config
    stats = engine.stats()
    parallel = cfg.parallel
    options = state.options
    return fp.ServerInfo(
        model_path=engine.model_path,
        tokenizer_path=_tokenizer_path(state),
        served_model_name=state.model_name,
        weight_version=engine.weight_version,
        host=options.host,
        port=options.port,
        nnodes=parallel.nnodes,
        node_rank=parallel.node_rank,
        gpu_id_step=1,
        base_gpu_id=engine.device.index or 0,
        tp_size=parallel.tensor_parallel_size,
        dp_size=parallel.data_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        ep_size=parallel.tensor_parallel_size if parallel.enable_expert_parallel else 1,  # EP spans the TP ranks
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        context_length=engine.max_model_len,
        page_size=cfg.block_size,
        max_total_num_tokens=stats.kv_blocks_total * cfg.block_size,
        max_running_requests=cfg.max_num_seqs,
        max_prefill_tokens=cfg.max_num_batched_tokens,
        chunked_prefill_size=cfg.max_num_batched_tokens,
        disable_radix_cache=not cfg.enable_prefix_caching,
        random_seed=cfg.seed,
        enable_return_routed_experts=engine.enable_return_routed_experts,
        enable_memory_saver=options.enable_memory_saver,
        enable_weight_updates=state.options.enable_weight_updates,
        is_paused=stats.paused is not None,
        internal_states=[{"memory_released": list(stats.released_memory), "paused": stats.paused}],
        version=r3srv.__version__,
    )


@get(["/model_info", "/get_model_info"], summary="The served model and its weights (SGLang's)",
     access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def model_info(request: Request[Any, Any, Any]) -> fp.ModelInfo:
    state = server_state(request)
    engine = state.engine
    mc = engine.model_config
    return fp.ModelInfo(
        model_path=engine.model_path,
        served_model_name=state.model_name,
        tokenizer_path=_tokenizer_path(state),
        is_generation=True,
        preferred_sampling_params=None,
        weight_version=engine.weight_version,
        load_format=None,
        reasoning_parser=None,
        tool_call_parser=None,
        disaggregation_mode="null",
        has_image_understanding=False,
        has_audio_understanding=False,
        model_type=mc.model_type,
        architectures=[mc.architecture],
    )


@get("/get_weight_version", summary="The version of the weights new requests run on",
     access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def get_weight_version(request: Request[Any, Any, Any]) -> fp.WeightVersion:
    return fp.WeightVersion(weight_version=server_state(request).engine.weight_version)


@get("/health_generate", summary="200 once a real one-token generation succeeds, else 503", media_type=MediaType.TEXT,
     access=Access.PROBE, fleet=Fleet.ONE_REPLICA)
async def health_generate(request: Request[Any, Any, Any]) -> Response[bytes]:
    engine = server_state(request).engine
    stats = engine.stats()
    # Held requests would wait for /continue_generation or /resume_memory_occupation: say why at once.
    if stats.paused is not None:
        return error_response(503, f"generation is paused (mode {stats.paused}): /continue_generation resumes it")
    if stats.released_memory:
        return error_response(503, f"memory released ({', '.join(stats.released_memory)}): "
                                   "/resume_memory_occupation takes it back")
    tokenizer = engine.tokenizer
    prompt = [getattr(tokenizer, "bos_token_id", None) or 0]
    params = SamplingParams(max_tokens=1, temperature=0.0, return_routed_experts=False)

    async def one_token() -> int:
        outputs = engine.generate(prompt, params, f"health_generate-{uuid.uuid4().hex}",
                                  output_kind=OutputKind.FINAL_ONLY)
        async for out in outputs:
            if out.finished:
                return len(out.outputs[0].token_ids)
        return 0

    try:
        produced = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except Exception as exc:  # a dead engine, a timeout: unhealthy, never a 500
        return error_response(503, f"health generation failed: {type(exc).__name__}: {exc}")
    if produced != 1:
        return error_response(503, f"health generation produced {produced} tokens instead of 1")
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


def _load(state: ServerState) -> fp.Load:
    stats = state.engine.stats()
    block_size = state.engine.config.block_size
    used = stats.kv_blocks_used * block_size
    total = stats.kv_blocks_total * block_size
    usage = used / total if total else 0.0
    return fp.Load(
        timestamp=time.time(),
        dp_rank=0,
        num_running_reqs=stats.num_running,
        num_waiting_reqs=stats.num_waiting,
        num_waiting_uncached_tokens=None,
        num_used_tokens=used,
        num_total_tokens=total,
        num_active_tokens=used,
        num_prealloc_ready_tokens=None,
        max_total_num_tokens=total,
        max_running_requests=state.engine.config.max_num_seqs,
        token_usage=usage,
        gen_throughput=None,
        cache_hit_rate=stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0,
        utilization=usage,
        total_prefill_uncached_tokens=None,
        total_prefill_busy_us=None,
        decode_moments=None,
    )


@get("/v1/loads", summary="Load of this replica, as SGLang's /v1/loads (JSON)",
     access=Access.PROBE, fleet=Fleet.ONE_REPLICA)
async def v1_loads(
    request: Request[Any, Any, Any],
    dp_rank: FromQuery[int | None] = None,
    include: FromQuery[str | None] = None,
    response_format: Annotated[str | None, QueryParameter(name="format")] = None,
) -> fp.Loads:
    if include is not None:
        unknown = {s.strip() for s in include.split(",")} - LOAD_SECTIONS
        if unknown:
            raise InvalidRequestError(f"Invalid include sections: {sorted(unknown)}. "
                                      f"Valid options: {sorted(LOAD_SECTIONS)}", param="include")
    if response_format not in (None, "json"):
        raise InvalidRequestError(f"format={response_format!r} is not served: use json, or scrape /metrics "
                                  "for Prometheus", param="format")
    if dp_rank not in (None, 0):
        raise InvalidRequestError(f"dp_rank {dp_rank} does not exist: a replica has one rank, 0", param="dp_rank")
    device = server_state(request).engine.device
    return fp.Loads(
        timestamp=datetime.now(timezone.utc).isoformat(),
        version=r3srv.__version__,
        accelerator=_accelerator_name(device),
        num_accelerators=1,
        loads=[_load(server_state(request))],
    )


@get("/get_load", summary="Load as older SGLang answered it (sglang-router 0.3.2's load monitor)",
     access=Access.PROBE, fleet=Fleet.ONE_REPLICA)
async def get_load(request: Request[Any, Any, Any]) -> list[fp.LegacyLoad]:
    load = _load(server_state(request))
    return [fp.LegacyLoad(dp_rank=0, num_reqs=load.num_running_reqs + load.num_waiting_reqs,
                          num_waiting_reqs=load.num_waiting_reqs, num_tokens=load.num_used_tokens)]


def _accelerator_name(device: Any) -> str | None:
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(device)

"""Litestar route handlers, one module per API area."""

from r3srv.server.routes.fleet import (
    get_load,
    get_weight_version,
    health_generate,
    model_info,
    server_info,
    v1_loads,
)
from r3srv.server.routes.inference import abort_requests, generate
from r3srv.server.routes.info import detokenize, health, list_models, metrics, tokenize, version
from r3srv.server.routes.openai import chat_completions, completions
from r3srv.server.routes.sglang import sglang_abort_request, sglang_generate
from r3srv.server.routes.weight_sync import TRAINER_ROUTES
from r3srv.server.routes.weights import (
    continue_generation,
    flush_cache,
    is_paused,
    pause_generation,
    release_memory_occupation,
    reset_prefix_cache,
    resume_memory_occupation,
    update_weights_from_disk,
)

ROUTE_HANDLERS = [
    completions,
    chat_completions,
    generate,
    abort_requests,
    sglang_generate,
    sglang_abort_request,
    list_models,
    health,
    version,
    tokenize,
    detokenize,
    metrics,
    update_weights_from_disk,
    reset_prefix_cache,
    flush_cache,
    release_memory_occupation,
    resume_memory_occupation,
    pause_generation,
    continue_generation,
    is_paused,
    *TRAINER_ROUTES,
    server_info,
    model_info,
    get_weight_version,
    health_generate,
    v1_loads,
    get_load,
]

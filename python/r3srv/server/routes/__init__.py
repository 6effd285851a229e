"""Litestar route handlers, one module per API area."""

from r3srv.server.routes.inference import abort_requests, generate
from r3srv.server.routes.info import detokenize, health, list_models, metrics, tokenize, version
from r3srv.server.routes.openai import chat_completions, completions

ROUTE_HANDLERS = [
    completions,
    chat_completions,
    generate,
    abort_requests,
    list_models,
    health,
    version,
    tokenize,
    detokenize,
    metrics,
]

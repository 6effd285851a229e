"""Model list, health, version, tokenizer endpoints and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from litestar import MediaType, Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody

import r3srv
from r3srv.errors import InvalidRequestError
from r3srv.offload import run_sized
from r3srv.server import protocol as p
from r3srv.server.declare import Access, Fleet
from r3srv.server.errors import error_response
from r3srv.server.metrics import CONTENT_TYPE
from r3srv.server.routes.common import server_state


@get("/v1/models", summary="List the served model (with its routed-experts layout)",
     access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def list_models(request: Request[Any, Any, Any]) -> p.ModelList:
    state = server_state(request)
    engine = state.engine
    info = engine.routed_experts_info
    card = p.ModelCard(
        id=state.model_name,
        root=state.model_name,
        max_model_len=engine.max_model_len,
        weight_version=engine.weight_version if state.options.enable_weight_updates else p.UNSET,
        routed_experts=p.RoutedExpertsInfo(
            num_layers=int(info["num_layers"]),
            top_k=int(info["top_k"]),
            num_experts=int(info["num_experts"]),
            dtype=str(info["dtype"]),
            moe_layers=[int(i) for i in info["moe_layers"]],
            images=p.ImageRowsInfo(**info["images"]) if info.get("images") else p.UNSET,
        )
        if info
        else p.UNSET,
    )
    # each LoRA adapter is a model of its own, its parent the served one (as vLLM lists them)
    adapters = [p.ModelCard(id=name, root=entry.path or name, parent=state.model_name, max_model_len=engine.max_model_len)
                for name, entry in (engine.core.lora.entries.items() if engine.core.lora is not None else ())]
    return p.ModelList(data=[card, *adapters])


@get("/health", summary="200 while the engine loop runs; 503 once it has died (the server then exits non-zero)",
     include_in_schema=True, media_type=MediaType.TEXT,
     responses={503: ResponseSpec(p.ErrorResponse, description="The engine loop has died", generate_examples=False)},
     access=Access.PROBE, fleet=Fleet.ONE_REPLICA)
async def health(request: Request[Any, Any, Any]) -> Response[bytes]:
    if not server_state(request).engine.is_running:
        return error_response(503, "the engine loop is not running")
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


@get("/version", summary="r3srv version", access=Access.PROBE, fleet=Fleet.ONE_REPLICA)
async def version() -> p.VersionResponse:
    return p.VersionResponse(version=r3srv.__version__)


@post("/tokenize", status_code=200, summary="Tokenize a prompt or chat messages",
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def tokenize(data: JSONBody[p.TokenizeRequest], request: Request[Any, Any, Any]) -> p.TokenizeResponse:
    state = server_state(request)
    state.check_model(data.model)
    tokenizer = state.tokenizer()

    def render_and_encode() -> list[int]:
        # A rendered chat template already holds its specials; a raw prompt gets the tokenizer's.
        text = data.text(state.engine.input_processor.render_chat)
        return list(tokenizer.encode(text, add_special_tokens=data.with_special_tokens))

    size = len(data.prompt or "") + sum(m.content_chars() for m in data.messages or ())
    try:
        tokens = await run_sized(size, render_and_encode)
    except InvalidRequestError:
        raise
    except Exception as exc:
        raise InvalidRequestError(f"cannot tokenize: {exc}", param="messages") from exc
    return p.TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens)


@post("/detokenize", status_code=200, summary="Turn token ids back into text",
      access=Access.INFERENCE, fleet=Fleet.ONE_REPLICA)
async def detokenize(data: JSONBody[p.DetokenizeRequest], request: Request[Any, Any, Any]) -> p.DetokenizeResponse:
    state = server_state(request)
    state.check_model(data.model)
    tokenizer = state.tokenizer()
    vocab = state.engine.model_config.vocab_size
    bad = next((t for t in data.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(param="tokens", problem=f" holds {bad}, outside the vocabulary [0, {vocab})")
    try:
        text = tokenizer.decode(data.tokens)
    except Exception as exc:  # ids outside the vocabulary
        raise InvalidRequestError(f"cannot detokenize: {exc}", param="tokens") from exc
    return p.DetokenizeResponse(prompt=text)


@get("/metrics", summary="Prometheus metrics", include_in_schema=False, access=Access.PROBE, fleet=Fleet.ONE_REPLICA)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)

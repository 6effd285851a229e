"""The OpenAI-compatible HTTP server (Litestar + msgspec); `r3srv serve` runs it under uvicorn.

Module map: protocol (every request/response Struct), app (factory, lifespan, request
counting), routes/ (one module per API area), generation (driving engine requests,
disconnects), responses and streaming (engine outputs -> JSON bodies / SSE chunks),
errors (OpenAI-shaped errors), metrics (Prometheus).
"""

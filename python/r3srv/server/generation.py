"""Driving engine requests from the HTTP layer: start, iterate, stop on disconnect, clean up.

`Generation` wraps one `engine.generate` stream. `start` pulls the first output so
request errors (bad offset, prompt too long) surface as a 400 before any response
byte is sent. `close` is idempotent and always called: it closes the engine's
generator and aborts the request, so a client that goes away frees its KV blocks
and routed-experts rows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio
import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from r3srv.errors import InvalidRequestError
from r3srv.outputs import OutputKind, RequestOutput
from r3srv.sampling_params import SamplingParams
from r3srv.server import rows_encoding
from r3srv.server.chat_output import ChatParsers
from r3srv.server.declare import Feature
from r3srv.server.errors import ModelNotFoundError
from r3srv.server.metrics import ServerMetrics
from r3srv.server_options import ServerOptions
from r3srv.vision.inputs import MultiModalPrompt
from r3srv.vision.media import MediaPolicy

T = TypeVar("T")

# Arrays at least this big are encoded on a worker thread (the Rust encoder
# releases the GIL), so a 100k-token response never stalls other clients.
_OFFLOAD_ENCODE_BYTES = 1 << 20


@dataclass
class ServerState:
    """What every route needs, kept in `app.state.server`."""

    engine: Any
    model_name: str
    metrics: ServerMetrics
    options: ServerOptions = field(default_factory=ServerOptions)  # the serve flags' (server_options.py)
    chat_parsers: ChatParsers = field(default_factory=ChatParsers)  # the parsers the options name
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where images may come from (options.media_policy())
    live: set[Generation] = field(default_factory=set)  # requests in flight, for abort_all

    @property
    def features(self) -> frozenset[Feature]:
        """The optional route groups this server serves (server/declare.py)."""
        options = self.options
        flags = ((Feature.WEIGHT_UPDATES, options.enable_weight_updates), (Feature.SLEEP_MODE, options.enable_sleep_mode),
                 (Feature.COLLECTIVE_RPC, options.enable_collective_rpc), (Feature.LORA, self.engine.core.lora is not None))
        return frozenset(feature for feature, on in flags if on)

    async def stop_serving(self) -> None:
        """The server is stopping (SIGTERM): a weight update or memory release still waiting for
        the requests in flight is refused (503, the trainer retries elsewhere) rather than run in
        the stop's grace period, then every request in flight ends (finish_reason "abort")."""
        self.engine.refuse_waiting_commands()
        await self.abort_all()

    async def abort_all(self) -> None:
        """End every request in flight (finish_reason "abort"): on shutdown, so streams close
        promptly, and for SGLang's /abort_request with abort_all."""
        for gen in list(self.live):
            await self.engine.abort(gen.request_id)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (vLLM selects adapters by model name), None for the
        served model itself; ModelNotFoundError (404) for any other name."""
        if not model or model == self.model_name:
            return None
        if model in self.lora_names():
            return model
        raise ModelNotFoundError(model)

    def check_loras(self, names: list[str | None], param: str) -> None:
        """InvalidRequestError naming `param` for an adapter name that is not loaded (None: the base)."""
        unknown = sorted({n for n in names if n is not None} - set(self.lora_names()))
        if unknown:
            why = "is not loaded" if self.engine.core.lora is not None else "asked for, but the server was started " \
                                                                          "without --enable-lora"
            raise InvalidRequestError(f"LoRA adapter {unknown[0]!r} {why}", param=param)

    def lora_names(self) -> list[str]:
        """The LoRA adapters loaded (none without --enable-lora)."""
        lora = self.engine.core.lora
        return [] if lora is None else lora.names()

    def weight_version(self, output: RequestOutput) -> str | UnsetType:
        """What a choice says of the weights that produced it: only where weights can change."""
        if not self.options.enable_weight_updates or output.weight_version is None:
            return UNSET
        return output.weight_version

    @staticmethod
    def lora_fields(output: RequestOutput) -> dict[str, Any]:
        """What a choice says of the LoRA adapter that produced it: nothing for the base model."""
        if output.lora_name is None:
            return {}
        return {"lora_name": output.lora_name, "lora_version": output.lora_version}

    def tokenizer(self) -> Any:
        """The engine's tokenizer; a 400 for text APIs when the checkpoint has none."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer (no tokenizer.json): use /inference/v1/generate with token ids"
            )
        return tokenizer

    def experts_encoding(self, requested: str | None, route_default: str) -> str:
        """The routed-experts encoding of one response (server/rows_encoding.py)."""
        return rows_encoding.choose(requested, self.options.routed_experts_encoding, route_default)

    async def encode_experts(self, array: np.ndarray | None, encoding: str = "npy", start: int = 0) -> str | None:
        """A response's routed_experts value in `encoding` (rows_encoding.py), as a `msgspec.Raw`
        of its JSON text; `start` is the request's prompt offset (prime-rl's form carries it).

        The Rust core writes the JSON text itself (the quotes of a string, or the whole dict)
        and msgspec copies the bytes as they are, instead of scanning megabytes of base64 for
        characters to escape (docs/benchmarks.md). Typed `str` for the call sites' Structs,
        whose schema names the values; on the wire it is the JSON written here.
        """
        if array is None:
            return None
        if array.nbytes >= _OFFLOAD_ENCODE_BYTES:
            text = await asyncio.to_thread(rows_encoding.encode, array, encoding, start)
        else:
            text = rows_encoding.encode(array, encoding, start)
        self.metrics.routed_experts_bytes.inc(rows_encoding.payload_bytes(text))
        return cast(str, msgspec.Raw(text))  # Raw keeps a reference to the str: no copy


class Generation:
    """One engine request, from its first output to its last."""

    def __init__(
        self,
        state: ServerState,
        route: str,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool = True,
        multimodal: MultiModalPrompt | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.state = state
        self.route = route
        self.request_id = request_id
        # Streams get DELTA outputs (per step, only the new tokens); the others FINAL_ONLY (no
        # per-step outputs, no loop wake-ups).
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        self._stream = state.engine.generate(prompt, params, request_id, output_kind=kind, multimodal=multimodal,
                                             lora_name=lora_name)
        self._delta = stream
        self._generated_tokens = 0
        self._started = time.perf_counter()
        self.last: RequestOutput | None = None
        self.finished = False
        self.closed = False
        state.live.add(self)

    async def start(self) -> RequestOutput:
        """Submit the request and wait for its first output; request errors raise here."""
        try:
            first = await self._stream.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"engine ended request {self.request_id} without an output") from None
        self._observe(first)
        return first

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output from the first (already pulled by `start`) to the finished one."""
        assert self.last is not None, "start() first"
        yield self.last
        if self.finished:
            return
        async for output in self._stream:
            self._observe(output)
            yield output
            if self.finished:
                return

    async def final(self) -> RequestOutput:
        output = self.last
        async for output in self.outputs():
            pass
        assert output is not None
        return output

    def _observe(self, output: RequestOutput) -> None:
        self.last = output
        now = time.perf_counter()
        metrics = self.state.metrics
        if self._delta or output.finished:
            self._generated_tokens += sum(len(c.token_ids) for c in output.outputs)
        if output.finished and not self.finished:
            self.finished = True
            # The engine times the first token, so streamed and non-streamed requests are measured alike.
            ttft = output.metrics.get("first_token_latency_s")
            if ttft is not None:
                metrics.ttft.labels(self.route).observe(ttft)
            metrics.e2e_latency.labels(self.route).observe(now - self._started)
            metrics.prompt_tokens.inc(len(output.prompt_token_ids))
            metrics.generation_tokens.inc(self._generated_tokens)

    async def close(self) -> None:
        """Idempotent; shielded so it also runs when the caller's scope is being cancelled."""
        if self.closed:
            return
        self.closed = True
        self.state.live.discard(self)
        with anyio.CancelScope(shield=True):
            try:
                await self._stream.aclose()
            except RuntimeError:  # still inside a start another task is cancelling: abort below
                pass
            finally:
                if not self.finished:
                    await self.state.engine.abort(self.request_id)


async def start_all(
    state: ServerState,
    route: str,
    prompts: list[str | list[int]],
    params: SamplingParams | list[SamplingParams],
    request_id: str | list[str],
    *,
    stream: bool = True,
    multimodal: list[MultiModalPrompt | None] | None = None,
    lora: str | None | list[str | None] = None,
) -> list[Generation]:
    """Submit every prompt of a request together (so they batch), then wait for each first output
    (with stream=True a DELTA output, with stream=False the finished one). `params` and
    `request_id` are one for all prompts (ids get a "-i" suffix) or one per prompt.

    If one prompt is refused, the others are aborted only once every start has settled
    (closing a generator another task is still inside fails), and the refusal is raised.
    """
    ids = request_id if isinstance(request_id, list) else (
        [f"{request_id}-{i}" for i in range(len(prompts))] if len(prompts) > 1 else [request_id])
    each = params if isinstance(params, list) else [params] * len(prompts)
    images = multimodal or [None] * len(prompts)  # each prompt's images, expanded (server/images.py)
    loras = lora if isinstance(lora, list) else [lora] * len(prompts)  # the adapter of each prompt
    gens = [Generation(state, route, p, sp, rid, stream=stream, multimodal=mm, lora_name=name)
            for p, sp, rid, mm, name in zip(prompts, each, ids, images, loras)]
    try:
        results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    except BaseException:  # cancelled: gather has cancelled the starts and they have ended
        await close_all(gens)
        raise
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        await close_all(gens)
        raise failed
    return gens


async def close_all(gens: list[Generation]) -> None:
    for g in gens:
        await g.close()


async def merged_outputs(gens: list[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every generation, in arrival order."""
    if len(gens) == 1:
        async for output in gens[0].outputs():
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for output in gen.outputs():
                await queue.put((i, output))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnect(receive: Any, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None.

    The request body has been read already, so the next ASGI message can only be
    `http.disconnect` (uvicorn also sends it once the response is complete).
    """
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None

"""The async front used by the HTTP server.

One background thread owns the engine and runs its step loop (the event loop never
runs model code). Coroutines hand it requests and aborts through a thread-safe command
queue; it hands back each request's outputs through the request's own
asyncio.Queue (via `call_soon_threadsafe`). All requests in flight batch together in
the same steps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator

from r3srv.engine.llm_engine import EngineStats, LLMEngine, PreparedRequest
from r3srv.errors import InvalidRequestError, R3srvError
from r3srv.models.loader import NamedTensors, plan_named_tensors
from r3srv.offload import run_sized
from r3srv.outputs import CompletionOutput, OutputKind, RequestOutput, merge_deltas
from r3srv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(R3srvError):
    """The engine thread stopped (shut down, or an unexpected error outside a step)."""


class _Sink:
    """Where the engine thread delivers one request's outputs."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


class _Reply:
    """A future the engine thread resolves for a coroutine (weight updates, cache resets)."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()

    def ok(self, value: object) -> None:
        self._resolve(lambda: self.future.set_result(value))

    def fail(self, exc: BaseException) -> None:
        self._resolve(lambda: self.future.set_exception(exc))

    def _resolve(self, set_it) -> None:
        def apply() -> None:
            if not self.future.done():  # the waiter may have been cancelled
                set_it()

        try:
            self.loop.call_soon_threadsafe(apply)
        except RuntimeError:  # the waiter's loop is closed
            pass


# SGLang's abort, retract and in_place; vLLM's keep (in place, but a weight update retracts the
# frozen sequences rather than wait for them) and wait (pause once the requests in flight finished)
PAUSE_MODES = ("abort", "retract", "in_place", "keep", "wait")


def _aborted_before_start(prep: PreparedRequest) -> RequestOutput:
    """The final output of a request aborted while it waited for a weight update (it never ran)."""
    outs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(prep.params.n)]
    return RequestOutput(prep.request_id, prep.prompt, prep.prompt_token_ids, outs, finished=True)


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        # Config errors (ConfigError) raise here, on the caller's thread, before the loop starts.
        self._engine = LLMEngine.from_kwargs(model, **kwargs)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self.on_dead: list = []  # called (from another thread) with the error when a tensor-parallel rank fails
        # Weight updates and memory release/resume wait, in order, for the requests in flight to
        # finish: (kind, args, reply). Requests added meanwhile, or while memory is released,
        # are held, and start after them (on the new weights, in the resumed memory).
        self._exclusive: collections.deque[tuple[str, tuple, _Reply]] = collections.deque()
        self._held: list[PreparedRequest] = []
        # pause_generation's mode while generation is paused (no step runs), else None
        self._paused: str | None = None
        self._stopping = False
        # Set (under _lock) once the engine thread stops taking commands: from then on nothing
        # may be queued, and every waiter registered before was failed by _fail_all.
        self._closed = False
        self._replies: set[_Reply] = set()  # weight updates and cache resets not answered yet
        self._thread = threading.Thread(target=self._run, name="r3srv-engine", daemon=True)
        self._thread.start()
        if self._engine.executor is not None:  # a tensor-parallel rank that fails ends the engine
            self._engine.executor.on_failure.append(self._worker_failed)

    # -- facts the server needs -----------------------------------------------------------
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def model_config(self):
        return self._engine.model_config

    @property
    def config(self):
        """The engine's EngineConfig, finalized (KV pool size, block size, ...)."""
        return self._engine.config

    @property
    def dtype(self):
        """The torch dtype the weights and the KV cache are held in."""
        return self._engine.model.dtype

    @property
    def model_path(self) -> str | None:
        """The checkpoint directory of the weights now served (None: the built-in model)."""
        return self._engine.model_path

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def device(self):
        return self._engine.device

    @property
    def enable_return_routed_experts(self) -> bool:
        return self._engine.enable_return_routed_experts

    @property
    def routed_experts_info(self) -> dict | None:
        return self._engine.routed_experts_info

    @property
    def weight_version(self) -> str:
        """The version of the weights requests admitted from now on run on."""
        return self._engine.weight_version

    @property
    def is_running(self) -> bool:
        """False once shut down or after the engine thread died (a /health probe can report it)."""
        return self._dead is None and not self._stopping and self._thread.is_alive()

    def stats(self) -> EngineStats:
        stats = self._engine.stats()  # plain counters: a slightly stale read is fine
        held = len(self._held)  # requests held for a weight update or released memory wait like the others
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + held, paused=self._paused)

    # -- requests -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; the last has finished=True.

        CUMULATIVE: each output holds everything so far; when the consumer falls behind it
        gets the newest only. DELTA: each holds what is new; outputs that pile up while the
        consumer is busy are merged. FINAL_ONLY: one output, the finished one.

        Pass add_special_tokens=False for a prompt rendered from a chat template (it holds
        its specials already; the tokenizer would add a second BOS).

        Invalid requests raise InvalidRequestError before anything is yielded. Leaving
        the iteration early (aclose, cancellation) aborts the request and frees its blocks.
        """
        self._check_alive()
        size = len(prompt) if isinstance(prompt, (str, list, tuple)) else 0  # anything else fails validation
        prepared: PreparedRequest = await run_sized(
            size, self._engine.prepare_request, request_id, prompt, sampling_params,
            add_special_tokens=add_special_tokens,
        )
        prepared.output_kind = output_kind
        sink = _Sink(asyncio.get_running_loop())
        with self._lock:  # registered and queued atomically with respect to _fail_all
            self._check_open()
            if prepared.request_id in self._sinks:
                raise InvalidRequestError(f"request_id {prepared.request_id!r} is already in flight", param="request_id")
            self._sinks[prepared.request_id] = sink
            self._commands.put(("add", prepared))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                # When the consumer lags, hand it one output for all that piled up.
                while not isinstance(item, BaseException) and not item.finished and not sink.queue.empty():
                    newer = sink.queue.get_nowait()
                    delta = output_kind is OutputKind.DELTA and not isinstance(newer, BaseException)
                    item = merge_deltas(item, newer) if delta else newer
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", prepared.request_id))

    async def update_weights(
        self, path: str | NamedTensors, *, abort_running: bool = False, weight_version: str | None = None
    ) -> None:
        """Load new weights of the same architecture from a checkpoint directory, or from
        tensors a trainer sent by name (received in full), as an RL policy update.

        Requests in flight finish on the old weights first (abort_running=True aborts them
        instead), so no sequence mixes two policies in its KV or its routed experts; requests
        that arrive meanwhile wait and run on the new weights. The prefix cache is emptied.
        Raises ConfigError (weights unchanged) for a checkpoint that is not this model's
        architecture, InvalidRequestError if another update is under way. Outputs of requests
        that start later carry `weight_version` (default: `path`).
        """
        await self._ask("update", path if isinstance(path, NamedTensors) else str(path), weight_version, abort_running)

    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        """The parameters tensors so named, shaped and typed leave unfilled; a ConfigError naming
        any that cannot fill the served model (unknown name, wrong shape or dtype). Reads shapes only."""
        return plan_named_tensors(self._engine.model, named, complete=False).missing

    async def rename_weights(self, weight_version: str) -> None:
        """Name the served weights `weight_version` in the outputs of requests admitted from now on."""
        await self._ask("rename", weight_version)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were forgotten."""
        return await self._ask("reset_prefix_cache")

    async def release_memory(self, tags: list[str] | None = None) -> list[str]:
        """LLMEngine.release_memory once the requests in flight have finished; requests that
        arrive meanwhile, or until everything is resumed, are held. Returns what is released."""
        return await self._ask("release", tags)

    async def resume_memory(self, tags: list[str] | None = None) -> list[str]:
        """LLMEngine.resume_memory (after any update or release queued before it); once nothing
        is released, held requests start. Returns what is still released."""
        return await self._ask("resume", tags)

    @property
    def released_memory(self) -> list[str]:
        return sorted(self._engine.released_memory)

    async def pause_generation(self, mode: str = "abort") -> dict[str, int]:
        """Stop stepping until continue_generation (SGLang's modes): "abort" ends every request
        in flight (finish_reason "abort"); "retract" sends running sequences back to waiting
        with their KV freed, so a weight update can run at once and they resume on the new
        weights, recomputing their tokens (and rows) first; "in_place" keeps everything as it
        is (an update then waits for continue_generation and the requests to finish, so it is
        refused); "keep" (vLLM's) keeps everything as it is too, but a weight update retracts
        the frozen sequences, as "retract" would have, and runs at once; "wait" (vLLM's) pauses
        once the requests in flight have finished. Requests that arrive meanwhile wait.
        Returns {"aborted": n, "retracted": n}."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
        return await self._ask("pause_after_requests" if mode == "wait" else "pause", mode)

    async def continue_generation(self) -> bool:
        """Step again after pause_generation; returns whether generation was paused."""
        return await self._ask("continue")

    @property
    def paused(self) -> str | None:
        """pause_generation's mode while paused, else None."""
        return self._paused

    async def _ask(self, kind: str, *args):
        """Queue a command whose answer comes back through a _Reply, and wait for it."""
        self._check_alive()
        reply = _Reply(asyncio.get_running_loop())
        with self._lock:
            self._check_open()
            self._replies.add(reply)
            self._commands.put((kind, (*args, reply)))
        return await reply.future

    def _check_alive(self) -> None:
        if self._dead is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self._dead or 'shut down'}")

    def _check_open(self) -> None:
        """Under _lock: the engine thread still takes commands."""
        if self._closed:
            raise EngineDeadError(f"the engine is not running: {self._dead or 'shut down'}")

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight; its generator ends with finish_reason "abort". False if unknown."""
        with self._lock:
            known = request_id in self._sinks
        if known:
            self._commands.put(("abort", request_id))
        return known

    def shutdown(self) -> None:
        """Stop the engine thread; requests still in flight fail with EngineDeadError. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._commands.put(("stop", None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self._engine.shutdown()

    def _worker_failed(self, error: BaseException) -> None:
        self._dead = error  # is_running turns False: /health answers 503
        for callback in self.on_dead:
            callback(error)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                # updates and releases wait until no sequence holds KV (paused and retracted, or drained)
                if self._exclusive and (not engine.has_unfinished() or (self._paused and not engine.scheduler.running)):
                    self._run_exclusive()
                stepping = engine.has_unfinished() and self._paused is None
                # Block while idle or paused; otherwise take whatever arrived since the last step.
                cmd = self._commands.get() if not stepping else self._next_command()
                while cmd is not None:
                    if cmd[0] == "stop":
                        self._fail_all(EngineDeadError("the engine was shut down"))
                        return
                    self._handle(cmd)
                    cmd = self._next_command()
                if engine.has_unfinished() and self._paused is None:
                    step = engine.step()
                    for out in step.outputs:
                        self._deliver(out)
                    for rid, exc in step.failed:
                        logger.error("request %s failed in an engine step: %r", rid, exc)
                        self._deliver_error(rid, exc)
        except BaseException as exc:  # a bug outside a step: fail loudly, never hang clients
            logger.exception("the engine thread died")
            self._dead = exc
            self._fail_all(EngineDeadError(f"the engine thread died: {exc!r}"))

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, cmd) -> None:
        kind, arg = cmd
        engine = self._engine
        if kind == "add":
            if self._exclusive or engine.released_memory:
                self._held.append(arg)
                return
            try:
                engine.add_prepared(arg)
            except Exception as exc:
                self._deliver_error(arg.request_id, exc)
        elif kind == "abort":
            out = engine.abort_request(arg)
            held = next((p for p in self._held if p.request_id == arg), None)
            if held is not None:
                self._held.remove(held)
                out = _aborted_before_start(held)
            if out is not None:
                self._deliver(out)
        elif kind == "update":
            path, version, abort_running, reply = arg
            if any(op == "update" for op, _, _ in self._exclusive):
                self._answer(reply, exc=InvalidRequestError("a weight update is already under way", param="model_path"))
                return
            if self._paused == "keep" and engine.scheduler.running and not abort_running:
                engine.retract_running()  # they recompute on the new weights: no sequence mixes two policies
            if self._paused == "in_place" and engine.scheduler.running and not abort_running:
                self._answer(reply, exc=InvalidRequestError(
                    "generation is paused in place and requests hold KV of the current weights: pause with "
                    "mode=retract or abort, or update with abort_all_requests", param="model_path"))
                return
            self._exclusive.append(("update", (path, version), reply))
            if abort_running:
                for rid in list(engine.requests):
                    self._handle(("abort", rid))
        elif kind in ("release", "resume", "pause_after_requests"):
            value, reply = arg
            self._exclusive.append((kind, (value,), reply))
        elif kind == "rename":
            engine.weight_version, reply = arg
            self._answer(reply)
        elif kind == "reset_prefix_cache":
            self._answer(arg[0], engine.reset_prefix_cache())
        elif kind == "pause":
            mode, reply = arg
            aborted = retracted = 0
            if mode == "abort":
                for rid in [*engine.requests, *(p.request_id for p in self._held)]:
                    self._handle(("abort", rid))
                    aborted += 1
            elif mode == "retract":
                retracted = engine.retract_running()
            self._paused = mode
            self._answer(reply, {"aborted": aborted, "retracted": retracted})
        elif kind == "continue":
            was_paused, self._paused = self._paused is not None, None
            self._answer(arg[0], was_paused)

    def _run_exclusive(self) -> None:
        """Runs once no request is in flight: every queued update / release / resume in
        order, then the held requests, unless memory is still released."""
        engine = self._engine
        while self._exclusive:
            kind, args, reply = self._exclusive.popleft()
            try:
                if kind == "update":
                    engine.update_weights(*args)
                    logger.info("loaded new weights from %s", args[0])
                    value = None
                elif kind == "pause_after_requests":
                    self._paused = args[0]
                    value = {"aborted": 0, "retracted": 0}
                elif kind == "release":
                    value = engine.release_memory(*args)
                    logger.info("released memory: %s", value)
                else:
                    value = engine.resume_memory(*args)
                    logger.info("resumed memory; still released: %s", value)
            except Exception as exc:
                logger.error("%s failed: %s", kind, exc)
                self._answer(reply, exc=exc)
            else:
                self._answer(reply, value)
        if not engine.released_memory:
            held, self._held = self._held, []
            for prep in held:
                self._handle(("add", prep))

    def _answer(self, reply: _Reply, value: object = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._replies.discard(reply)
        if exc is None:
            reply.ok(value)
        else:
            reply.fail(exc)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
        if sink is not None:
            sink.put(out)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        engine = self._engine
        for rid in list(engine.requests):
            engine.abort_request(rid)
        self._exclusive.clear()
        self._held = []
        with self._lock:
            self._closed = True
            sinks, self._sinks = self._sinks, {}
            replies, self._replies = self._replies, set()
        for sink in sinks.values():
            sink.put(exc)
        for reply in replies:
            reply.fail(exc)

"""The async front used by the HTTP server.

Three parts on three sides: the input processor runs on the caller's event loop (or a
worker thread for large inputs), the engine core on one background thread (the event loop
never runs model code), the output processor on another (detokenizing and output building
never delay a step). Coroutines hand the core typed commands through a thread-safe queue;
the core hands its step updates to the output thread, which delivers each request's
outputs through the request's own asyncio.Queue (via `call_soon_threadsafe`) and sends
stop strings back to the core as commands. All requests in flight batch together.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from r3srv.config import engine_config
from r3srv.engine.commands import PAUSE_MODES, Command, commands_as_methods  # noqa: F401 (PAUSE_MODES: metrics)
from r3srv.engine.core import EngineCore, EngineFacts, EngineStats
from r3srv.engine.input_processor import EngineRequest, InputProcessor, prompt_and_images
from r3srv.engine.output_processor import OutputProcessor, StopSequence
from r3srv.engine.requests import CoreOutputs
from r3srv.engine_options import with_option_keywords
from r3srv.errors import InvalidRequestError, R3srvError
from r3srv.kernels.openmp_team import end_team_here
from r3srv.models.loader import NamedTensors
from r3srv.offload import OFFLOAD_MIN_SIZE, run_sized
from r3srv.outputs import OutputKind, RequestOutput, merge_deltas
from r3srv.sampling_params import SamplingParams
from r3srv.vision.inputs import MultiModalPrompt

logger = logging.getLogger(__name__)


class EngineDeadError(R3srvError):
    """The engine thread stopped (shut down, or an unexpected error outside a step)."""


class _Sink:
    """Where the output thread delivers one request's outputs."""

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


class EngineState(enum.Enum):
    """Where the engine stands (one value, under AsyncLLM._lock). Released memory is the
    core's own fact (EngineCore.released_memory): requests wait while any is released."""

    RUNNING = "running"
    PAUSED_ABORT = "abort"  # paused: pause_generation's mode is the value
    PAUSED_RETRACT = "retract"
    PAUSED_IN_PLACE = "in_place"
    PAUSED_KEEP = "keep"
    PAUSED_WAIT = "wait"
    STOPPING = "stopping"  # shutdown asked; the core thread has not stopped yet
    STOPPED = "stopped"  # the core thread takes no more commands
    DEAD = "dead"  # the core thread died of an error outside a step

    @property
    def pause_mode(self) -> str | None:
        return self.value if self in _PAUSED else None

    @property
    def accepts_requests(self) -> bool:
        return self is EngineState.RUNNING or self in _PAUSED


_PAUSED = (EngineState.PAUSED_ABORT, EngineState.PAUSED_RETRACT, EngineState.PAUSED_IN_PLACE,
           EngineState.PAUSED_KEEP, EngineState.PAUSED_WAIT)


# -- items for the core thread (the output thread sends StopSequence too) ---------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Asked:
    """A control command (engine/commands.py) and where its answer goes."""

    command: Command
    reply: _Reply


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class _RefuseWaiting:
    """The server is stopping: control commands that wait for the requests in flight are refused."""

    error: BaseException


# -- items for the output thread, in the order the core thread produced them ------------
@dataclass(frozen=True, slots=True)
class _Register:
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class _AbortedBeforeStart:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Close:
    error: BaseException


class _OnCoreThread:
    """An AsyncLLM as its control commands reach it, on the core thread (commands.Target). The
    AsyncLLM hands it accessors of its own state, so nothing here reaches for its private names."""

    def __init__(self, core: EngineCore, *, state: Callable[[], EngineState],
                 set_state: Callable[[EngineState], None], abort: Callable[[str], None],
                 held: Callable[[], list[EngineRequest]], exclusive: Callable[[], Iterable[_Asked]]) -> None:
        self.core = core
        self._state, self._set_state, self._abort = state, set_state, abort
        self._held, self._exclusive = held, exclusive

    @property
    def pause_mode(self) -> str | None:
        return self._state().pause_mode

    def set_pause_mode(self, mode: str | None) -> None:
        self._set_state(EngineState.RUNNING if mode is None else EngineState(mode))

    def abort_request(self, request_id: str) -> None:
        self._abort(request_id)

    def held_request_ids(self) -> list[str]:
        return [prep.request_id for prep in self._held()]

    def is_waiting(self, kind: type[Command]) -> bool:
        return any(isinstance(asked.command, kind) for asked in self._exclusive())


@commands_as_methods("queued")
class AsyncLLM(EngineFacts):
    """The engine behind the server; its control methods (update_weights, pause_generation, ...)
    come from engine/commands.py, each queued for the core thread and awaited."""

    @with_option_keywords
    def __init__(self, model: str | None = None, **options) -> None:
        """Every engine option (r3srv.config) as a keyword. Config errors (ConfigError) raise
        here, on the caller's thread, before the threads start."""
        self.core = EngineCore(engine_config(model, **options))
        end_team_here()  # the steps run on the core thread's team alone (kernels/openmp_team.py)
        core = self.core
        self.input_processor = InputProcessor.of(core)  # any thread may call it
        self._output = OutputProcessor(core.tokenizer)  # the output thread's alone
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # to the core thread
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()  # to the output thread
        self._lock = threading.Lock()
        self._state = EngineState.RUNNING
        self._death: BaseException | None = None  # why the core thread died (state DEAD)
        self._sinks: dict[str, _Sink] = {}
        self._drain_waiters: list[_Reply] = []  # requests_drained() calls, answered once _sinks is empty
        self.on_dead: list = []  # called (from another thread) with the error when a tensor-parallel rank fails
        # Core thread only. Weight updates and memory release/resume wait, in order, for the
        # requests in flight to finish; requests added meanwhile, or while memory is released,
        # are held, and start after them (on the new weights, in the resumed memory).
        self._exclusive: collections.deque[_Asked] = collections.deque()
        self._held: list[EngineRequest] = []
        self._refusing: BaseException | None = None  # why waiting commands are refused (stopping)
        self._replies: set[_Reply] = set()  # control commands not answered yet
        self._target = _OnCoreThread(  # what control commands reach (core thread only)
            core, state=lambda: self._state, set_state=self._set_state, abort=self._abort,
            held=lambda: self._held, exclusive=lambda: self._exclusive)
        self._output_thread = threading.Thread(target=self._run_output, name="r3srv-output", daemon=True)
        self._thread = threading.Thread(target=self._run, name="r3srv-engine", daemon=True)
        self._output_thread.start()
        self._thread.start()
        if self.core.executor.ranks is not None:  # a tensor-parallel rank that fails ends the engine
            self.core.executor.ranks.on_failure.append(self._worker_failed)

    # -- facts the server needs (EngineFacts: tokenizer, model_config, max_model_len, ...) --
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def is_running(self) -> bool:
        """False once shut down or after the engine thread died (a /health probe can report it)."""
        return self._state.accepts_requests and self._thread.is_alive()

    def stats(self) -> EngineStats:
        stats = self.core.stats()  # plain counters: a slightly stale read is fine
        held = len(self._held)  # requests held for a weight update or released memory wait like the others
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + held, paused=self._state.pause_mode)

    # -- requests -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        multimodal: MultiModalPrompt | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; the last has finished=True.

        CUMULATIVE: each output holds everything so far; when the consumer falls behind it
        gets the newest only. DELTA: each holds what is new; outputs that pile up while the
        consumer is busy are merged. FINAL_ONLY: one output, the finished one.

        Pass add_special_tokens=False for a prompt rendered from a chat template (it holds
        its specials already; the tokenizer would add a second BOS). An image prompt comes with
        `multimodal` (InputProcessor.expand_images), `prompt` its expanded token ids, or as
        vLLM's prompt dict with multi_modal_data (input_processor.prompt_and_images).

        Invalid requests raise InvalidRequestError before anything is yielded. Leaving
        the iteration early (aclose, cancellation) aborts the request and frees its blocks.
        """
        self._check_alive()
        self.core.lora_ref(lora_name)  # an unknown adapter: refused here (the core checks again when it adds it)
        prompt, images = prompt_and_images(prompt)
        size = len(prompt) if isinstance(prompt, (str, list, tuple)) else 0  # anything else fails validation
        if images:  # decoding and preprocessing images is work for a worker thread
            size = max(size, OFFLOAD_MIN_SIZE)
        prepared: EngineRequest = await run_sized(
            size, self.input_processor.process, request_id, prompt, sampling_params, add_special_tokens=add_special_tokens,
            images=images, multimodal=multimodal,
            lora_name=lora_name,
        )
        prepared.output_kind = output_kind
        sink = _Sink(asyncio.get_running_loop())
        with self._lock:  # registered and queued atomically with respect to closing
            self._check_open()
            if prepared.request_id in self._sinks:
                raise InvalidRequestError(f"request_id {prepared.request_id!r} is already in flight", param="request_id")
            self._sinks[prepared.request_id] = sink
            self._outputs.put(_Register(prepared))  # before any of its outputs: the core sees it after this
            self._commands.put(AddRequest(prepared))
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
                self._commands.put(Abort(prepared.request_id))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests in flight (added and not finished, held ones included)."""
        with self._lock:
            return len(self._sinks)

    async def requests_drained(self) -> None:
        """Returns once no request is in flight (at once if none is)."""
        with self._lock:
            if not self._sinks:
                return
            reply = _Reply(asyncio.get_running_loop())
            self._drain_waiters.append(reply)
        await reply.future

    def _sinks_changed(self) -> None:
        """Under _lock, after a sink is removed: wake requests_drained() once none is left."""
        if not self._sinks and self._drain_waiters:
            waiters, self._drain_waiters = self._drain_waiters, []
            for reply in waiters:
                reply.ok(None)

    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        """The parameters tensors so named, shaped and typed leave unfilled; a ConfigError naming
        any that cannot fill the served model (unknown name, wrong shape or dtype). Reads shapes only."""
        return self.core.unfilled_weights(named)

    @property
    def released_memory(self) -> list[str]:
        return sorted(self.core.released_memory)

    @property
    def paused(self) -> str | None:
        """pause_generation's mode while paused, else None."""
        return self._state.pause_mode

    async def _ask(self, command: Command):
        """Queue a control command for the core thread and wait for its answer."""
        self._check_alive()
        reply = _Reply(asyncio.get_running_loop())
        with self._lock:
            self._check_open()
            self._replies.add(reply)
            self._commands.put(_Asked(command, reply))
        return await reply.future

    def _check_alive(self) -> None:
        if not self._state.accepts_requests:
            raise EngineDeadError(f"the engine is not running: {self._death or 'shut down'}")

    def _check_open(self) -> None:
        """Under _lock: the core thread still takes commands."""
        if self._state in (EngineState.STOPPED, EngineState.DEAD):
            raise EngineDeadError(f"the engine is not running: {self._death or 'shut down'}")

    def _set_state(self, state: EngineState) -> None:
        """From running or paused only: a shutdown under way is never undone."""
        with self._lock:
            if self._state.accepts_requests:
                self._state = state

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight; its generator ends with finish_reason "abort". False if unknown."""
        with self._lock:
            known = request_id in self._sinks
        if known:
            self._commands.put(Abort(request_id))
        return known

    def refuse_waiting_commands(self, reason: str = "the server is shutting down") -> None:
        """From now on, every control command that waits for the requests in flight (a weight
        update, a memory release) fails with EngineDeadError(reason), those already waiting
        included, instead of starting once the requests end; the requests they held start. The
        server calls it as it stops, before aborting the requests, so that a stop's grace period
        is not spent on an update that nobody will serve (its caller gets a 503 to retry
        elsewhere). Requests and other commands are served as before."""
        self._commands.put(_RefuseWaiting(EngineDeadError(reason)))

    def shutdown(self) -> None:
        """Stop the engine threads (and tensor-parallel workers); requests still in flight fail
        with EngineDeadError. Idempotent."""
        with self._lock:
            stop = self._state.accepts_requests
            if stop:
                self._state = EngineState.STOPPING
        if stop:
            self._commands.put(Shutdown())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
            self._output_thread.join(timeout=60)
        self.core.shutdown()

    def _worker_failed(self, error: BaseException) -> None:
        """A tensor-parallel rank failed (the monitor thread calls this): the engine is dead,
        /health answers 503, requests in flight fail, as when the output thread dies."""
        self._death = error
        self._set_state(EngineState.STOPPING)
        self._commands.put(Shutdown())
        for callback in self.on_dead:
            callback(error)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # -- the core thread ------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            while True:
                paused = self._state.pause_mode is not None
                # updates and releases wait until no sequence holds KV (paused and retracted, or drained)
                if self._exclusive and (not core.has_unfinished() or (paused and not core.scheduler.running)):
                    self._run_exclusive()
                stepping = core.has_unfinished() and not paused
                # Block while idle or paused; otherwise take whatever arrived since the last step.
                cmd = self._commands.get() if not stepping else self._next_command()
                while cmd is not None:
                    if isinstance(cmd, Shutdown):
                        if self._death is not None:  # sent by the output thread or a failed rank
                            self._close(EngineState.DEAD, EngineDeadError(f"the engine died: {self._death!r}"))
                        else:
                            self._close(EngineState.STOPPED, EngineDeadError("the engine was shut down"))
                        return
                    self._handle(cmd)
                    cmd = self._next_command()
                if core.has_unfinished() and self._state.pause_mode is None:
                    out = core.step()
                    if out.updates or out.failed:
                        self._outputs.put(out)
        except BaseException as exc:  # a bug outside a step: fail loudly, never hang clients
            logger.exception("the engine thread died")
            self._death = exc
            self._close(EngineState.DEAD, EngineDeadError(f"the engine thread died: {exc!r}"))

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, cmd) -> None:
        core = self.core
        if isinstance(cmd, _Asked):
            self._control(cmd)
        elif isinstance(cmd, AddRequest):
            if self._exclusive or core.released_memory:
                self._held.append(cmd.request)
                return
            try:
                core.add_request(cmd.request)
            except Exception as exc:
                self._outputs.put(CoreOutputs(failed=[(cmd.request.request_id, exc)]))
        elif isinstance(cmd, StopSequence):
            out = core.stop_sequence(cmd.request_id, cmd.index, cmd.num_output_tokens, cmd.stop)
            if out.updates:
                self._outputs.put(out)
        elif isinstance(cmd, Abort):
            self._abort(cmd.request_id)
        elif isinstance(cmd, _RefuseWaiting):
            self._refusing = cmd.error
            while self._exclusive:
                self._answer(self._exclusive.popleft().reply, exc=cmd.error)
            self._release_held()
        else:
            raise TypeError(f"unknown engine command {cmd!r}")

    def _control(self, asked: _Asked) -> None:
        """A control command arrives: admitted (or refused), then run now or once no sequence holds KV."""
        try:
            asked.command.admit(self._target)
            if asked.command.after_requests:
                if self._refusing is not None:
                    raise self._refusing
                self._exclusive.append(asked)
                return
            value = asked.command.run(self._target)
        except Exception as exc:
            self._answer(asked.reply, exc=exc)
        else:
            self._answer(asked.reply, value)

    def _abort(self, request_id: str) -> None:
        update = self.core.abort_request(request_id)
        if update is not None:
            self._outputs.put(CoreOutputs(updates=[update]))
        held = next((p for p in self._held if p.request_id == request_id), None)
        if held is not None:
            self._held.remove(held)
            self._outputs.put(_AbortedBeforeStart(request_id))

    def _run_exclusive(self) -> None:
        """Runs once no request is in flight: every command that waited for that, in order,
        then the held requests, unless memory is still released."""
        while self._exclusive:
            asked = self._exclusive.popleft()
            try:
                value = asked.command.run(self._target)
            except Exception as exc:
                logger.error("%s failed: %s", type(asked.command).__name__, exc)
                self._answer(asked.reply, exc=exc)
            else:
                self._answer(asked.reply, value)
        self._release_held()

    def _release_held(self) -> None:
        """The requests held behind waiting commands start, unless memory is still released."""
        if not self.core.released_memory:
            held, self._held = self._held, []
            for prep in held:
                self._handle(AddRequest(prep))

    def _answer(self, reply: _Reply, value: object = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._replies.discard(reply)
        if exc is None:
            reply.ok(value)
        else:
            reply.fail(exc)

    def _close(self, state: EngineState, exc: BaseException) -> None:
        """The core thread's last act: nothing more is queued, every waiter fails with `exc`."""
        core = self.core
        for rid in list(core.requests):
            core.abort_request(rid)
        self._exclusive.clear()
        self._held = []
        with self._lock:
            self._state = state
            replies, self._replies = self._replies, set()
        for reply in replies:
            reply.fail(exc)
        self._outputs.put(_Close(exc))  # the output thread fails the requests' sinks

    # -- the output thread ----------------------------------------------------------------
    def _run_output(self) -> None:
        """Detokenizing, stop strings and RequestOutputs, off the core thread."""
        output = self._output
        try:
            while True:
                item = self._outputs.get()
                if isinstance(item, _Register):
                    output.add_request(item.request)
                elif isinstance(item, _AbortedBeforeStart):
                    if (out := output.abort(item.request_id)) is not None:
                        self._deliver(out)
                elif isinstance(item, _Close):
                    self._fail_sinks(item.error)
                    return
                else:
                    processed = output.process(item)
                    for stop in processed.stops:
                        self._commands.put(stop)
                    for rid in processed.to_abort:
                        self._commands.put(Abort(rid))
                    for out in processed.outputs:
                        self._deliver(out)
                    for rid, exc in processed.failed:
                        logger.error("request %s failed: %r", rid, exc)
                        self._deliver_error(rid, exc)
        except BaseException as exc:  # a bug here: fail loudly, never hang clients
            logger.exception("the output thread died")
            self._death = exc
            self._set_state(EngineState.STOPPING)
            self._commands.put(Shutdown())
            self._fail_sinks(EngineDeadError(f"the output thread died: {exc!r}"))

    def _deliver(self, out: RequestOutput) -> None:
        self._hand_over(out.request_id, out, last=out.finished)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        self._hand_over(request_id, exc, last=True)

    def _hand_over(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        """`item` into the request's sink, and a last item's request out of `_sinks` only after it
        is on its way: whoever sees the request gone (requests_drained, a consumer waiting for
        its outputs to pile up) knows its last output was handed over."""
        with self._lock:
            sink = self._sinks.get(request_id)
            if sink is not None:
                sink.put(item)
            if last:
                self._sinks.pop(request_id, None)
                self._sinks_changed()

    def _fail_sinks(self, exc: BaseException) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            self._sinks_changed()
        for sink in sinks.values():
            sink.put(exc)

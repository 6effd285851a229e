"""Control commands: what a caller asks of the engine core between steps, each declared once.

A command is a frozen dataclass: its fields are the arguments, `admit` what happens when it
arrives (a refusal raises), `run` its effect (the answer is what it returns), and
`after_requests` whether it runs only once no sequence holds KV (in order with the others
that wait). From these declarations every front gets one method per command, named after the
class (`UpdateWeights` -> `update_weights`), with the dataclass's signature and docstring
(`commands_as_methods`): AsyncLLM's queues the command for its core thread and awaits the
answer; LLMEngine's (and LLM's, through it) admits and runs it at once on the caller's thread.
Adding a command is a class here and nothing else.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

from r3srv.errors import InvalidRequestError

if TYPE_CHECKING:
    from r3srv.engine.core import EngineCore
    from r3srv.models.loader import NamedTensors

logger = logging.getLogger(__name__)

# SGLang's abort, retract and in_place; vLLM's keep (in place, but a weight update retracts the
# frozen sequences rather than wait for them) and wait (pause once the requests in flight finished)
PAUSE_MODES = ("abort", "retract", "in_place", "keep", "wait")


class Target(Protocol):
    """What a command reaches, on the engine core's thread."""

    core: EngineCore

    @property
    def pause_mode(self) -> str | None: ...

    def set_pause_mode(self, mode: str | None) -> None: ...

    def abort_request(self, request_id: str) -> object: ...

    def held_request_ids(self) -> list[str]:
        """Requests that arrived while others had to finish first (not yet in the core)."""
        ...

    def is_waiting(self, kind: type[Command]) -> bool:
        """Whether a command of this kind waits for the requests in flight."""
        ...


class Command:
    """Base of the control commands (each a frozen dataclass)."""

    offline: ClassVar[bool] = True  # LLMEngine and LLM have it too (not the pause commands)

    @property
    def after_requests(self) -> bool:
        return False

    def admit(self, target: Target) -> None:
        """On arrival, before it runs or waits; raise to refuse it."""

    def run(self, target: Target) -> Any:
        raise NotImplementedError


class AfterRequests(Command):
    """A command that runs only once no sequence holds KV (in order with the others that wait)."""

    @property
    def after_requests(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class UpdateWeights(AfterRequests):
    """Load new weights of the same architecture from a checkpoint directory, or from tensors a
    trainer sent by name (received in full), as an RL policy update.

    Requests in flight finish on the old weights first (abort_running=True aborts them
    instead), so no sequence mixes two policies in its KV or its routed experts; requests that
    arrive meanwhile wait and run on the new weights. The prefix cache is emptied. Raises
    ConfigError (weights unchanged) for a checkpoint that is not this model's architecture,
    InvalidRequestError if another update is under way. Outputs of requests that start later
    carry `weight_version` (default: `path`)."""

    path: str | NamedTensors
    weight_version: str | None = None
    abort_running: bool = False

    def __post_init__(self) -> None:
        if not _is_named_tensors(self.path):
            object.__setattr__(self, "path", str(self.path))  # accept os.PathLike

    def admit(self, target: Target) -> None:
        if target.is_waiting(UpdateWeights):
            raise InvalidRequestError("a weight update is already under way", param="model_path")
        core = target.core
        if self.abort_running:
            for request_id in list(core.requests):
                target.abort_request(request_id)
        elif core.scheduler.running and target.pause_mode == "keep":
            core.retract_running()  # they recompute on the new weights: no sequence mixes two policies
        elif core.scheduler.running and target.pause_mode == "in_place":
            raise InvalidRequestError(
                "generation is paused in place and requests hold KV of the current weights: pause with "
                "mode=retract or abort, or update with abort_all_requests", param="model_path")

    def run(self, target: Target) -> None:
        target.core.update_weights(self.path, self.weight_version)
        logger.info("loaded new weights from %s", "tensors" if _is_named_tensors(self.path) else self.path)


@dataclass(frozen=True, slots=True)
class LoadLoraAdapter(Command):
    """Register a LoRA adapter by name from a PEFT save (`path`) or from a pushed adapter
    (`adapter`: r3srv.lora.adapter.LoraAdapter, e.g. lora.manager.adapter_from_tensors), checked
    against the model first (a bad one is an InvalidRequestError; the previous one of that name
    stays). A name loaded before is replaced in place, as a weight update is: requests running
    under it must finish first (pause with mode=retract or keep sends them back to recompute on
    the new version), its cached prefixes are dropped, and outputs name the new version.
    Returns the adapter's reference (name, id, version)."""

    name: str
    path: str | None = None
    adapter: Any = None
    pinned: bool = False

    def admit(self, target: Target) -> None:
        core = target.core
        if target.pause_mode == "keep" and self.name in (core.lora.names() if core.lora is not None else ()):
            running = [s for s in core.scheduler.running if s.lora is not None and s.lora.name == self.name]
            if running:
                core.retract_running()  # they recompute on the new version: no sequence mixes two

    def run(self, target: Target) -> Any:
        ref = target.core.load_lora_adapter(self.name, self.path, self.adapter, self.pinned)
        logger.info("LoRA adapter %r version %d loaded from %s", ref.name, ref.version, self.path or "tensors")
        return ref


@dataclass(frozen=True, slots=True)
class UnloadLoraAdapter(Command):
    """Forget a LoRA adapter (its slot and cached prefixes too); refused while requests run under it."""

    name: str

    def run(self, target: Target) -> Any:
        return target.core.unload_lora_adapter(self.name)


@dataclass(frozen=True, slots=True)
class RenameWeights(Command):
    """Name the served weights `weight_version` in the outputs of requests admitted from now on."""

    weight_version: str

    def run(self, target: Target) -> None:
        target.core.weight_version = self.weight_version


@dataclass(frozen=True, slots=True)
class ResetPrefixCache(Command):
    """Forget every cached prefix; returns how many blocks were forgotten."""

    def run(self, target: Target) -> int:
        return target.core.reset_prefix_cache()


@dataclass(frozen=True, slots=True)
class ReleaseMemory(AfterRequests):
    """Free the KV cache ("kv_cache") and/or move the weights to host memory ("weights"); None:
    both. Runs once the requests in flight have finished; requests that arrive meanwhile, or
    until everything is resumed, wait. Returns what is released."""

    tags: list[str] | None = None

    def run(self, target: Target) -> list[str]:
        released = target.core.release_memory(self.tags)
        logger.info("released memory: %s", released)
        return released


@dataclass(frozen=True, slots=True)
class ResumeMemory(AfterRequests):
    """Take back released memory (None: all), after any update or release asked for before;
    once nothing is released, the requests that waited start. Returns what is still released."""

    tags: list[str] | None = None

    def run(self, target: Target) -> list[str]:
        released = target.core.resume_memory(self.tags)
        logger.info("resumed memory; still released: %s", released)
        return released


@dataclass(frozen=True, slots=True)
class CallRanks(Command):
    """`call(multiproc_executor)` between steps (generation waits meanwhile): a trainer's
    weight-group commands for the tensor-parallel ranks (EngineCore.call_ranks)."""

    call: Callable

    def run(self, target: Target) -> Any:
        return target.core.call_ranks(self.call)


@dataclass(frozen=True, slots=True)
class PauseGeneration(Command):
    """Stop stepping until continue_generation (SGLang's modes): "abort" ends every request in
    flight (finish_reason "abort"); "retract" sends running sequences back to waiting with their
    KV freed, so a weight update can run at once and they resume on the new weights, recomputing
    their tokens (and rows) first; "in_place" keeps everything as it is (an update then waits
    for continue_generation and the requests to finish, so it is refused); "keep" (vLLM's) keeps
    everything as it is too, but a weight update retracts the frozen sequences, as "retract"
    would have, and runs at once; "wait" (vLLM's) pauses once the requests in flight have
    finished. Requests that arrive meanwhile wait. Returns {"aborted": n, "retracted": n}."""

    offline: ClassVar[bool] = False
    mode: str = "abort"

    def __post_init__(self) -> None:
        if self.mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {self.mode!r}",
                                      param="mode")

    @property
    def after_requests(self) -> bool:
        return self.mode == "wait"

    def run(self, target: Target) -> dict[str, int]:
        aborted = retracted = 0
        if self.mode == "abort":
            for request_id in [*target.core.requests, *target.held_request_ids()]:
                target.abort_request(request_id)
                aborted += 1
        elif self.mode == "retract":
            retracted = target.core.retract_running()
        target.set_pause_mode(self.mode)
        return {"aborted": aborted, "retracted": retracted}


@dataclass(frozen=True, slots=True)
class ContinueGeneration(Command):
    """Step again after pause_generation; returns whether generation was paused."""

    offline: ClassVar[bool] = False

    def run(self, target: Target) -> bool:
        was_paused = target.pause_mode is not None
        if was_paused:
            target.set_pause_mode(None)
        return was_paused


COMMANDS: tuple[type[Command], ...] = (UpdateWeights, RenameWeights, ResetPrefixCache, ReleaseMemory, ResumeMemory,
                                       LoadLoraAdapter, UnloadLoraAdapter,
                                       CallRanks, PauseGeneration, ContinueGeneration)


def method_name(kind: type[Command]) -> str:
    """UpdateWeights -> update_weights."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).lower()


def _is_named_tensors(value: object) -> bool:
    from r3srv.models.loader import NamedTensors

    return isinstance(value, NamedTensors)


# -- the fronts' methods ----------------------------------------------------------------------
C = TypeVar("C", bound=type)


def commands_as_methods(how: Literal["queued", "at_once", "through_engine"]) -> Callable[[C], C]:
    """A class decorator giving the class one method per command (COMMANDS; for "at_once" and
    "through_engine" the offline ones only):
    queued:         async, `await self._ask(command)` (AsyncLLM: answered by its core thread);
    at_once:        `run_at_once(self, command)` (LLMEngine);
    through_engine: `self.engine.<method>(...)` (LLM)."""

    def decorate(cls: C) -> C:
        for kind in COMMANDS:
            if how == "queued" or kind.offline:
                name = method_name(kind)
                method = _method(kind, name, how)
                method.__name__, method.__qualname__ = name, f"{cls.__name__}.{name}"
                method.__module__ = cls.__module__
                method.__doc__ = kind.__doc__
                method.__signature__ = _signature(kind)  # type: ignore[attr-defined]
                setattr(cls, name, method)
        return cls

    return decorate


def _method(kind: type[Command], name: str, how: str) -> Callable:
    if how == "queued":
        async def queued(self, *args, **kwargs):
            return await self._ask(kind(*args, **kwargs))

        return queued
    if how == "at_once":
        def at_once(self, *args, **kwargs):
            return run_at_once(self, kind(*args, **kwargs))

        return at_once

    def through_engine(self, *args, **kwargs):
        return getattr(self.engine, name)(*args, **kwargs)

    return through_engine


def _signature(kind: type[Command]) -> inspect.Signature:
    """(self, <the dataclass's fields>) -> what run returns."""
    fields = inspect.signature(kind).parameters.values()
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([self_param, *fields], return_annotation=inspect.signature(kind.run).return_annotation)


class _OfflineTarget:
    """An offline engine (LLMEngine) as a command reaches it: the caller's thread is the core's,
    nothing waits and nothing is paused."""

    pause_mode = None

    def __init__(self, engine) -> None:
        self.core = engine.core
        self.abort_request = engine.abort_request

    def set_pause_mode(self, mode: str | None) -> None:
        raise AssertionError("no offline command pauses")

    def held_request_ids(self) -> list[str]:
        return []

    def is_waiting(self, kind: type[Command]) -> bool:
        return False


def run_at_once(engine, command: Command) -> Any:
    """Admit and run `command` on the caller's thread (LLMEngine: its requests in flight are
    the caller's to finish, abort or retract first, as EngineCore's checks say)."""
    target = _OfflineTarget(engine)
    command.admit(target)
    return command.run(target)

"""The engine options (config.py's `option(...)` fields) as `r3srv serve` flags and as keywords.

Each option is declared once, as a field of `EngineConfig` or `ParallelConfig`; this module
derives from those fields the serve flags (`add_arguments`, `from_args`) and the keyword
parameters of `LLM`, `AsyncLLM` and `LLMEngine.from_kwargs` (`with_option_keywords`), so a new
option needs a field and nothing else. Imports nothing heavy: `r3srv --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from r3srv.config import EngineConfig, ParallelConfig

__all__ = ["Option", "add_arguments", "from_args", "options", "with_option_keywords"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One engine option as its field declares it."""

    name: str
    default: Any
    annotation: Any  # as declared: int, int | None, ...
    type: type  # int, float, str or bool (an Optional's inner type)
    help: str
    serve_default: Any
    default_text: str | None
    aliases: tuple[str, ...]
    choices: tuple[str, ...] | None
    positional: bool
    group: str | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def options() -> Iterator[Option]:
    """Every engine option: EngineConfig's, then ParallelConfig's (the model first)."""
    for cls in (EngineConfig, ParallelConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "option" not in f.metadata:
                continue  # EngineConfig.parallel: the ParallelConfig the options below fill
            meta = f.metadata["option"]
            yield Option(f.name, f.default, hints[f.name], _inner_type(hints[f.name]), meta["help"], meta["serve_default"],
                         meta["default_text"], meta["aliases"], meta["choices"], meta["positional"], meta["group"])


def _inner_type(hint: Any) -> type:
    """int for `int`, `int | None`, ..."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


# -- r3srv serve ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument per option, spelled as vllm serve spells it. A switch takes --NAME and
    --no-NAME; values are checked by the config (a ConfigError names the option), not here."""
    groups: dict[str | None, Any] = {None: parser.add_argument_group("engine options")}
    for opt in options():
        if opt.group not in groups:
            groups[opt.group] = parser.add_argument_group(opt.group)
        target = groups[opt.group]
        shown = opt.default_text or _shown(opt.serve_default)
        helptext = f"{opt.help} (default: {shown})"
        if opt.positional:
            target.add_argument(opt.name, nargs="?", default=opt.serve_default, help=helptext)
        elif opt.type is bool:
            target.add_argument(opt.flag, *opt.aliases, dest=opt.name, action=argparse.BooleanOptionalAction,
                                default=opt.serve_default, help=helptext)
        else:
            metavar = "{" + ",".join(opt.choices) + "}" if opt.choices else None
            target.add_argument(opt.flag, *opt.aliases, dest=opt.name, type=opt.type, default=opt.serve_default,
                                metavar=metavar, help=helptext)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options `add_arguments` parsed, as keywords for `engine_config` (the model included)."""
    return {opt.name: getattr(args, opt.name) for opt in options()}


# -- LLM, AsyncLLM, LLMEngine.from_kwargs -------------------------------------------------
F = TypeVar("F", bound=Callable[..., Any])


def with_option_keywords(function: F) -> F:
    """`function(self, model=None, **options)` shown with every option as a keyword-only
    parameter with its default (inspect.signature, help(), editors that read signatures)."""
    signature = inspect.signature(function)
    kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    keywords = [inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=opt.default,
                                   annotation=opt.annotation)
                for opt in options() if opt.name not in signature.parameters]
    function.__signature__ = signature.replace(parameters=[*kept, *keywords])  # type: ignore[attr-defined]
    return function

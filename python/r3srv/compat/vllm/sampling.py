"""vLLM's SamplingParams over r3srv's: the same Struct, with vLLM's remaining fields.

r3srv's SamplingParams already spells every field it serves as vLLM 0.33 does. This subclass
adds the rest of vLLM's fields, so code written for vLLM constructs it unchanged: each one is
taken only at a value that leaves it without effect (None, vLLM's default, or what the field
table of the HTTP routes accepts for it, r3srv.server.fields), else an InvalidRequestError
names it, as the token-in token-out route's 400 does. Two fields that only concern the caller
are served here: `output_kind` (what generate's outputs hold) and `extra_args` (vLLM hands them
to plug-ins; r3srv keeps them on the params and runs none).
"""

from __future__ import annotations

import copy
import enum
from typing import Any

from r3srv.errors import InvalidRequestError
from r3srv.outputs import OutputKind
from r3srv.sampling_params import SamplingParams as R3srvSamplingParams
from r3srv.server.fields import TITO_SAMPLING_DEFAULTS, TITO_SAMPLING_REFUSED


class RequestOutputKind(enum.IntEnum):
    """vLLM's RequestOutputKind (its values)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

    @property
    def r3srv(self) -> OutputKind:
        return OutputKind[self.name]


# Served in-process though refused on the HTTP route (where the server picks the output kind).
_SERVED_HERE = ("output_kind", "extra_args")
_TAKEN_AT_DEFAULT = {name: refusal for name, refusal in TITO_SAMPLING_REFUSED.items() if name not in _SERVED_HERE}


class SamplingParams(R3srvSamplingParams, kw_only=True, omit_defaults=True):
    """vLLM's SamplingParams: r3srv's fields, plus vLLM's others (see the module's docstring)."""

    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    watermarking: Any = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: Any = None
    logprob_token_ids: Any = None
    flat_logprobs: bool = False
    stream_interval: int = 1
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    structured_outputs: Any = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    trace_decode_token_ids: Any = None

    def __post_init__(self) -> None:
        for name, refusal in _TAKEN_AT_DEFAULT.items():
            value = getattr(self, name)
            if not refusal.accepts(value, TITO_SAMPLING_DEFAULTS.get(name)):
                reason = refusal.reason
                raise InvalidRequestError(param=name, problem=f"={value!r} " + (
                    reason if reason.startswith("is ") else f"is refused: {reason}"))
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise InvalidRequestError(param="output_kind", problem=f"={self.output_kind!r} is not a RequestOutputKind") from None
        super().__post_init__()

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's clone), so a caller may change one request's params alone."""
        return copy.deepcopy(self)

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())


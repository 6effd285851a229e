"""Tokenizer: `tokenizers` for tokenizer.json, special tokens and the chat template from tokenizer_config.json."""

from __future__ import annotations

import functools

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from r3srv.errors import ConfigError, InvalidRequestError

# Used when a checkpoint ships no chat template: ChatML, as Qwen models use.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# From here on the GIL-releasing path is worth its thread hand-off (docs/benchmarks.md).
GIL_FREE_ENCODE_CHARS = 4096


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson filter, with its keywords (GLM's templates pass ensure_ascii)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the bits of HF's tokenizer_config.json we need."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        special_tokens: Sequence[str] = (),
    ) -> None:
        self._tok = tokenizer
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)
        self.pad_token_id = self._id(pad_token)
        self.chat_template = chat_template
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        specials.update(t for t in (*special_tokens, bos_token, eos_token, pad_token) if t)
        self.all_special_ids = sorted(i for i in (tokenizer.token_to_id(t) for t in specials) if i is not None)
        self._template = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"{path} has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ConfigError(f"cannot load {file}: {exc}") from exc
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read {config_file}: {exc}") from exc
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        extra = [_token_content(t) for t in config.get("additional_special_tokens") or []]
        return cls(
            tok,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_template=template,
            special_tokens=[t for t in extra if t],
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; only the tokenizer's own post-processor adds special tokens.

        Long texts go through `encode_batch`, the same pipeline with the GIL released
        (`encode` holds it: 0.3 s for 580k characters during which no other thread runs),
        so the server's event loop and engine thread keep going while a huge prompt encodes.
        """
        if len(text) >= GIL_FREE_ENCODE_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """An incremental decoder (the library's DecodeStream): fed one token id at a time, it
        returns the text that token completes, or None while a character is still partial.
        `context_ids` (e.g. the prompt's last few ids) are decoded as context, never returned."""
        stream, tok = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens), self._tok
        return lambda token_id: stream.step(tok, token_id)

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """Id -> content of every added token (specials and the like)."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the checkpoint's jinja2 chat template (sandboxed), or ChatML when it has none.

        A template error (e.g. the template's raise_exception on a bad role order) is an
        InvalidRequestError naming `messages`.
        """
        if self._template is None:
            # the same environment options and helpers transformers gives templates
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc

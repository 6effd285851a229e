"""One sequence's text, grown token by token, and where a stop string cuts the text and the tokens.

Decoding is the `tokenizers` library's DecodeStream (the prompt's last few ids as context,
for tokenizers whose pieces merge): a multi-byte character split across tokens appears
once complete, never as U+FFFD. `text_len_after[i]` is the text length once output token
i was decoded; a stop string trims the tokens to the shortest prefix that still produces
the kept text.
"""

from __future__ import annotations

_CONTEXT = 5  # prompt ids decoded as context before the first output token


class TextStream:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._step = None
        self._swallow = 0
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        # vLLM's fast detokenizer: with specials kept and no spaces between them, an added token
        # that follows another is its bare content (the decoder would put a space before it)
        self._added: dict[int, str] = {}
        if tokenizer is not None and not skip_special_tokens and not spaces_between_special_tokens:
            self._added = getattr(tokenizer, "added_tokens", {})
        self._last_added = False
        if tokenizer is not None:
            context = prompt_token_ids[-_CONTEXT:]
            self._step = tokenizer.decode_stream(context, skip_special_tokens)
            # A prompt that ends inside a character: DecodeStream's first chunk then repeats the
            # context's text, whose characters (the one the output completes included) are the prompt's.
            context_text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
            if context_text.endswith("\ufffd"):
                self._swallow = len(context_text)
        self.text = ""
        self.text_len_after: list[int] = []

    def add(self, token_id: int, silent: bool = False) -> str:
        """Append one output token; returns the newly completed text (possibly empty).
        silent: the token adds no text (a final stop token whose text is left out)."""
        if self._step is None or silent:  # token-id-only model: no text
            self.text_len_after.append(len(self.text))
            return ""
        try:
            delta = self._step(token_id) or ""
        except Exception:
            # DecodeStream refuses a text that no longer starts with its previous one ("Invalid
            # prefix", seen with some byte-fallback vocabularies): go on from this token without
            # context, as vLLM does, rather than fail the request.
            self._step = self._tokenizer.decode_stream([], self._skip)
            delta = self._step(token_id) or ""
        if self._added:
            added = self._added.get(token_id)
            if added is not None and self._last_added:
                delta = added
            self._last_added = added is not None
        if self._swallow and delta:
            cut = min(self._swallow, len(delta))
            self._swallow -= cut
            delta = delta[cut:]
        self.text += delta
        self.text_len_after.append(len(self.text))
        return delta

    def find_stop(self, stops: list[str], new_chars: int, include_stop: bool) -> tuple[str, int, int] | None:
        """Look for a stop string that ends in the last `new_chars` characters.

        Returns (stop, kept_text_len, kept_num_tokens) for the earliest match, or None.
        """
        if not stops or new_chars == 0:
            return None
        longest = max(len(s) for s in stops)
        begin = max(0, len(self.text) - new_chars - longest + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            idx = self.text.find(stop, begin)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        kept_len = idx + len(stop) if include_stop else idx
        kept_tokens = next(i + 1 for i, n in enumerate(self.text_len_after) if n >= kept_len) if kept_len > 0 else 0
        return stop, kept_len, kept_tokens

    def truncate(self, kept_len: int, kept_tokens: int) -> None:
        self.text = self.text[:kept_len]
        del self.text_len_after[kept_tokens:]

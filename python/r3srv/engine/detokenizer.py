"""Incremental detokenization, and where a stop string cuts the text and the tokens.

Text grows by decoding a small window of ids (the last few already-emitted ids as
context plus the new ones), so each step costs O(window), and a multi-byte character
split across tokens is only emitted once complete (no trailing U+FFFD).
`text_len_after[i]` is the text length once output token i was decoded; a stop string
trims the tokens to the shortest prefix that still produces the kept text.
"""

from __future__ import annotations

_CONTEXT = 5  # prompt/previous ids decoded with the new ones, for tokenizers whose pieces merge


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.text_len_after: list[int] = []

    def add(self, token_id: int, silent: bool = False) -> str:
        """Append one output token; returns the newly completed text (possibly empty).
        silent: the token adds no text (a final stop token whose text is left out)."""
        self._ids.append(token_id)
        if self.tokenizer is None or silent:  # token-id-only model: no text
            self.text_len_after.append(0)
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        delta = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            # Keep the window short: drop ids that no later decode will look at.
            if self._prefix_offset > 64:
                self._ids = self._ids[self._prefix_offset :]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
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

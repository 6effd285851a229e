"""Untrusted text for the decoders' fuzz tests: a valid text with characters set, inserted and
deleted (any code point up to U+02FF), then cut, as str or as bytes."""

from __future__ import annotations

from hypothesis import strategies as st

EDITS = st.lists(
    st.tuples(st.sampled_from(["set", "insert", "delete"]), st.integers(0, 100_000),
              st.characters(min_codepoint=0, max_codepoint=0x2FF)),
    max_size=6,
)


def mutated(text: str, edits: list[tuple[str, int, str]], cut: int, as_bytes: bool) -> str | bytes:
    chars = list(text)
    for op, pos, ch in edits:
        pos %= len(chars) + 1
        if op == "insert":
            chars.insert(pos, ch)
        elif chars and op == "set":
            chars[pos % len(chars)] = ch
        elif chars:
            del chars[pos % len(chars)]
    out = "".join(chars)[: cut or None]
    return out.encode("utf-8", "surrogatepass") if as_bytes else out

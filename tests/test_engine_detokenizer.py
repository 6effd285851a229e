"""Incremental detokenization (TextStream) on the built-in byte-level tokenizer, and stop-string cuts."""

import pytest

from r3srv.engine.text_stream import TextStream
from r3srv.models.builtin import builtin_model_dir
from r3srv.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(builtin_model_dir())


def feed(detok: TextStream, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


def test_multibyte_characters_appear_only_when_complete(tok):
    text = "héllo ✓ wörld " * 20  # long enough to exercise the window trimming
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    d = TextStream(tok, tok.encode("prompt: "))
    deltas = feed(d, ids)
    assert "".join(deltas) == d.text == text
    assert all("\ufffd" not in x for x in deltas)
    assert d.text_len_after[-1] == len(text) and len(d.text_len_after) == len(ids)
    assert d.text_len_after == sorted(d.text_len_after)


def test_special_tokens_are_skipped_or_kept(tok):
    end = tok.encode("<|im_end|>")
    assert len(end) == 1
    ids = tok.encode("ab") + end
    skipped = TextStream(tok, [], skip_special_tokens=True)
    feed(skipped, ids)
    kept = TextStream(tok, [], skip_special_tokens=False)
    feed(kept, ids)
    assert skipped.text == "ab" and kept.text == "ab<|im_end|>"


def test_find_stop_returns_the_earliest_match_and_the_tokens_to_keep(tok):
    d = TextStream(tok, [])
    ids = tok.encode("one two three")
    deltas = feed(d, ids)
    # Only stops ending in the new text count: "two" ended earlier, "three" ends in the last delta.
    assert d.find_stop(["two"], len(deltas[-1]), include_stop=False) is None
    assert d.find_stop(["three", "two"], len(deltas[-1]), include_stop=False) == ("three", 8, 8)
    # With everything new, the earliest stop ("two") wins.
    stop, kept_len, kept_tokens = d.find_stop(["three", "two"], len(d.text), include_stop=False)
    assert (stop, kept_len, kept_tokens) == ("two", 4, 4)
    stop, kept_len, kept_tokens = d.find_stop(["two"], len(d.text), include_stop=True)
    assert (kept_len, kept_tokens) == (7, 7)
    d.truncate(kept_len, kept_tokens)
    assert d.text == "one two" and len(d.text_len_after) == 7


def test_stop_inside_a_multibyte_character_keeps_the_whole_character(tok):
    d = TextStream(tok, [])
    ids = tok.encode("a✓b")  # ✓ is three byte tokens
    feed(d, ids)
    stop, kept_len, kept_tokens = d.find_stop(["b"], len(d.text), include_stop=False)
    assert kept_len == 2 and kept_tokens == 4  # "a✓": 1 + 3 byte tokens


def test_no_tokenizer_means_no_text():
    d = TextStream(None, [1, 2])
    assert feed(d, [3, 4]) == ["", ""] and d.text == "" and d.text_len_after == [0, 0]

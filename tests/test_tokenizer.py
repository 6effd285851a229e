"""Tokenizer: byte-level round trips (Hypothesis), special tokens, chat templates (checkpoint, default, sandbox)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.models.builtin import SPECIAL_TOKENS, write_byte_level_tokenizer
from r3srv.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_byte_level_round_trip_of_any_unicode(tok, text):
    ids = tok.encode(text)
    if not any(special in text for special in SPECIAL_TOKENS):
        assert ids == list(text.encode("utf-8"))  # one token per byte, id == byte value
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(tok):
    assert tok.vocab_size == 259
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [257, *b"user\nhi", 258]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (258, None, 256)
    assert tok.all_special_ids == [256, 257, 258]
    assert tok.decode([257, *b"hi", 258]) == "hi"
    assert tok.decode([257, *b"hi", 258], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.decode(list("é".encode())) == "é"


def test_checkpoint_chat_template_is_rendered(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def _with_config(tok_dir, tmp_path, **config):
    path = tmp_path / "custom"
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(path)


def test_default_template_when_the_checkpoint_has_none(tok_dir, tmp_path):
    tok = _with_config(tok_dir, tmp_path, eos_token={"content": "<|endoftext|>"})
    assert tok.chat_template is None and tok.eos_token_id == 256
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_custom_template_errors_and_sandbox(tok_dir, tmp_path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}"
    )
    tok = _with_config(tok_dir, tmp_path, chat_template=template, bos_token="<|endoftext|>")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<|endoftext|>[user]"é"'
    with pytest.raises(InvalidRequestError, match="first message must be from the user") as err:
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert err.value.param == "messages"
    evil = _with_config(tok_dir, tmp_path / "evil", chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_transformers_template_helpers(tok_dir, tmp_path):
    template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}{{ m['content'] }};"
        "{% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    tok = _with_config(tok_dir, tmp_path, chat_template=template)
    messages = [{"role": r, "content": r} for r in ("user", "tool", "assistant", "user")]
    assert tok.apply_chat_template(messages) == "user;assistant;4"


def test_missing_tokenizer_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.fixture(scope="module")
def bpe_tok():
    """A small byte-level BPE trained here, whose post-processor adds a BOS (as Llama/Mixtral's do)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [f"routing replay {i}: the router picks experts per token, layer {i % 7}" for i in range(200)]
    hf.train_from_iterator(corpus, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", hf.token_to_id("<s>"))])
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>")


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200), add_special_tokens=st.booleans())
def test_long_text_encode_path_gives_the_plain_encode_ids(bpe_tok, text, add_special_tokens):
    """Texts past GIL_FREE_ENCODE_CHARS go through encode_batch (GIL released): same ids as encode."""
    import r3srv.tokenizer as tokenizer_module

    want = bpe_tok._tok.encode(text, add_special_tokens=add_special_tokens).ids
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_module, "GIL_FREE_ENCODE_CHARS", 0)  # every text takes the long path
        assert bpe_tok.encode(text, add_special_tokens=add_special_tokens) == want


def test_a_long_text_at_the_real_threshold(bpe_tok):
    from r3srv.tokenizer import GIL_FREE_ENCODE_CHARS

    text = ("the router picks experts per token, ünïcödé 🙂 " * (GIL_FREE_ENCODE_CHARS // 20))[: 3 * GIL_FREE_ENCODE_CHARS]
    ids = bpe_tok.encode(text)
    assert ids == bpe_tok._tok.encode(text).ids and ids[0] == bpe_tok.bos_token_id
    assert bpe_tok.decode(ids) == text

"""TextStream (the `tokenizers` library's DecodeStream) against the hand-written incremental
detokenizer it replaces: the same text after every token, the same per-token text lengths
and the same stop-string cuts, on token sequences the built-in model generates, on texts
with multi-byte characters, with special tokens skipped and kept, and on two trained BPE
tokenizers (byte-level, and Metaspace whose decoder drops a leading space).
Also prompts that end inside a character the output completes: its text is the prompt's."""

import random

import pytest

from engine_testing import one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from detokenizer_reference import IncrementalDetokenizer
from r3srv.engine.text_stream import TextStream
from r3srv.models.builtin import builtin_model_dir
from r3srv.tokenizer import Tokenizer

TEXTS = ["héllo ✓ wörld, 日本語のテキスト 🙂 and ascii " * 6, "routing replay 12: the router picks experts per token"]


def trained_bpe(kind: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    if kind == "bytelevel":
        hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # sentencepiece-like: "▁" for spaces, dropped again at the start of a text
        hf.pre_tokenizer, hf.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = list("✓é日本語のテキスト🙂")
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>", "<unk>"], initial_alphabet=alphabet)
    hf.train_from_iterator([f"routing replay {i}: the router picks experts per token, layer {i % 7}" for i in range(200)], trainer)
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def builtin_tok():
    return Tokenizer.from_dir(builtin_model_dir())


@pytest.fixture(scope="module")
def generated(builtin_tok):
    """Output token ids the built-in model samples (seeded) from prompts with multi-byte text."""
    llm = LLM(max_model_len=256, enable_return_routed_experts=False)
    prompts = [builtin_tok.encode(t[:40]) for t in TEXTS]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=96, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)])
    return [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def with_specials(tok: Tokenizer, ids: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    out = list(ids)
    for _ in range(4):
        out.insert(rng.randrange(len(out) + 1), rng.choice(tok.all_special_ids))
    return out


def split_cases(tok: Tokenizer):
    """Prompts that end inside a character the output completes."""
    split = tok.encode("a✓é✓b", add_special_tokens=False)
    return [(split[:cut], split[cut:]) for cut in range(1, len(split))]


def cases(tok: Tokenizer, generated=()):
    yield from generated
    for i, text in enumerate(TEXTS):
        ids = tok.encode(text, add_special_tokens=False)
        yield tok.encode("prompt: ", add_special_tokens=False), ids
        yield ids[:3], with_specials(tok, ids, seed=i)


def assert_same_stream(tok, prompt, ids, skip):
    old, new = IncrementalDetokenizer(tok, prompt, skip), TextStream(tok, prompt, skip)
    for t in ids:
        assert new.add(t) == old.add(t)
        assert new.text == old.text
    assert new.text_len_after == old.text_len_after
    return old, new


def assert_same_stop_cuts(tok, prompt, ids, seed):
    """Both fed token by token with stop strings taken from the text, as the engine checks them."""
    full = TextStream(tok, prompt)
    for t in ids:
        full.add(t)
    rng = random.Random(seed)
    text = full.text
    for include in (False, True):
        for _ in range(4):
            a = rng.randrange(max(1, len(text) - 3))
            stops = [text[a : a + rng.randint(1, 3)], "never seen"]
            old, new = IncrementalDetokenizer(tok, prompt), TextStream(tok, prompt)
            for t in ids:
                delta_old, delta_new = old.add(t), new.add(t)
                hit_old = old.find_stop(stops, len(delta_old), include)
                assert new.find_stop(stops, len(delta_new), include) == hit_old
                if hit_old:
                    old.truncate(*hit_old[1:])
                    new.truncate(*hit_old[1:])
                    break
            assert (new.text, new.text_len_after) == (old.text, old.text_len_after)


@pytest.mark.parametrize("skip", [True, False], ids=["skip-specials", "keep-specials"])
def test_builtin_tokenizer_streams_equal_the_old_detokenizer(builtin_tok, generated, skip):
    for prompt, ids in [*cases(builtin_tok, generated), *split_cases(builtin_tok)]:
        old, new = assert_same_stream(builtin_tok, prompt, ids, skip)
        assert "\ufffd" not in new.text[-1:]
    # the generated sequences really split multi-byte characters, and the specials were there
    assert any(any(t >= 0x80 for t in ids) for _, ids in generated)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip-specials", "keep-specials"])
def test_trained_bpe_streams_equal_the_old_detokenizer(kind, skip):
    tok = trained_bpe(kind)
    for prompt, ids in cases(tok):
        assert_same_stream(tok, prompt, ids, skip)
    for prompt, ids in split_cases(tok):  # (no character spans tokens in the Metaspace vocabulary)
        assert_same_stream(tok, prompt, ids, skip)


def test_stop_string_cuts_equal_the_old_detokenizer(builtin_tok, generated):
    for seed, (prompt, ids) in enumerate(cases(builtin_tok, generated)):
        assert_same_stop_cuts(builtin_tok, prompt, ids, seed)
    tok = trained_bpe("metaspace")
    for seed, (prompt, ids) in enumerate(cases(tok)):
        assert_same_stop_cuts(tok, prompt, ids, seed)


def test_no_tokenizer_means_no_text():
    d = TextStream(None, [1, 2])
    assert [d.add(3), d.add(4)] == ["", ""] and d.text == "" and d.text_len_after == [0, 0]

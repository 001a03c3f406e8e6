"""Tests for the incremental detokenizer, on tiny tokenizers trained offline."""

from __future__ import annotations

import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.sampling_params import SamplingParams
from services.tokenizer.detokenizer import DetokenizerDelta, IncrementalDetokenizer

CORPUS = [
    "héllo wörld — 日本語 emoji 🚀 rocket launch, naïve café façade Ünïcödé.",
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Streaming text must never show half a character: 日本語のテキスト and 🚀🚀 rockets.",
    "STOP words, ### markers ###, and new\nlines\n\nare common in generated text.",
] * 3
PROMPT = "Hello there, the quick"
# Not in the corpus, so its 4 bytes stay separate byte-level tokens.
SPLIT_TEXT = " héllo 🎉 wörld 日本語 🚀 done"


def _train(pre_tokenizer, decoder, alphabet: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), alphabet)


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    """Metaspace ("▁") BPE, whose decoder strips the leading space of the first token."""
    return _train(pre_tokenizers.Metaspace(), decoders.Metaspace(), [])


def enc(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(
    tok, prompt_ids, out_ids, chunks=None, **params
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed out_ids in the given chunk sizes (default one at a time); return all deltas."""
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    deltas, i = [], 0
    for size in chunks or [1] * len(out_ids):
        deltas.append(detok.add_tokens(out_ids[i : i + size]).text)
        i += size
    assert i >= len(out_ids)
    deltas.append(detok.finish().text)
    return deltas, detok


def in_context(tok, prompt_ids, out_ids, skip=True) -> str:
    """The streamed text's definition: decode(prompt + output) past decode(prompt)."""
    full = tok.decode(prompt_ids + out_ids, skip_special_tokens=skip)
    prompt = tok.decode(prompt_ids, skip_special_tokens=skip)
    # Usually prompt is a prefix of full; not if the output finishes the prompt's last character.
    return full[len(os.path.commonprefix([full, prompt])) :]


@pytest.mark.parametrize("text", [" jumps over the lazy dog.", SPLIT_TEXT, "\n\nnew lines ###"])
def test_deltas_concatenate_to_full_decode(tok, text):
    prompt, out = enc(tok, PROMPT), enc(tok, text)
    deltas, _ = run(tok, prompt, out)
    assert "".join(deltas) == tok.decode(out) == in_context(tok, prompt, out) == text
    rng = random.Random(0)
    for _ in range(20):
        chunks = [rng.randint(1, 5) for _ in out]
        assert "".join(run(tok, prompt, out, chunks)[0]) == text


@pytest.mark.parametrize("name", ["tok", "sp_tok"])
def test_random_ids_match_full_decode(name, request):
    # Random ids make broken UTF-8 anywhere, special tokens, prompts ending mid-character.
    tok = request.getfixturevalue(name)
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        out = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
        skip = rng.random() < 0.5
        chunks = [rng.randint(1, 4) for _ in out]
        deltas, _ = run(tok, prompt, out, chunks, skip_special_tokens=skip)
        assert "".join(deltas) == in_context(tok, prompt, out, skip), (prompt, out, skip)


def test_partial_utf8_tokens_are_held_back(tok):
    out = enc(tok, SPLIT_TEXT)
    assert any("\ufffd" in tok.decode([t]) for t in out)  # some token is part of a character
    deltas, _ = run(tok, enc(tok, PROMPT), out)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == SPLIT_TEXT


def test_unfinished_character_at_end_is_replaced_like_full_decode(tok):
    out = enc(tok, " ok 🎉")[:-1]
    deltas, _ = run(tok, enc(tok, PROMPT), out)
    assert "".join(deltas) == tok.decode(out) == " ok \ufffd"
    assert all("\ufffd" not in d for d in deltas[:-1])  # only finish() may emit it


def test_prompt_ending_in_replacement_char_is_not_leaked(tok):
    ids = enc(tok, "hi 🎉 go")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    # The output finishes the prompt's character: it counts as output.
    assert "".join(run(tok, ids[:cut], ids[cut:])[0]) == "🎉 go"
    # It does not (or the prompt ends in a genuine U+FFFD): only the output's text is streamed.
    for prompt in (ids[:cut], enc(tok, "hi \ufffd")):
        assert "".join(run(tok, prompt, enc(tok, " go"))[0]) == " go"
        assert in_context(tok, prompt, enc(tok, " go")) == " go"
        assert "".join(run(tok, prompt, [])[0]) == ""


def test_first_token_decoded_in_context(sp_tok):
    prompt, out = enc(sp_tok, "Hello there,"), enc(sp_tok, " the quick brown fox")
    assert sp_tok.decode(out) == "the quick brown fox"  # decoding alone drops the space
    assert "".join(run(sp_tok, prompt, out)[0]) == in_context(sp_tok, prompt, out)
    assert "".join(run(sp_tok, prompt, out)[0]) == " the quick brown fox"


TEXT = " The quick brown fox jumps over the lazy dog."


def test_stop_string_split_across_tokens(tok):
    out = enc(tok, TEXT)
    assert not any("brown fox" in tok.decode([t]) for t in out)
    for chunks in (None, [2] * len(out), [len(out)]):
        deltas, detok = run(tok, enc(tok, PROMPT), out, chunks, stop=["brown fox"])
        assert "".join(deltas) == " The quick "
        assert detok.stopped and detok.stop_reason == "brown fox"


def test_stop_string_at_start_of_output(tok):
    deltas, detok = run(tok, enc(tok, PROMPT), enc(tok, TEXT), stop=[" The"])
    assert "".join(deltas) == "" and detok.stopped and deltas == [""] * len(deltas)


def test_stop_string_starting_in_held_back_text(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["###"]))
    # "##" could start "###", so it is held back...
    assert detok.add_tokens(enc(tok, " a ##")).text == " a "
    # ...until " b" shows it cannot; now "#" is held.
    assert detok.add_tokens(enc(tok, " b #")).text == "## b "
    # The stop string completes in a later call, starting in text generated but not emitted.
    assert detok.add_tokens(enc(tok, "## c")) == DetokenizerDelta("", True)
    assert detok.stop_reason == "###"


def test_partial_stop_string_is_released_at_finish(tok):
    deltas, detok = run(tok, [], enc(tok, " a ##"), stop=["###"])
    assert "".join(deltas) == " a ##" and not detok.stopped and deltas[-1] == "##"


def test_earliest_stop_string_wins(tok):
    out = enc(tok, TEXT)
    deltas, detok = run(tok, [], out, [len(out)], stop=["lazy", "jumps", "quick"])
    assert "".join(deltas) == " The " and detok.stop_reason == "quick"
    # Overlapping: the stop string completed first wins, however tokens are chunked.
    for chunks in (None, [len(out)]):
        deltas, detok = run(tok, [], out, chunks, stop=["quick brown fox", "brown"])
        assert "".join(deltas) == " The quick " and detok.stop_reason == "brown"


def test_include_stop_str_in_output(tok):
    deltas, detok = run(tok, [], enc(tok, TEXT), stop=["fox"], include_stop_str_in_output=True)
    assert "".join(deltas) == " The quick brown fox"


def test_nothing_after_stop(tok):
    detok = IncrementalDetokenizer(tok, enc(tok, PROMPT), SamplingParams(stop=["fox"]))
    first = detok.add_tokens(enc(tok, TEXT))
    assert first.stopped and first.text == " The quick brown "
    later = detok.add_tokens(enc(tok, " more text"))
    assert later.text == "" and later.stopped
    assert detok.finish().text == ""


def test_stop_strings_ignore_prompt(tok):
    deltas, detok = run(tok, enc(tok, PROMPT), enc(tok, TEXT), stop=["Hello", "there"])
    assert not detok.stopped and "".join(deltas) == TEXT


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    prompt = [tok.bos_token_id, *enc(tok, PROMPT)]
    out = [*enc(tok, " hello world"), tok.eos_token_id]
    deltas, detok = run(tok, prompt, out, skip_special_tokens=skip)
    assert "".join(deltas) == (" hello world" if skip else " hello world</s>")
    assert "".join(deltas) == tok.decode(out, skip_special_tokens=skip)
    assert "".join(deltas) == in_context(tok, prompt, out, skip)


def test_recovers_from_invalid_prefix(tok):
    detok = IncrementalDetokenizer(tok, enc(tok, PROMPT), SamplingParams())

    class Broken:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered")

    detok._stream = Broken()
    assert detok.add_tokens(enc(tok, " hello world")).text == " hello world"

"""Tests for the incremental detokenizer, on tiny tokenizers trained offline. Every test runs
twice: decoding through DecodeStream, and through a piece table where the tokenizer has one
(byte-level; the Metaspace one has none, so it decodes through DecodeStream both times)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from stoker.common.sampling_params import SamplingParams
from stoker.services.tokenizer.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from stoker.services.tokenizer.pieces import PieceTables

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


_TABLES: dict[int, PieceTables] = {}
_USE_TABLES = [False]


@pytest.fixture(autouse=True, params=["stream", "table"])
def decode_with(request) -> Iterator[str]:
    _USE_TABLES[0] = request.param == "table"
    yield request.param
    _USE_TABLES[0] = False


def detokenizer(tok, prompt_ids, params: SamplingParams) -> IncrementalDetokenizer:
    """An IncrementalDetokenizer in the test's decode mode."""
    pieces = _TABLES.setdefault(id(tok), PieceTables(tok)) if _USE_TABLES[0] else None
    return IncrementalDetokenizer(tok, prompt_ids, params, pieces)


def enc(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(
    tok, prompt_ids, out_ids, chunks=None, **params
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed out_ids in the given chunk sizes (default one at a time); return all deltas."""
    detok = detokenizer(tok, prompt_ids, SamplingParams(**params))
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
    detok = detokenizer(tok, [], SamplingParams(stop=["###"]))
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
    detok = detokenizer(tok, enc(tok, PROMPT), SamplingParams(stop=["fox"]))
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


def test_recovers_from_invalid_prefix(tok, decode_with):
    if decode_with == "table":
        pytest.skip("a DecodeStream failure: the table path has no stream")
    detok = IncrementalDetokenizer(tok, enc(tok, PROMPT), SamplingParams())

    class Broken:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered")

    detok._stream = Broken()
    assert detok.add_tokens(enc(tok, " hello world")).text == " hello world"


def test_ids_past_the_vocabulary_decode_to_nothing(tok):
    """A model's padded vocabulary rows have no token: their ids add no text."""
    out = enc(tok, " hello")
    deltas, _ = run(tok, enc(tok, PROMPT), [len(tok) + 5, *out, len(tok) + 999])
    assert "".join(deltas) == " hello"


def test_only_byte_level_tokenizers_get_a_table(tok, sp_tok):
    for skip in (True, False):
        table = PieceTables(tok).get(skip)
        assert table is not None and len(table.pieces) == len(tok)
        assert PieceTables(sp_tok).get(skip) is None  # Metaspace: DecodeStream
    special = PieceTables(tok)
    assert special.get(True).pieces[tok.eos_token_id] == b""
    assert special.get(False).pieces[tok.eos_token_id] == b"</s>"


def test_a_table_the_tokenizer_disagrees_with_is_refused(tok):
    from stoker.services.tokenizer.pieces import PieceTable, _disagreement

    good = PieceTables(tok).get(True)
    assert good is not None and _disagreement(tok, good, True) is None
    token_id = enc(tok, " quick")[0]
    pieces, texts = list(good.pieces), list(good.texts)
    pieces[token_id], texts[token_id] = b" quack", " quack"
    reason = _disagreement(tok, PieceTable(pieces, texts), True)
    assert reason is not None and f"token {token_id}" in reason
    # A partial token's bytes are only checked in runs of ids.
    partial = next(i for i, t in enumerate(good.texts) if t is None)
    pieces, texts = list(good.pieces), list(good.texts)
    pieces[partial] = b"\xff"
    reason = _disagreement(tok, PieceTable(pieces, texts), True)
    assert reason is not None and reason.startswith("ids")


def test_the_bundled_models_tokenizer_streams_the_same_with_its_table(decode_with):
    """stoker-tiny's byte-level tokenizer gets a table, and random ids (unfinished characters,
    special tokens, ids past the vocabulary) stream the same text through it as through
    DecodeStream, delta for delta, fed one token or several at a time."""
    if decode_with == "table":
        pytest.skip("compares both modes itself")
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models/stoker-tiny")
    pieces = PieceTables(tok)
    assert pieces.get(True) is not None
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.randrange(len(tok) + 8) for _ in range(rng.randint(1, 8))]
        out = [rng.randrange(len(tok) + 8) for _ in range(rng.randint(0, 24))]
        params = SamplingParams(skip_special_tokens=rng.random() < 0.7)
        cuts = sorted(rng.sample(range(1, len(out)), min(len(out) - 1, 3))) if out else []
        chunks = [out[i:j] for i, j in zip([0, *cuts], [*cuts, len(out)])]
        streams = []
        for table in (None, pieces):
            detok = IncrementalDetokenizer(tok, prompt, params, table)
            deltas = [detok.add_token(t) for t in out[:1]]  # one-token and chunked calls
            deltas += [detok.add_tokens(c[1:] if k == 0 else c).text for k, c in enumerate(chunks)]
            streams.append([*deltas, detok.finish().text])
        assert streams[0] == streams[1], (prompt, out)


def test_token_ids_with_gaps_get_their_text(decode_with):
    """Ids need not be contiguous (tiktoken conversions put specials far past the rest): a
    special token at id 300 over 256 byte tokens streams as DecodeStream streams it."""
    from tokenizers import AddedToken

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|end|>"] = 300
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|end|>", special=True)])
    gappy = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")
    assert gappy.eos_token_id == 300 and backend.get_vocab_size(True) == 257
    a = gappy.convert_tokens_to_ids("a")
    for skip in (True, False):
        deltas, _ = run(gappy, [a], [a, 300, a], skip_special_tokens=skip)
        assert deltas == ["a", "" if skip else "<|end|>", "a", ""]

"""Incremental detokenizer: streamed text equals a full decode; stop strings cut and never leak.

The tokenizer is a small byte-level BPE trained here in milliseconds (the same
kind as `engine.tools.tiny_model` writes, whose full build takes far longer). Its
vocabulary is small, so characters like 日, 🙂 and é are split over tokens.
"""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from engine.core.detokenizer import IncrementalDetokenizer, decode_token
from engine.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Language models predict the next token; a cache keeps the keys and values.",
    "Once upon a time there was a small village at the edge of a great forest.",
    "café 日本語 🙂 naïve façade",
]
PIECES = ["Hello", " world", " the", " café", " 日本語", " 🙂", "naïve", "é", "語", ",", ".", "\n", " ", "🙂🙂", "a", " STAR"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None) -> tuple[list[str], str | None]:
    """Feed ids (in chunks), collecting every delta as a streaming caller would."""
    deltas, stop, i = [], None, 0
    while i < len(ids) and stop is None:
        n = chunk_sizes.pop(0) if chunk_sizes else 1
        stop = detok.update(ids[i:i + n])
        i += n
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stop


def test_tokenizer_splits_characters(tokenizer):
    ids = encode(tokenizer, " 日本語 🙂 café")
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the tests below need split characters


@pytest.mark.parametrize("seed", range(12))
def test_streamed_deltas_equal_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    prompt = encode(tokenizer, "".join(rng.choices(PIECES, k=5)))
    text = "".join(rng.choices(PIECES, k=40))
    ids = encode(tokenizer, text)
    chunks = [rng.randint(1, 3) for _ in ids] if seed % 2 else None
    detok = IncrementalDetokenizer(tokenizer, [1] + prompt, SamplingParams())
    deltas, stop = stream(detok, ids, chunks)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_window_stays_small(tokenizer):
    lengths = []

    class Spy:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = encode(tokenizer, "".join(random.Random(0).choices(PIECES, k=300)))
    detok = IncrementalDetokenizer(Spy(), encode(tokenizer, "a prompt " * 100), SamplingParams())
    for t in ids:
        detok.update([t])
    assert len(ids) > 300 and max(lengths) <= 12  # O(window) per token, not O(length)
    assert detok.output_text == tokenizer.decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_truncates(tokenizer, include):
    text = "Hello world, hello there! The quick brown fox."
    stop_str = "o there!"
    ids = encode(tokenizer, text)
    assert not any(stop_str in tokenizer.decode([t]) for t in ids)  # it spans several tokens
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["zzz", stop_str],
                                                                  include_stop_str_in_output=include))
    deltas, stop = stream(detok, ids)
    expected = "Hello world, hell" + (stop_str if include else "")
    assert stop == stop_str
    assert detok.output_text == "".join(deltas) == expected
    # Detected at the token that completes it, not later.
    consumed = len(deltas) - 1  # one token per update
    assert stop_str in tokenizer.decode(ids[:consumed]) and stop_str not in tokenizer.decode(ids[:consumed - 1])


def test_earliest_stop_string_wins_within_one_update(tokenizer):
    ids = encode(tokenizer, "the fox, the dog, the end")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["end", "dog"]))
    assert detok.update(ids) == "dog"
    assert detok.output_text == "the fox, the "


@pytest.mark.parametrize("seed", range(6))
def test_held_back_text_never_leaks_a_cut_stop_string(tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(rng.choices(PIECES, k=12)) + " a STAR is born, STOP it" + "".join(rng.choices(PIECES, k=5))
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["STOP", "🙂🙂 the"]))
    emitted, stop = "", None
    for t in ids:
        stop = detok.update([t])
        emitted += detok.get_next_output_text(finished=False, delta=True)
        final_so_far = text[:text.find(stop)] if stop else None
        if stop is None:
            # Every streamed char must survive: it is a prefix of whatever the final text will be.
            assert detok.output_text.startswith(emitted)
            assert len(detok.output_text) - len(emitted) <= max(len("STOP"), len("🙂🙂 the")) - 1
        else:
            break
    emitted += detok.get_next_output_text(finished=True, delta=True)
    assert emitted == detok.output_text
    assert final_so_far is None or emitted == final_so_far
    assert "STOP" not in emitted


def test_non_delta_output_holds_back_until_finished(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xyz!"]))
    detok.update(encode(tokenizer, "Hello world"))
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello wo"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = encode(tokenizer, "Hello 日本") + [2] + encode(tokenizer, "語 there") + [2]
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=skip))
    deltas, _ = stream(detok, ids)
    expected = "Hello 日本語 there" if skip else "Hello 日本</s>語 there</s>"
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip) == expected


def test_invalid_bytes_are_not_held_forever(tokenizer):
    lead_byte = tokenizer.convert_tokens_to_ids("æ")  # byte 0xE6 alone: starts a 3-byte char, never finished
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for _ in range(40):
        detok.update([lead_byte])
    assert 0 < len(detok.output_text) <= 40 and set(detok.output_text) == {"\ufffd"}


def test_decode_token(tokenizer):
    assert decode_token(tokenizer, 2) == "</s>"
    hello = encode(tokenizer, "Hello")[0]
    assert decode_token(tokenizer, hello) == tokenizer.decode([hello])


def test_tokenizer_that_overrides_decode_is_still_called(tokenizer):
    # The detokenizer skips transformers' decode wrapper for a plain fast tokenizer; a
    # subclass with its own decode must keep going through it.
    class Shouting(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer, clean_up_tokenization_spaces=False)
    ids = encode(tokenizer, "Hello world")
    detok = IncrementalDetokenizer(shouting, [1], SamplingParams())
    stream(detok, ids, None)
    assert detok.output_text == "HELLO WORLD"

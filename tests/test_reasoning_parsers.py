"""Reasoning parsers (qwen3, deepseek_r1): `<think>` text split into reasoning and content.

Fixed completions with their expected split written out; streaming (one character at a time,
split in two at every boundary, random chunkings with a fixed seed) concatenates to the same.
`is_reasoning_end` is checked on ids from a real tokenizer with the tags as single tokens.
"""
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.reasoning import REASONING_PARSERS, get_reasoning_parser

COMMON_CASES = [
    # (completion, expected reasoning, expected content), the same for both parsers
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", "\nLet me think.\n", "\n\nThe answer is 4."),
    ("\n <think>a</think>b", "a", "b"),
    ("<think></think>", None, None),
    ("<think>unfinished", "unfinished", None),
    ("<think>a < b </thin k> c</think>d</think>e", "a < b </thin k> c", "d</think>e"),
    ("<think>考虑 🤔</think>答案：四", "考虑 🤔", "答案：四"),
    ("", None, None),
]
QWEN3_CASES = COMMON_CASES + [
    # Not opened with <think>: all answer, tags included.
    ("The answer is 4.", None, "The answer is 4."),
    ("Answer </think> tail", None, "Answer </think> tail"),
    ("   ", None, "   "),
    ("<thi", None, "<thi"),
    ("x<think>y</think>", None, "x<think>y</think>"),
]
DEEPSEEK_R1_CASES = COMMON_CASES + [
    # The prompt opened <think>: thinking until </think>, all of it if none comes.
    ("Let me think.\n</think>\n\nAnswer.", "Let me think.\n", "\n\nAnswer."),
    ("</think>only the answer", None, "only the answer"),
    ("all thinking", "all thinking", None),
    ("  x", "  x", None),
    ("<thi", "<thi", None),
    ("  <think>x", "x", None),
]
CASES = [("qwen3", *case) for case in QWEN3_CASES] + [("deepseek_r1", *case) for case in DEEPSEEK_R1_CASES]
CASE_IDS = [f"qwen3-{i}" for i in range(len(QWEN3_CASES))] + [f"deepseek_r1-{i}" for i in range(len(DEEPSEEK_R1_CASES))]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def stream(parser_name: str, chunks: list[str]) -> tuple[str | None, str | None]:
    streamer = get_reasoning_parser(parser_name)().streamer()
    deltas = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    return "".join(r for r, _ in deltas) or None, "".join(c for _, c in deltas) or None


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), CASES, ids=CASE_IDS)
def test_extract(parser_name, text, reasoning, content):
    assert get_reasoning_parser(parser_name)().extract(text) == (reasoning, content)


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), CASES, ids=CASE_IDS)
def test_streaming_equals_extract_at_every_split(parser_name, text, reasoning, content):
    assert stream(parser_name, list(text)) == (reasoning, content)
    for i in range(len(text) + 1):
        assert stream(parser_name, [text[:i], text[i:]]) == (reasoning, content), f"split at {i}"
    rng = random.Random(32)
    for _ in range(20):
        chunks = random_chunks(text, rng)
        assert stream(parser_name, chunks) == (reasoning, content), f"chunks {chunks!r}"


def test_streamer_holds_only_a_partial_tag():
    streamer = get_reasoning_parser("qwen3")().streamer()
    assert streamer.feed("<thi") == ("", "")
    assert streamer.feed("nk>Hmm, 2+2</thi") == ("Hmm, 2+2", "")
    assert streamer.feed("nk>\n\n4") == ("", "\n\n4")
    assert streamer.finish() == ("", "")
    answer = get_reasoning_parser("qwen3")().streamer()
    assert answer.feed("Four") == ("", "Four")  # no <think> opening: the answer streams at once


def word_tokenizer(special_tags: list[str]) -> Tokenizer:
    vocab = {word: i for i, word in enumerate(["[UNK]", "user", "assistant", "hello", "hmm", "answer", "old", "new"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(special_tags)
    return tokenizer


@pytest.fixture(params=["tokenizers", "transformers"])
def tokenizer(request):
    raw = word_tokenizer(TAGS)
    return raw if request.param == "tokenizers" else PreTrainedTokenizerFast(tokenizer_object=raw)


def ids_of(tokenizer, text: str) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(encoded, "ids", encoded))


@pytest.mark.parametrize(("parser_name", "prompt", "output", "ended"), [
    ("qwen3", "user hello assistant", "", False),                       # may be about to think
    ("qwen3", "user hello assistant", "<think> hmm", False),
    ("qwen3", "user hello assistant", "<think> hmm </think>", True),
    ("qwen3", "user hello assistant", "<think> hmm </think> answer", True),
    ("qwen3", "user hello assistant <think> </think>", "", True),     # enable_thinking=False
    ("qwen3", "<think> old </think> user hello assistant", "<think> new", False),  # history closed, new open
    ("deepseek_r1", "user hello assistant <think>", "hmm", False),
    ("deepseek_r1", "user hello assistant <think>", "hmm </think> answer", True),
    ("deepseek_r1", "user hello assistant", "hmm </think>", True),
])
def test_is_reasoning_end(tokenizer, parser_name, prompt, output, ended):
    parser = get_reasoning_parser(parser_name)(tokenizer)
    assert parser.start_token_id == ids_of(tokenizer, "<think>")[0]
    assert parser.end_token_id == ids_of(tokenizer, "</think>")[0]
    assert parser.is_reasoning_end(ids_of(tokenizer, f"{prompt} {output}")) is ended


def test_is_reasoning_end_needs_the_end_tag_as_one_token():
    parser = get_reasoning_parser("qwen3")(word_tokenizer([]))  # "</think>" splits into "</", "think", ">"
    assert parser.start_token_id is None and parser.end_token_id is None
    with pytest.raises(ValueError, match="</think>"):
        parser.is_reasoning_end([1, 2])
    assert get_reasoning_parser("qwen3")().end_token_id is None  # no tokenizer: text-only use


def test_tools_checkpoint_has_the_tags_as_single_tokens(tiny_qwen3_tools):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_tools)
    parser = get_reasoning_parser("qwen3")(tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt + "<think>\nhmm\n</think>\n\n4", add_special_tokens=False)
    assert parser.end_token_id is not None and parser.is_reasoning_end(ids)
    assert not parser.is_reasoning_end(ids[:ids.index(parser.end_token_id)])


def test_every_parser_is_registered_and_unknown_names_list_the_choices():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match=r"'nope'.*deepseek_r1, qwen3"):
        get_reasoning_parser("nope")

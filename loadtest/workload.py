"""Synthetic workloads: random token-id prompts (offline), prompts that repeat a span (offline,
speculative decoding) and random-word prompts (online).

Everything is drawn from one `random.Random(seed)`, so a workload is a pure
function of its arguments: the same seed gives the same requests on every
machine and Python version.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Common one-token English words: with most BPE vocabularies a prompt of N of
# them, space-separated, is about N tokens, so `--input-len` means tokens.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water been "
    "call who oil its now find long down day did get come made may part over new sound take only "
    "little work know place year live me back give most very after thing our just name good man "
    "think say great where help through much before line right too mean old any same tell boy "
    "follow came want show also around form three small set put end does another well large must "
    "big even such because turn here why ask went men read need land different home us move try "
    "kind hand picture again change off play spell air away animal house point page letter mother"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One offline request: what to feed and how many tokens to generate."""

    prompt_token_ids: list[int]  # random ids, never special tokens
    max_tokens: int              # generated exactly (ignore_eos), all of them useful


def _check_range(name: str, lo_hi: tuple[int, int], minimum: int) -> None:
    lo, hi = lo_hi
    if not minimum <= lo <= hi:
        raise ValueError(f"{name}={lo_hi!r} is invalid: need {minimum} <= low <= high")


def prompt_id_limit(model_dir: Path) -> int:
    """The end of the ids a random prompt for this checkpoint should draw from: its tokenizer's
    size where that is below the config's vocab_size.

    The shape presets (engine.tools.tiny_model) pad vocab_size to the real model's (151,936 for
    Qwen3) with zero embeddings past their 4,000-token tokenizer. A prompt drawn from all of it is
    ~97% padding ids; the random model then emits special tokens, which stream no text at all.
    """
    from tokenizers import Tokenizer

    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tokenizer = Path(model_dir) / "tokenizer.json"
    if not tokenizer.exists():
        return vocab_size
    return min(vocab_size, Tokenizer.from_file(str(tokenizer)).get_vocab_size())


def make_offline_workload(num_requests: int, seed: int, vocab_size: int,
                          prompt_len: tuple[int, int], output_len: tuple[int, int],
                          first_token_id: int = 3) -> list[BenchRequest]:
    """`num_requests` requests with lengths uniform in the closed ranges given.

    Token ids are uniform in [first_token_id, vocab_size): the low ids are the
    tiny model's special tokens (pad/bos/eos), which a real prompt would not
    carry in its middle and which HF treats specially when padding.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    _check_range("prompt_len", prompt_len, 1)
    _check_range("output_len", output_len, 1)
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"vocab_size={vocab_size} leaves no ids at or above {first_token_id}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_len)
        n_out = rng.randint(*output_len)
        ids = [rng.randrange(first_token_id, vocab_size) for _ in range(n_prompt)]
        requests.append(BenchRequest(prompt_token_ids=ids, max_tokens=n_out))
    return requests


def make_copy_workload(num_requests: int, seed: int, vocab_size: int, prompt_len: tuple[int, int],
                       output_len: tuple[int, int], span_len: tuple[int, int] = (8, 32),
                       first_token_id: int = 3) -> list[BenchRequest]:
    """Requests whose text repeats itself, for speculative decoding: each prompt is one random span
    of `span_len` tokens written out again and again up to its length (a document quoted and
    re-quoted, the input of an edit or an extraction), decoded greedily.

    A random-weight model copies nothing it reads: its drafts then come from the n-grams its own
    greedy text repeats here and there (now and then a short loop), which prompt lookup predicts
    as it predicts a copied span. So the workload runs speculation's whole machinery on text that
    partly repeats itself; a trained model editing or extracting from its prompt copies longer
    spans (`loadtest.offline --speculative ngram --model ...` measures one).
    """
    _check_range("span_len", span_len, 1)
    base = make_offline_workload(num_requests, seed, vocab_size, prompt_len, output_len, first_token_id)
    rng = random.Random(seed + 1)
    requests = []
    for r in base:
        span = r.prompt_token_ids[:rng.randint(*span_len)]
        n = len(r.prompt_token_ids)
        requests.append(BenchRequest(prompt_token_ids=(span * (n // len(span) + 1))[:n], max_tokens=r.max_tokens))
    return requests


def num_useful_tokens(requests: list[BenchRequest]) -> int:
    """Each request's own output length counts; padding never does."""
    return sum(r.max_tokens for r in requests)


def make_word_prompts(num_prompts: int, input_len: int, seed: int) -> list[str]:
    """Online prompts of `input_len` random words each, all different from the first word on
    (so a prefix cache cannot turn the benchmark into a cache benchmark)."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts={num_prompts} and input_len={input_len} must be >= 1")
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(num_prompts)]


def make_token_id_prompts(num_prompts: int, input_len: int, seed: int,
                          low: int = 10, high: int = 1000) -> list[list[int]]:
    """Online prompts as token-id lists, ids in [low, high): valid in any vocabulary of >= 1000
    and clear of the usual special ids at the bottom."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts={num_prompts} and input_len={input_len} must be >= 1")
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num_prompts)]


@dataclass(frozen=True)
class Conversation:
    """One chat of a multi-turn workload: a user message per turn, the answers come from the server."""

    system: str             # shared by every conversation of the workload
    user_turns: list[str]   # sent in order, each after the answer to the one before


def make_conversations(num_conversations: int, num_turns: int, system_len: int, user_len: int,
                       seed: int) -> list[Conversation]:
    """Conversations sharing one system prompt of `system_len` random words, each user message
    `user_len` words (its first word numbers the conversation and turn: no two messages alike)."""
    sizes = {"num_conversations": num_conversations, "num_turns": num_turns, "system_len": system_len,
             "user_len": user_len}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_len))
    return [Conversation(system, [" ".join([f"c{c}t{t}"] + [rng.choice(WORDS) for _ in range(user_len - 1)])
                                  for t in range(num_turns)])
            for c in range(num_conversations)]

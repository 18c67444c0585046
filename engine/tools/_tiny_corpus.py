"""Built-in training text for the tiny BPE tokenizer in `engine.tools.tiny_model`.

Kept in its own module so the builder stays readable. The text only has to
be varied (prose, code, JSON, numbers, non-ASCII) and *fixed*: the tokenizer
is retrained from it on every build, so editing it changes every tiny model.
"""

PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles
begins with a single step. It was the best of times, it was the worst of times.
Language models predict the next token given the previous ones. During decoding
the model reads its own output back, one token at a time, and a cache keeps the
keys and values of earlier positions so that they are not recomputed.
Paged attention stores that cache in fixed-size blocks, much like virtual memory
in an operating system: a block table maps logical positions to physical blocks.
The scheduler decides which requests run in each step. When memory runs short it
may preempt a request, free its blocks, and recompute them later.
Once upon a time there was a small village at the edge of a great forest. Every
morning the baker opened her shop, and the smell of fresh bread filled the street.
Children ran to school, farmers drove their carts to the market, and old men sat
on the bench by the fountain, talking about the weather and the price of wheat.
Q: What is the capital of France? A: Paris is the capital of France.
Q: How many days are in a week? A: There are seven days in a week.
Please summarize the following paragraph in one sentence.
Translate the sentence into German: "Good morning, how are you today?"
Write a short poem about the sea, the wind, and the stars at night.
Rain falls softly on the roof; the river rises; the bridge holds.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -17 1e-6 65536.
Dates: 2024-01-15, 1999-12-31, March 3rd, the 21st century, 10:45 PM.
Email: alice@example.com, URL: https://example.org/path?query=value&x=1#top
"""

CODE = '''\
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class BlockAllocator:
    def __init__(self, num_blocks):
        self.free = list(range(num_blocks))
        self.ref_count = [0] * num_blocks

    def allocate(self):
        if not self.free:
            raise RuntimeError("out of blocks")
        block = self.free.pop()
        self.ref_count[block] = 1
        return block

import torch
x = torch.randn(4, 8, dtype=torch.float32)
y = torch.softmax(x @ x.T / 8 ** 0.5, dim=-1)
print(f"shape={tuple(y.shape)} sum={y.sum().item():.3f}")

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
#include <stdio.h>
int main(void) { printf("hello, world\\n"); return 0; }
SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;
$ pip install -e . && python -m pytest -q tests/
fn main() { let v: Vec<u32> = (1..=10).map(|x| x * x).collect(); }
const add = (a, b) => a + b; export default { add };
'''

JSON = """\
{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi!"}], "stream": true}
{"id": "chatcmpl-123", "object": "chat.completion", "created": 1700000000,
 "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."},
 "finish_reason": "stop"}], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
{"name": "get_weather", "parameters": {"type": "object", "properties":
 {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
 "required": ["city"]}}
[1, 2, 3, null, false, true, -0.5, "text", {"nested": {"deep": [[], {}]}}]
"""

# Multi-byte UTF-8 so that byte-level merges and partial-character decoding
# are exercised (2-, 3- and 4-byte sequences).
UNICODE = """\
Café, naïve, façade, résumé, jalapeño, Zürich, Ångström, smörgåsbord, Œuvre.
日本語のテキストです。東京は日本の首都です。こんにちは世界。
中文文本：今天天气很好。我们一起去公园散步吧。
한국어 문장입니다. 안녕하세요!  Русский текст: привет, мир!  Ελληνικά: γειά σου κόσμε.
العربية: مرحبا بالعالم.  עברית: שלום עולם.  हिन्दी: नमस्ते दुनिया।
Emoji: 🙂 😀 🚀 🎉 👍 ❤️ 🐍 🔥 ✨ — “quotes” ‘single’ … € £ ¥ © ® ™ ± × ÷ ≤ ≥ ≠ ∞ √ π.
"""

_WORDS = (
    "apple river stone cloud engine token block cache value model layer "
    "window garden silver market winter summer candle signal orange planet "
    "number thread kernel vector matrix little quiet bright heavy gentle"
).split()


def generated_lines(n: int) -> list[str]:
    """Deterministic filler so a ~4k vocab has enough distinct words to learn.

    A linear congruential generator (not `random`) keeps the output identical
    across Python versions.
    """
    state, out = 12345, []
    for i in range(n):
        picks = []
        for _ in range(6):
            state = (state * 1103515245 + 12345) % 2**31
            picks.append(_WORDS[state % len(_WORDS)])
        a, b = picks[0], picks[1]
        out.append(
            f"{' '.join(picks)}. {a}_{b}_{i} = {state % 9973}; "
            f'{{"{a}{b}": {i * 37 % 1000}, "id{i}": "{b}{i}"}}'
        )
    return out


def corpus_lines(n_generated: int) -> list[str]:
    text = PROSE + CODE + JSON + UNICODE
    return text.splitlines(keepends=True) + generated_lines(n_generated)

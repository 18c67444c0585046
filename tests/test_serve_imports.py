"""The HTTP tier (Ingress and Guardrails replicas) runs without torch and triton.

Each check runs in a fresh interpreter: the test process itself has torch loaded already.
"""
import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from serve_app.http.preprocess import ModelLimits, PrepJob, prepare_batch

ROOT = Path(__file__).resolve().parents[1]
HTTP_TIER = "import serve_app.http.ingress, serve_app.guard.guardrails\n"
JOBS = [{"max_tokens": 4, "prompts": ["Hello there, world"]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "Say hi"}]}]
LIMITS = ModelLimits(max_model_len=2048, vocab_size=10**6)


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_importing_the_http_tier_loads_no_torch_or_triton():
    out = _run(HTTP_TIER + "import sys\nprint(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    assert out.split() == ["[]"], f"the HTTP tier's modules import {out.strip()}"


def test_http_tier_tokenizes_the_same_without_torch_installed(tiny_llama):
    # None in sys.modules: `import torch` fails, and importlib.util.find_spec (what transformers
    # asks) says it is absent, as on an HTTP-tier image that does not install it.
    code = ("import sys\nsys.modules['torch'] = sys.modules['triton'] = None\n" + HTTP_TIER +
            "import json\nfrom serve_app.http.ingress import _load_tokenizer\n"
            "from serve_app.http.preprocess import ModelLimits, PrepJob, prepare_batch\n"
            f"tok = _load_tokenizer({tiny_llama!r})\n"
            f"jobs = [PrepJob(**j) for j in json.loads({json.dumps(JOBS)!r})]\n"
            "out = prepare_batch(tok, jobs, ModelLimits(max_model_len=2048, vocab_size=10**6))\n"
            "print(json.dumps([p.prompt_token_ids for p in out]))")
    without_torch = json.loads(_run(code).splitlines()[-1])
    # The same jobs in this process, where transformers sees torch (as the engine replicas do).
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    expected = [p.prompt_token_ids for p in prepare_batch(tok, [PrepJob(**j) for j in JOBS], LIMITS)]
    assert all(ids and ids[0] for ids in expected)  # each job produced a non-empty prompt
    assert without_torch == expected

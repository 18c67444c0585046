"""Development tools built on the engine; nothing in the engine imports them.

    python -m engine.tools.demo_model [--out models]   fetch the demo checkpoint (SmolLM2-135M-Instruct GGUF)
    python -m engine.tools.demo --model DIR            offline generation demo with a progress bar
    python -m engine.tools.tiny_model --out DIR        a random-weight HF checkpoint for tests and benchmarks

They live inside the engine package so that `pip install .` (and the deploy image) carries
them with no packaging of their own.
"""

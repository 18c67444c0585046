"""Benchmarks of the serving system (method: docs/benchmarks.md, "How we measure").

    python -m loadtest.offline     CPU offline throughput against HF static batching
    python -m loadtest.gpu_bench   GPU workloads A and B against HF static and continuous batching
    python -m loadtest             online serving against any OpenAI-compatible endpoint

Pure pieces (workloads, FLOP and byte arithmetic, percentiles, the knee, SSE
parsing) import no torch, so they are tested on any machine.
"""

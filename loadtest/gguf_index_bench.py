"""Time reading a GGUF file's tensor index: engine.loader.gguf_index against the `gguf` package's
reader (what the loader used before), in the same run.

    python -m loadtest.gguf_index_bench [--model PATH] [--repeats 5] [--out bench_out/gguf_index_bench.json]

PATH: a .gguf file or a directory holding one (default: the demo model, fetched as `make serve`
fetches it). Both readers list the same tensors (checked before timing); times are the best of
--repeats reads in seconds, the file in the page cache after the first.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loadtest.report import base_metadata, write_json


def best_of(read, path: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read(path)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m loadtest.gguf_index_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file or a directory with one (default: the demo model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench_out/gguf_index_bench.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    from gguf import GGUFReader

    from engine.loader.gguf_config import find_gguf
    from engine.loader.gguf_index import GGUFIndex

    path = Path(args.model) if args.model else _demo_model()
    path = find_gguf(path)
    if path is None:
        ap.error(f"--model={args.model}: no .gguf file there")
    if [t.name for t in GGUFIndex(path).tensors] != [t.name for t in GGUFReader(path).tensors]:
        raise SystemExit(f"{path.name}: the two readers list different tensors")
    theirs, ours = best_of(GGUFReader, path, args.repeats), best_of(GGUFIndex, path, args.repeats)
    report = {**base_metadata(["python -m loadtest.gguf_index_bench", *argv]), "file": path.name,
              "gguf_reader_s": theirs, "gguf_index_s": ours, "speedup": theirs / ours}
    print(f"{path.name}: gguf.GGUFReader {theirs:.3f} s, engine GGUFIndex {ours:.3f} s ({theirs / ours:.1f}x)")
    write_json(args.out, report)
    return report


def _demo_model() -> Path:
    from engine.tools.demo_model import fetch_demo_model

    return fetch_demo_model(Path("models"))


if __name__ == "__main__":
    main()

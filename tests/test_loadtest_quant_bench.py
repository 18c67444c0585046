"""loadtest.quant_bench on CPU at toy sizes: one engine per (quantization, KV dtype) pair, each row its own."""
from loadtest.quant_bench import main


def test_each_pair_runs_and_int8_weights_are_smaller(tiny_llama, tmp_path):
    out = main(["--model", tiny_llama, "--device", "cpu", "--dtype", "float32", "--num-seqs", "2",
                "--prompt-len", "8", "--output-len", "4", "--quantizations", "none,int8",
                "--kv-cache-dtypes", "auto,fp8", "--out", str(tmp_path / "q.json")])
    rows = {(r["quantization"], r["kv_cache_dtype"]): r for r in out["rows"]}
    assert set(rows) == {("none", "auto"), ("none", "fp8"), ("int8", "auto"), ("int8", "fp8")}
    assert all(r["output_tokens"] == 2 * 4 and r["roofline"] is None for r in rows.values())
    assert rows["int8", "auto"]["weight_gb"] < 0.9 * rows["none", "auto"]["weight_gb"]  # the embedding stays fp32
    assert (tmp_path / "q.json").is_file()

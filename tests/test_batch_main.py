"""python -m serve_app.batch: arguments refused before any Ray cluster starts."""
import pytest

from serve_app.batch.__main__ import _config, main, parse_args


def test_bad_arguments_exit_2_naming_them(tiny_llama, tmp_path, capsys):
    base = ["--model", tiny_llama, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]
    assert main(base + ["--template", str(tmp_path / "missing.j2")]) == 2
    assert "cannot read the template file" in capsys.readouterr().err
    assert main(base + ["--num-replicas", "0"]) == 2
    assert "num_replicas=0 is invalid" in capsys.readouterr().err
    regex = tmp_path / "regex.json"
    regex.write_text('{"type": "regex", "regex": "(a)\\\\1"}')
    assert main(base + ["--response-format", str(regex)]) == 2
    assert "structured_outputs.regex is invalid: backreferences" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one prompt source only
        parse_args(base + ["--prompt-column", "p", "--template", "t.j2"])


def test_arguments_become_the_config(tiny_llama, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    args = parse_args(["--model", tiny_llama, "--input", "x.csv", "--output", "o", "--chat", "--seed", "3",
                       "--temperature", "0.5", "--response-format", str(schema), "--max-num-seqs", "8",
                       "--tensor-parallel-size", "2", "--device", "cuda", "--address", "local",
                       "--continue-on-error"])
    config = _config(args)
    assert config.continue_on_error and not _config(parse_args(["--model", tiny_llama, "--input", "x.csv",
                                                                "--output", "o"])).continue_on_error
    assert (config.chat, config.seed, config.temperature, config.tensor_parallel_size) == (True, 3, 0.5, 2)
    assert config.response_format == {"type": "object"} and config.engine_kwargs == {"max_num_seqs": 8}
    assert config.prompt_column == "prompt" and config.batch_size == 256


def test_lora_flags_become_the_config(tiny_llama):
    config = _config(parse_args(["--model", tiny_llama, "--input", "x.jsonl", "--output", "o", "--lora", "sql=/a/sql",
                                 "--lora", "chat=/a/chat", "--lora-column", "adapter", "--max-loras", "2"]))
    assert (config.loras, config.lora_column) == ({"sql": "/a/sql", "chat": "/a/chat"}, "adapter")
    assert config.engine_kwargs == {"max_loras": 2} and config.llm_kwargs()["enable_lora"]


def test_concurrent_batches_keep_the_engine_full_unless_set(tiny_llama, capsys):
    base = ["--model", tiny_llama, "--input", "x.jsonl", "--output", "o"]
    # the engine's running batch full, plus one batch queued behind it
    assert _config(parse_args(base)).concurrent_batches() == 2  # 256 rows per batch, max_num_seqs 256
    assert _config(parse_args(base + ["--batch-size", "32", "--max-num-seqs", "64"])).concurrent_batches() == 3
    assert _config(parse_args(base + ["--max-concurrent-batches", "5"])).concurrent_batches() == 5
    assert main(base + ["--max-concurrent-batches", "0"]) == 2
    assert "max_concurrent_batches=0 is invalid" in capsys.readouterr().err

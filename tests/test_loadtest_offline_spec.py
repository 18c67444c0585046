"""loadtest/offline_spec.py's engines: the baseline and the speculating engine differ only in
speculative_config, on the device, dtype and overlap the flags name."""
from pathlib import Path

import pytest

from loadtest.offline_spec import engine_kwargs, parse_args


def test_both_engines_take_the_device_dtype_and_overlap_flags():
    args = parse_args(["--speculative", "ngram", "--device", "cuda", "--dtype", "bfloat16",
                       "--async-scheduling", "off", "--concurrency", "1,64"])
    base, spec = (engine_kwargs(Path("m"), args, s) for s in (False, True))
    assert spec.pop("speculative_config") == {"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert base == spec == {"model": "m", "dtype": "bfloat16", "device": "cuda", "max_num_seqs": 64, "seed": 0,
                            "async_scheduling": False}


def test_the_defaults_are_the_cpu_box_and_the_engines_own_overlap():
    kwargs = engine_kwargs(Path("m"), parse_args(["--speculative", "ngram"]), False)
    assert (kwargs["device"], kwargs["dtype"], kwargs["async_scheduling"]) == ("cpu", "float32", None)


def test_an_unknown_overlap_setting_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--speculative", "ngram", "--async-scheduling", "yes"])
    assert "--async-scheduling" in capsys.readouterr().err

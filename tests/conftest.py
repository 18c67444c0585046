"""Shared fixtures: tiny random-weight HF checkpoints built on the fly.

KV leaks are checked where engines run, not here: engine tests call
`BlockManager.check_no_leak()` after their requests, and the Serve fault tests
(tests/test_serve_faults.py) wait for the replica's stats to be at rest (0 running,
0 waiting, KV usage 0) after bursts and dropped clients."""
import os

import torch

# Triton kernels run under the interpreter on CPU; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine.tools.tiny_model import make_tiny_model  # noqa: E402


def _build(tmp_path_factory, arch: str, **kw):
    return str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, preset="tiny", seed=0, **kw))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return _build(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return _build(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return _build(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session", autouse=True)
def gguf_view_cache(tmp_path_factory):
    """GGUF views (engine.loader.gguf_config) of this session's files go to a temporary cache, not ~/.cache."""
    if "RAYLLM_GGUF_CACHE" in os.environ:
        yield os.environ["RAYLLM_GGUF_CACHE"]
        return
    os.environ["RAYLLM_GGUF_CACHE"] = str(tmp_path_factory.mktemp("gguf-views"))
    yield os.environ["RAYLLM_GGUF_CACHE"]
    del os.environ["RAYLLM_GGUF_CACHE"]


# -- leaving the test process -------------------------------------------------------------------
# The suite starts and stops a dozen local Ray clusters in this one process. Once, at fresh-clone
# CI of 153a2b4, every test passed and the interpreter then died with SIGSEGV during its own
# shutdown (no Python stack: past faulthandler, in native teardown of what Ray and gRPC leave
# in the process), so `make test` failed a passing run. The process now leaves with pytest's
# exit status as soon as pytest is done (os._exit), skipping that teardown; a crash while tests
# run is still caught by -X faulthandler. RAYLLM_TEST_FULL_EXIT=1 keeps the full shutdown.
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or os.environ.get("RAYLLM_TEST_FULL_EXIT") == "1":
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_EXIT_STATUS = pytest.StashKey[int]()

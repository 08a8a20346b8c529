# Two entry points (see README): `make demo` and `make test`; both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision pinned to releases that install together (torchvision is needed by the Qwen-VL processors)
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# transformers pinned to the release whose own tests `make compat` runs (../shared/compat/transformers-tests is taken
# from 5.24.0: its tests/*.py import helpers that 5.25 removed); the library itself accepts transformers>=5.17,<6
TRANSFORMERS_SPEC ?= transformers==5.24.0

.PHONY: demo test clean compat

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]' $(TRANSFORMERS_SPEC)
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/vismemo demo

test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache

# transformers' own tests of every supported family with VisMemo in the loop (TESTS: a tree such as
# ../shared/compat/transformers-tests); MODE=enable (every model enabled) or cache (every generate a VisMemoCache)
TESTS ?= ../shared/compat/transformers-tests
MODE ?= enable
compat: $(VENV)/.installed
	$(PY) tests/compat/run.py $(TESTS) --mode $(MODE)

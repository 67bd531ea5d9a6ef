# Two jobs a new machine needs: `make demo` and `make test` (each installs what it needs first).
# GPU machines bring their own torch: `make install TORCH=` skips the CPU wheel.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TARGET ?=
PROMPT ?= def fibonacci(n):
DEMO_DIR := out/demo-random-llama

.PHONY: install demo lint protos test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# torch first, from the pinned CPU wheel, so nothing pulls a multi-GB CUDA build.
	$(if $(TORCH),$(PY) -m pip install -q $(TORCH))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Generates from TARGET (a Hugging Face checkpoint dir); without one, from a small random-weight
# Llama written on the spot (its text is noise; the embedded trained model replaces it).
demo: install
ifeq ($(TARGET),)
	test -f $(DEMO_DIR)/config.json || $(PY) -m tandem.random_model --arch llama --out $(DEMO_DIR)
	$(VENV)/bin/tandem generate --target $(DEMO_DIR) --max-new-tokens 32 --ignore-eos --json "w10 w20 w30"
else
	$(VENV)/bin/tandem generate --target $(TARGET) --max-new-tokens 64 "$(PROMPT)"
endif

protos: install
	$(PY) protos/generate.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) protos/generate.py --check
	cd protos && ../$(VENV)/bin/buf lint

# pytest exits 5 when it collected nothing: that is a failure here, like any non-zero code.
test: lint
	$(PY) -m pytest -q -p no:cacheprovider

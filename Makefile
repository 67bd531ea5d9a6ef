# Two jobs a new machine needs: `make demo` and `make test` (each installs what it needs first).
# GPU machines bring their own torch: `make install TORCH=` skips the CPU wheel.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TARGET ?=
PROMPT ?= def fibonacci(n):
DRAFT ?=
DRAFT_KIND ?=

.PHONY: install demo lint protos test test-quick compose-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# torch first, from the pinned CPU wheel, so nothing pulls a multi-GB CUDA build.
	$(if $(TORCH),$(PY) -m pip install -q $(TORCH))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The full local demo: draft, target and gateway as three processes, one streamed generation,
# its speculation statistics. Without TARGET it serves the embedded reference model
# (checkpoints/tandem-code-ref: a small code model and its EAGLE-3 head); TARGET (and DRAFT,
# DRAFT_KIND) pick other checkpoints.
demo: install
	$(VENV)/bin/tandem demo $(if $(TARGET),--target $(TARGET)) --prompt "$(PROMPT)" \
		$(if $(DRAFT),--draft $(DRAFT)) $(if $(DRAFT_KIND),--draft-kind $(DRAFT_KIND))

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

# The development loop: tests/unit and tests/kernels without the tests marked slow (more than a
# few seconds each) or e2e (they start processes), in under 3 minutes on a 2-core machine, no
# lint first. `make test` runs everything, as CI does.
test-quick: install
	$(PY) -m pytest -q -p no:cacheprovider tests/unit tests/kernels -m "not gpu and not e2e and not slow"

# compose.yaml for real (tests/deploy/test_compose_up.py): a Docker engine (docker/engine.sh starts
# one), the base image from Debian's packages (docker/base-image.sh), the CPU image, the cpu profile
# up and healthy, generations compared with `tandem generate`, the draft killed, down. `make test`
# runs it too, and skips it where no engine can start; here that fails instead.
compose-test: install
	TANDEM_COMPOSE_TEST=require $(PY) -m pytest -q -p no:cacheprovider tests/deploy/test_compose_up.py

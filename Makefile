# The newcomer's commands: `make demo` (the main job) and `make test` (everything CI runs).
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
export METAX_CACHE ?= $(HOME)/.cache/metax-operator
PY := .venv/bin/python
PYTEST := $(PY) -m pytest

.PHONY: setup test demo bench image
setup:
	@scripts/setup

test: setup
	$(PYTEST) -n 2 --dist loadgroup tests

demo: setup
	@scripts/demo

bench: setup
	$(PY) -m tests.bench

# The tools image as an OCI layout under $(METAX_CACHE)/image (docs/image.md); needs root.
image: setup
	@scripts/image build

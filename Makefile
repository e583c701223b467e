# The newcomer's commands: `make demo` (the main job) and `make test` (everything CI runs).
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
export METAX_CACHE ?= $(HOME)/.cache/metax-operator
PY := .venv/bin/python
PYTEST := $(PY) -m pytest

.PHONY: setup lint test demo bench image package
setup:
	@scripts/setup

# ruff (configured in pyproject.toml) over every Python file of the repository: the lint rules,
# then the formatting.
lint: setup
	.venv/bin/ruff check --no-cache .
	.venv/bin/ruff format --no-cache --check .

test: setup lint
	$(PYTEST) -n 2 --dist loadgroup tests

demo: setup
	@scripts/demo

bench: setup
	$(PY) -m tests.bench

# The tools image as an OCI layout under $(METAX_CACHE)/image (docs/image.md); needs root.
image: setup
	@scripts/image build

# The offline package of the release under dist/ (docs/release.md): the chart, the tools image (built
# first: needs root), the image list, the SBOM, the push command; reproducible. `scripts/package --sign NAME ...` signs the chart.
package: setup
	@scripts/package

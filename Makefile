# The newcomer's commands: `make demo` (the main job) and `make test` (every test that needs no
# cluster: minutes). `make e2e` runs the others (a real API server, the real node, the registry,
# GitOps, the release) but those on the Kubernetes version matrix, which `make matrix` runs (six
# more Kubernetes builds, half an hour or more cold); CI runs `make test` and `make e2e` (.ci/run).
# The tiers: tests/tiers.py. Each target sets up only what it needs (scripts/setup PROFILE:
# cached, a warm run is a few stat calls); `make setup` sets up what every target needs.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
export METAX_CACHE ?= $(HOME)/.cache/metax-operator
PY := .venv/bin/python
# A failed setup step names the target to run again.
SETUP = METAX_SETUP='make $@' scripts/setup

.PHONY: setup lint test e2e matrix demo bench image package
setup:
	@$(SETUP)

# ruff (configured in pyproject.toml) over every Python file of the repository: the lint rules,
# then the formatting.
lint:
	@$(SETUP) lint
	.venv/bin/ruff check --no-cache .
	.venv/bin/ruff format --no-cache --check .

# A test that starts a cluster binary here fails, saying to mark it e2e (METAX_TEST_TIER). One
# xdist worker more than the cores: a worker asleep in a client's retry backoff leaves its core to
# another (2 cores: 4 min 30 s with 3 workers, 5 min 00 s with 2).
test: lint
	@$(SETUP) test
	METAX_TEST_TIER=test $(PY) -m pytest -n $$(( $$(nproc) + 1 )) --dist loadgroup -m "not e2e" tests

e2e:
	@METAX_SETUP='make $@' scripts/e2e

matrix:
	@METAX_SETUP='make $@' scripts/matrix

demo:
	@METAX_SETUP='make $@' scripts/demo

bench:
	@$(SETUP) demo
	$(PY) -m tests.bench

# The tools image as an OCI layout under $(METAX_CACHE)/image (docs/image.md); needs root.
image:
	@$(SETUP) image
	@scripts/image build

# The offline package of the release under dist/ (docs/release.md): the chart, the tools image (built
# first: needs root), the image list, the SBOM, the push command; reproducible. `scripts/package --sign NAME ...` signs the chart.
package:
	@$(SETUP) package
	@scripts/package

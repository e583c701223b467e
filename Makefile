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

# A test that starts a cluster binary here fails, saying to mark it e2e (METAX_TEST_TIER). Two
# xdist workers more than the cores, and an idle worker steals tests from a busy one's queue: a
# worker asleep in a client's retry backoff leaves its core to another, and the longest tests do
# not end the run alone (2 cores: 3 min 20 s to 3 min 45 s so, 4 min 05 s to 4 min 28 s with 3
# workers sharing the tests out at the start; 2 min 29 s to 2 min 41 s on a faster 2-core
# machine, docs/control-plane.md). No test of this tier is pinned to a worker
# (`xdist_group`: those are e2e, `make e2e` runs them with --dist loadgroup).
test: lint
	@$(SETUP) test
	METAX_TEST_TIER=test $(PY) -m pytest -n $$(( $$(nproc) + 2 )) --dist worksteal -m "not e2e" tests

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

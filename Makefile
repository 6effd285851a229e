# r3srv developer entry points. `make test` works on a fresh machine: it creates
# .venv, builds the Rust extension, installs the test dependencies and runs every test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-data verl-env verifiers-env openrlhf-env rl-clients-env test-fast test-peer test-gpu test-rust test-python fmt-check bench bench-gate bench-smoke fuzz-deep serve

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install "pip==26.3"  # editable installs of maturin projects need a recent pip

# Always re-run: pip skips what is satisfied, maturin rebuilds the extension.
install: $(BIN)/python
	$(BIN)/pip install -e ".[test]"

# verl's, OpenRLHF's, prime-rl's, SkyRL's and AReaL's clients' environments (mostly downloads) build while
# the Rust tests compile and run
test: install test-data
	{ [ -x .verl_venv/bin/python ] || tools/verl_env.sh .verl_venv; } & verl=$$!; \
	{ [ -x .openrlhf_venv/bin/python ] || tools/openrlhf_env.sh .openrlhf_venv; } & orl=$$!; \
	{ [ -x .verifiers_venv/bin/python ] || tools/verifiers_env.sh .verifiers_venv; } & vf=$$!; \
	{ [ -x .rl_clients_venv/bin/python ] || tools/rl_clients_env.sh .rl_clients_venv; } & rl=$$!; \
	cargo test --release; rust=$$?; wait $$verl || exit 1; wait $$orl || exit 1; wait $$vf || exit 1; wait $$rl || exit 1; \
	exit $$rust
	$(MAKE) test-python

# verl's own environment (tools/verl_env.sh) for tests/test_verl_rollout.py, built once
verl-env: install
	[ -x .verl_venv/bin/python ] || tools/verl_env.sh .verl_venv

# OpenRLHF's own environment (tools/openrlhf_env.sh) for tests/test_openrlhf_rollout.py, built once
openrlhf-env: install
	[ -x .openrlhf_venv/bin/python ] || tools/openrlhf_env.sh .openrlhf_venv

# prime-rl's rollout clients (verifiers, renderers) for tests/test_verifiers_client.py, built once
verifiers-env:
	[ -x .verifiers_venv/bin/python ] || tools/verifiers_env.sh .verifiers_venv

# SkyRL's and AReaL's clients (skyrl, areal) for tests/test_rl_framework_clients.py, built once
rl-clients-env: install
	[ -x .rl_clients_venv/bin/python ] || tools/rl_clients_env.sh .rl_clients_venv

# Test data that would otherwise be downloaded at run time (tools/fetch_test_vocab.sh)
test-data:
	tools/fetch_test_vocab.sh

# pytest arguments: two pytest-xdist workers, whole files to one worker (a module's server or
# checkpoint fixture is built once); the files holding slow tests start first (tests/conftest.py), so
# the longest are not left to the end (times: docs/benchmarks.md, "Test suite"). PYTEST_ARGS= runs it
# serially; "-n 4 --dist loadfile" on more cores.
PYTEST_ARGS ?= -n 2 --dist loadfile

# Tiers are pytest markers in the test files (pyproject.toml): slow, gpu, peer.
# The edit loop, after `make install`: every test not marked slow or gpu.
test-fast:
	$(BIN)/python -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

# r3srv against the peers' own code: their protocol classes' data, sglang-router, trainers' calls.
test-peer:
	$(BIN)/python -m pytest -q -m peer $(PYTEST_ARGS)

# The CUDA tests (on a machine with a GPU; elsewhere they skip, saying so).
test-gpu:
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

test-rust:
	cargo test --release

# the Rust sources as `cargo fmt` (rustfmt.toml) writes them; run `cargo fmt` to apply
fmt-check:
	cargo fmt --check

test-python:
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Same-run ratios against the reference implementations (never absolute times).
bench: install
	$(BIN)/python -m pytest benches -q --benchmark-columns=median,iqr,rounds --benchmark-sort=name

bench-gate: install
	$(BIN)/python -m pytest -q benches/test_gate.py -p no:randomly

# Every benchmark run once, untimed, with its own checks: benches that no longer run fail CI.
bench-smoke: install
	$(BIN)/python -m pytest -q benches --benchmark-disable -p no:randomly

# schemathesis over every route for FUZZ_MINUTES per server (two servers), schema-valid requests
# that are refused counted too, but for those the peers refuse as well (tests/schema_fuzz_hooks.py)
# (benches/schema_fuzz.py); CI runs a shorter deterministic one.
FUZZ_MINUTES ?= 10
fuzz-deep: install
	$(BIN)/python benches/schema_fuzz.py --minutes $(FUZZ_MINUTES)

serve: install
	$(BIN)/r3srv serve

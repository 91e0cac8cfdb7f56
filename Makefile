# SPDX-License-Identifier: MIT
# The two commands a fresh Debian 12 or 13 machine needs (as root): `make demo`, `make test`.
# Each runs `make setup` first, which is idempotent.
PY := .venv/bin/python
BUILDER := $(PY) -m builder
.DEFAULT_GOAL := help

.PHONY: help setup setup-dev check demo build-demo qemu test test-extended lint unit integration bench promtool-test man clean

help:
	@echo "make demo   build the demo image, boot it in QEMU, print the guest's applianctl status"
	@echo "make test   lint, type-check, unit tests, then build-and-boot integration tests"
	@echo "make qemu   boot the demo image interactively (serial console; Ctrl-a x leaves)"
	@echo "make test-extended  the longer QEMU scenarios (bad versions roll back by themselves);"
	@echo "                    GROUPS='install rollback weights' picks named groups (default: all)"
	@echo "make bench  every figure against a baseline run alongside, into out/bench.json and out/bench.md"
	@echo "make setup  install what the host needs (run by demo and test)"
	@echo "make check  the fast loop, no root: ruff, mypy and the unit tests that start no real program"
	@echo "            (those marked programs run in make test's unit tier)"
	@echo "make setup-dev  the venv alone, no root, no apt (run by check and lint)"
	@echo "make man    man pages and bash completion of the builder and applianctl into out/man, out/completion"
	@echo "            (man -l out/man/man1/builder.1; the image carries applianctl's, generated at build)"
	@echo "make promtool-test  check the alert rules in monitoring/ and run their unit tests"
	@echo "                    (with the promtool make setup unpacks; it is not on PATH)"

setup:
	@bash tools/setup-host

setup-dev:
	@tools/setup-venv

build-demo: setup
	$(BUILDER) --profile demo validate
	$(BUILDER) --profile demo build

demo: build-demo
	$(BUILDER) --profile demo boot --status-json out/demo-status.json --metrics-out out/demo-metrics.prom

qemu: setup
	$(BUILDER) --profile demo boot --interactive

lint: setup-dev
	$(PY) -m ruff check appliance builder applianctl installer standin testkit bench tests
	$(PY) -m mypy

# A test that hangs fails after ten minutes instead of holding the whole run.
unit: setup
	$(PY) -m pytest -q -m "not integration" --timeout=600

# The fast tier: no root, nothing but the venv; a test that starts a real program is refused there
# (tests/program_guard.py) and must be marked programs, which make unit runs.
# Its tests share no state, so they run on every core (pytest-xdist).
check: lint
	APPLIANCE_FAST_TIER=1 $(PY) -m pytest -q -n auto -m "not integration and not programs" --timeout=600

integration: setup
	@tools/check-space 22 "the integration tests"
	$(PY) -m pytest -q -m "integration and not extended" --durations=0 tests/integration

# Longer QEMU scenarios (tests marked extended: synthetic bad versions, hangs before
# boot-complete, panics); not part of make test. Named groups, one per subject
# (tools/extended-groups lists them): make test-extended GROUPS='rollback weights'.
GROUPS ?=
test-extended: setup
	@tools/check-space 22 "the extended tests"
	@tools/extended-groups $(GROUPS) >/dev/null
	$(PY) -m pytest -q -m extended --durations=0 $$(tools/extended-groups $(GROUPS))

test: setup lint unit integration

bench: setup
	$(PY) -m bench

# promtool: Debian's prometheus package unpacked into the host cache by make setup
# (tools/setup-host), not installed, so not on PATH.
PROMTOOL := $(or $(APPLIANCE_HOST_CACHE),/var/cache/appliance-host)/prometheus/usr/bin/promtool

promtool-test:
	@test -x $(PROMTOOL) || { echo "no promtool at $(PROMTOOL)" >&2; echo "hint: run make setup (as root) first" >&2; exit 2; }
	$(PROMTOOL) check rules monitoring/appliance.rules.yml
	cd monitoring && $(PROMTOOL) test rules appliance.rules.test.yml

# Generated from the argument parsers (appliance/cli_docs.py), never committed. The builder's
# completion is for a command named builder: alias builder='.venv/bin/python -m builder'.
MAN_VERSION = $(shell $(PY) -c 'from builder.__main__ import project_version; print(project_version())')

man: setup-dev
	$(PY) -m appliance.cli_docs builder.__main__:build_parser --name builder --section 1 --version $(MAN_VERSION) \
		--man-dir out/man --completion-dir out/completion
	$(PY) -m appliance.cli_docs applianctl.__main__:build_parser --name applianctl --section 8 --version $(MAN_VERSION) \
		--man-dir out/man --completion-dir out/completion

clean:
	rm -rf build out

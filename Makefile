# The two commands a newcomer needs (see README.md):
#   make demo   install everything on a fresh Debian machine, run the demo
#   make test   install everything, run ruff, the wheel check, the whole test suite and the
#               benchmark guard (bench/guard.py: the headline ratios against their bounds)
#
# Python packages go into the project's own virtual environment (.venv), never into the
# machine's Python: `make test` (and so .ci/run) builds it fresh from pyproject.toml, so the
# suite runs on the newest releases the dependency ranges allow, what a new user gets.
# Run anything from it with `.venv/bin/ckptfs ...`, or `. .venv/bin/activate` first.
# The editable install is a plain path entry (editable_mode=compat), not an import hook, so
# PYTHONPATH=/another/checkout runs that checkout's code (old-against-new benchmarks do).
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP_FLAGS := --quiet --disable-pip-version-check
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: system venv fresh-venv install demo test suite guard lint check-wheel

system:
	bash scripts/install-system.sh

# Create the venv if missing, then bring every package up to the newest allowed release.
venv: system
	[ -x $(VPY) ] || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(PIP_FLAGS) --upgrade --upgrade-strategy eager --config-settings editable_mode=compat -e '.[test,bench]'

# A new venv, built from nothing (what CI and a new user get).
fresh-venv: system
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(PIP_FLAGS) --config-settings editable_mode=compat -e '.[test,bench]'
	$(VPY) scripts/versions.py

install: venv

demo: venv
	$(VENV)/bin/ckptfs demo

test: fresh-venv suite

# The checks on the venv as it is (no rebuild): for a developer's repeated runs.
suite:
	$(VPY) -m ruff check .
	bash scripts/check-wheel.sh --demo
	$(VPY) -m pytest -x -q tests
	$(VPY) -m bench.guard

lint:
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

# The wheel on its own: built, installed into a fresh venv, `ckptfs bench --nodes s3` and
# `ckptfs demo` run from outside the repository (about 2 minutes).
check-wheel:
	bash scripts/check-wheel.sh --demo

# The benchmark guard alone (under a minute): make test runs it after the suite.
guard:
	$(VPY) -m bench.guard

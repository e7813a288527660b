# The two commands a newcomer needs (see README.md):
#   make demo   install everything on a fresh Debian machine, run the demo
#   make test   install everything, run the whole test suite and the wheel check
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install demo test lint bench check-wheel

install:
	bash scripts/install-system.sh
	$(PIP) install --quiet --disable-pip-version-check -e '.[test,bench]'

demo: install
	ckptfs demo

test: install
	$(PYTHON) -m ruff check .
	bash scripts/check-wheel.sh --demo
	$(PYTHON) -m pytest -x -q tests

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# The wheel on its own: built, installed into a fresh venv, `ckptfs bench --nodes s3` and
# `ckptfs demo` run from outside the repository (about 2 minutes).
check-wheel:
	bash scripts/check-wheel.sh --demo

# The two commands a newcomer needs (see README.md):
#   make demo   install everything on a fresh Debian machine, run the demo
#   make test   install everything, run the whole test suite
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install demo test lint bench

install:
	bash scripts/install-system.sh
	$(PIP) install --quiet --disable-pip-version-check -e '.[test,bench]'

demo: install
	ckptfs demo

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -x -q tests

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

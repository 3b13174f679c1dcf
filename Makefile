# Set-up and the two everyday commands. Needs only Python 3.11 (or 3.10+) and pip.
#   make demo   install everything into .venv, then run the local demo on the embedded model
#   make test   install everything into .venv, then run the test suite (what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
# The CPU build of PyTorch. Where pip would pick a CUDA build (plain PyPI on x86_64 Linux),
# point it at the CPU wheels: make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
BIN = $(VENV)/bin

.PHONY: install demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(BIN)/pip install -q -e '.[torch,mlx,dev]'
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

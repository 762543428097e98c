"""The run configuration: Hydra composition, DeepSpeed preset loading, and one validation pass.

Flow: CLI overrides -> Hydra compose (train.yaml + task/<task>.yaml) -> value overrides applied
here -> preset JSON loaded (duplicate keys rejected) with `deepspeed.*` overrides -> pydantic
`RunConfig` (extra="forbid"). Every problem found on the way is collected and reported in one
`ConfigError`, with the full key path, the value given and what is allowed.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from align_anything.config.sections import (
    DiffusionDPOSection,
    DiffusionSFTSection,
    GRPOSection,
    PPOSection,
    RewardSection,
    RLOOSection,
    RolloutSection,
    _OnlineRL,
    _Section,
    names_a_missing_folder,
)
from align_anything.errors import ConfigError, did_you_mean
from align_anything.losses import rules as loss_rules

CONFIG_DIR = Path(__file__).parent.parent / "configs"
PRESET_DIR = CONFIG_DIR / "deepspeed"
TASK_DIR = CONFIG_DIR / "task"

Auto = Literal["auto"]
# deepspeed=auto: the planner chooses among the shipped presets.
AUTO_PRESET = "auto"


class LoraSection(_Section):
    """Low-rank adapters (PEFT LoRA) instead of full fine-tuning."""

    enabled: bool = Field(description="Train LoRA adapters; the base weights stay frozen.")
    r: int = Field(ge=1, description="Adapter rank.")
    alpha: float = Field(gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["all-linear", "default"] = Field(
        description="Module names to adapt, e.g. `[q_proj,v_proj]` (one name needs no brackets); `all-linear`: every linear layer of the language model except the output head; `default`: the model's usual targets (a language model's all-linear, a text-to-image denoiser's attention projections).",
    )
    save_merged: bool = Field(
        description="Also write output_dir/final-merged: the adapter merged into the model."
    )

    def adapters(self) -> dict[str, Any] | None:
        """`lora.add_adapters`' settings (r, alpha, dropout, target_modules), or None when off."""
        if not self.enabled:
            return None
        return dict(
            r=self.r, alpha=self.alpha, dropout=self.dropout, target_modules=self.target_modules
        )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        # `target_modules=q_proj` means the one module a user would expect, not an error.
        if isinstance(value, str):
            return value if value in ("all-linear", "default") else [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ValueError(
            "expected module names as a list, e.g. [q_proj,v_proj], or 'all-linear' or 'default'"
        )


ModelPart = Literal["vision_tower", "audio_tower", "projector", "language_model"]


class ModelConfig(_Section):
    name_or_path: str = Field(
        description="A hub name, a local folder, or a built-in name (`smollm2-135m-instruct`, `tiny-random-llama`, ...).",
    )
    trust_remote_code: bool = Field(
        description="Run the model repository's own Python code (off unless you trust its source).",
    )
    freeze: list[ModelPart] = Field(
        description="Parts whose weights stay fixed: any of `vision_tower`, `audio_tower`, `projector`, `language_model` (multimodal models).",
    )
    lora: LoraSection = Field(description="Train low-rank adapters instead of all weights.")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = (
        Field(
            description="Attention kernel: `auto` (what transformers picks: sdpa where the model supports it, else eager), `sdpa`, `eager`, `flash_attention_2` (needs the flash-attn package and a CUDA GPU, bf16/fp16) or `flex_attention` (GPU: no backward pass on CPU). An unavailable kernel is an error before any weights load; the shared-prefix layouts (`speed.share_prefix`) need sdpa or eager and fall back to plain rows otherwise, saying so; `sft.packing` runs on all five.",
        )
    )


DataFormat = Literal[
    "auto", "conversation", "prompt_response", "preference", "hh", "unpaired", "prompt"
]
# The keys a `data.path` / `data.eval_path` list entry may leave out (they inherit or take all rows).
SOURCE_OPTIONAL = ("format", "columns", "weight", "rows")


class DataSource(_Section):
    """One source of a mixture (an entry of a `data.path` or `data.eval_path` list)."""

    path: str = Field(description="A file, folder, built-in name or hub dataset, as `data.path`.")
    format: DataFormat | None = Field(description="This source's format (null: `data.format`).")
    columns: dict[str, str] | None = Field(
        description="This source's column mapping (null: `data.columns`)."
    )
    weight: float | None = Field(
        gt=0,
        description="Share of the mixture relative to the other weighted sources' (the mix is as large as the scarcest weighted source allows without repeating rows).",
    )
    rows: int | None = Field(
        ge=1,
        description="Take this many rows (drawn by `train.seed`; beyond the source's size, its rows repeat).",
    )

    @model_validator(mode="before")
    @classmethod
    def _optional_keys(cls, value: Any) -> Any:
        # An entry names what it changes; the rest inherits (null), so no key needs writing out.
        if isinstance(value, dict):
            return {**{key: None for key in SOURCE_OPTIONAL}, **value}
        return value

    @model_validator(mode="after")
    def _one_amount(self) -> DataSource:
        if self.weight is not None and self.rows is not None:
            raise ValueError("give a source a weight or a row count, not both")
        return self


class DataConfig(_Section):
    path: str | list[DataSource] = Field(
        description="Training data: a local .json/.jsonl/.jsonl.gz/.parquet/.csv file or folder, a built-in name (`arith-sft`, `arith-pref`, `arith-pref-eval`, `arith-kto`, `arith-prompts`, `arith-prompts-eval`) or a hub dataset; or a list of sources to mix, each `{path, format, columns, weight | rows}` (e.g. `[{path: a.jsonl, weight: 3}, {path: b.jsonl, weight: 1}]`).",
    )
    format: DataFormat = Field(
        description="How rows map to records; `auto` recognises conversations, prompt/response, preference pairs, HH-RLHF transcripts, unpaired rows (prompt, completion, label) and prompts alone (online RL).",
    )
    columns: dict[str, str] = Field(
        description="Canonical name -> column in the file, e.g. `{prompt: question, chosen: good}` (names: messages, prompt, response or completion, chosen, rejected, system, margin, label).",
    )
    max_length: int = Field(
        ge=8, description="Token limit of one encoded sequence (prompt + completion)."
    )
    truncation: Literal["drop", "truncate_prompt", "truncate_completion"] = Field(
        description="Rows longer than `max_length`: drop them (counted in the start-up summary), or cut the prompt's start or the completion's end.",
    )
    eval_path: str | list[DataSource] | None = Field(
        description="A held-out file, or a list of sources as `data.path` takes; without it, `eval_fraction` of `data.path` is held out."
    )
    eval_fraction: float = Field(
        ge=0.0,
        lt=1.0,
        description="Share of `data.path` held out for evaluation when `eval_path` is unset.",
    )
    max_train_samples: int | None = Field(
        ge=1, description="Use at most this many training rows (null: all)."
    )
    max_eval_samples: int | None = Field(
        ge=1, description="Use at most this many evaluation rows (null: all)."
    )
    num_proc: int | None = Field(
        ge=1,
        description="Worker processes that tokenise (batched `datasets.map`; files under 2,000 rows per process stay in one). null: the CPUs this process may use, at most 8.",
    )
    resolution: int | None = Field(
        ge=8,
        description="Text-to-image tasks: images are resized (shorter side) and centre-cropped to this many pixels square before they are encoded into latents; null: the pipeline's own (its denoiser's sample size x the VAE's scale).",
    )
    cache_dir: str | None = Field(
        description="Where tokenised data is cached (null: `data/` under `ALIGN_ANYTHING_CACHE`, else ~/.cache/align_anything). A start with the same data, tokenizer, chat template, max_length, truncation and task encoding reads it instead of tokenising.",
    )

    @field_validator("path", "eval_path")
    @classmethod
    def _some_source(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:  # would fail deep in the pipeline (#24, 12)
            raise ValueError(
                "an empty list names no data: give a file, folder, built-in or hub name, or a "
                "list of at least one source, e.g. [{path: a.jsonl}]"
            )
        return value


class EMASection(_Section):
    """An exponential moving average of the trained weights, updated every optimizer step."""

    enabled: bool = Field(
        description="Keep an EMA of the trained weights (checkpointed; final-ema/)."
    )
    decay: float = Field(
        ge=0.0, lt=1.0, description="ema = decay * ema + (1 - decay) * weights, per step."
    )
    device: Literal["cpu", "device"] = Field(
        description="Where rank 0 keeps the fp32 average: host memory or the accelerator."
    )


class TrainSection(_Section):
    max_steps: int = Field(
        ge=-1, description="Optimizer steps to run; -1 runs `train.epochs` epochs."
    )
    epochs: int = Field(ge=1, description="Passes over the training rows when `max_steps` is -1.")
    per_device_batch_size: int | Auto = Field(
        description="Micro-batch per process (DeepSpeed's `train_micro_batch_size_per_gpu`)."
    )
    gradient_accumulation_steps: int | Auto = Field(
        description="Micro-batches accumulated per optimizer step."
    )
    global_batch_size: int | Auto = Field(
        description="Rows per optimizer step = micro x grad_accum x world; any two of the three determine the third.",
    )
    learning_rate: float = Field(gt=0, description="Peak learning rate (AdamW).")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        description="Learning-rate schedule after warm-up."
    )
    warmup_ratio: float = Field(
        ge=0.0,
        lt=1.0,
        description="Share of the steps spent warming the rate up linearly from 0.",
    )
    weight_decay: float = Field(ge=0.0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field(description="AdamW (beta1, beta2).")
    adam_eps: float = Field(gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(
        ge=0.0, description="Gradient clipping norm (0 disables clipping)."
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        description="`auto`: bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU."
    )
    seed: int = Field(
        description="Seed of the data order, the held-out split and the initial random state."
    )
    eval_every_steps: int = Field(
        ge=0, description="Evaluate every N steps; 0 evaluates only before and after training."
    )
    log_every_steps: int = Field(
        ge=1, description="Log (metrics.jsonl, backends, progress) every N steps."
    )
    ema: EMASection = Field(description="A moving average of the weights (final-ema/).")
    memory_budget_gb: float | None = Field(
        gt=0,
        description="Per-device memory for `deepspeed=auto` and the planner; null: the device's (CPU: system RAM / local ranks).",
    )

    @field_validator("per_device_batch_size", "gradient_accumulation_steps", "global_batch_size")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be a positive integer or 'auto'")
        return value


class SpeedSection(_Section):
    """Switches that change only time and memory, never the numbers a run computes (each is
    tested equal to the plain path). Everything outside this section may change results."""

    completion_only_logits: bool = Field(
        description="Project only the positions that predict a scored token onto the vocabulary (the LM head's share of compute, for the same log-probs)."
    )
    share_prefix: bool = Field(
        description="Compute a shared prefix once: SFT and KTO, the common system prompt / template header of a micro-batch's rows (where it saves at least a quarter of the tokens; KTO: its trained rows, its KL rows, the reference's rows); DPO and RM, each pair's prompt (one row prompt + chosen + rejected, short pairs sharing a row); GRPO / RLOO, the completions of a prompt in a micro-batch (one row prompt + completions). Needs attention that takes a dense mask (sdpa, eager); otherwise the plain rows."
    )
    group_by_length: bool = Field(
        description="With gradient accumulation, each step's micro-batches take rows of similar length (less padding; the step's rows and gradient are unchanged)."
    )
    tied_grads_in_place: bool = Field(
        description="A tied input embedding/LM head accumulates its gradient in one buffer, not three (less peak memory; ZeRO-0 in fp32 only)."
    )
    gradient_checkpointing: bool = Field(
        description="Recompute each layer's activations in the backward pass: activation memory of about one layer instead of all, for about a third more compute."
    )


LoggingBackend = Literal["console", "jsonl", "wandb", "tensorboard"]


class LoggingConfig(_Section):
    backends: list[LoggingBackend] = Field(
        description="Any of console, jsonl, wandb, tensorboard; jsonl (`metrics.jsonl`) is always written. wandb logs offline when no API key is configured.",
    )
    project: str = Field(description="wandb project name.")
    run_name: str | None = Field(description="wandb run name (null: wandb picks one).")
    completions_every: int = Field(
        ge=0,
        description="Online RL (grpo, rloo): every N steps a table of prompts, completions and rewards (rich on the console, a wandb Table with wandb); 0: never. TRL's log_completions.",
    )
    completions_shown: int = Field(
        ge=1,
        description="Rows of that table (the step's first completions). TRL's num_completions_to_print.",
    )
    samples_every: int = Field(
        ge=0,
        description="Text-to-image tasks: images for the sample prompts and seeds before training, after it and every N steps, as a PNG grid under output_dir/samples/ (and to TensorBoard / wandb when on); 0: before and after only.",
    )
    sample_prompts: list[str] | None = Field(
        description="Text-to-image tasks: the prompts of the sample grid (one row each); null: the first 4 held-out captions.",
    )
    sample_seeds: list[int] = Field(
        min_length=1,
        description="Text-to-image tasks: the seeds of the sample grid (one column each): the same prompt and seed give the same starting noise in every grid.",
    )


class CheckpointConfig(_Section):
    every_steps: int = Field(
        ge=0,
        description="Write `checkpoints/step-N` every N steps; 0: no intermediate checkpoints.",
    )
    keep_last: int = Field(
        ge=1,
        description="Complete checkpoints to keep; older ones are deleted once a new one is complete.",
    )
    save_final: bool = Field(
        description="Export `output_dir/final` as a Hugging Face folder (safetensors + tokenizer).",
    )
    allow_mismatch: bool = Field(
        description="Resume even if the model, tokenizer or training data differ from the checkpoint's.",
    )


class SFTSection(_Section):
    assistant_only_loss: bool = Field(
        description="Train on assistant tokens only; false trains on every non-padding token (prompt and template included).",
    )
    packing: bool = Field(
        description="Pack training rows into sequences of up to `data.max_length` tokens (best-fit decreasing, once over the training set); position ids restart at each row and no token attends across rows, so the loss is that of the unpacked rows. `train.per_device_batch_size` then counts packed sequences, as TRL's packing does. Text models only; evaluation rows stay unpacked.",
    )


def _names(loss_type: str | list[str]) -> list[str]:
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


class _AgainstReference(_Section):
    """What DPO and KTO share: the frozen reference model and the held-out generation check."""

    # model: a frozen reference model beside the policy (ZeRO-3: a partitioned inference engine);
    # precompute: one no-grad pass over the rows the run will use, then the reference is freed.
    reference: Literal["model", "precompute"] = Field(
        description="precompute: one no-grad pass over the rows the run will use (KTO: and its KL pairs), before training, then the reference is freed; model: keep a frozen reference model.",
    )
    reference_offload: bool = Field(
        description="With `reference=model`: keep the reference model in CPU memory."
    )
    # Greedy generations on held-out prompts before and after training, checked for the
    # preferred property where the dataset defines one (built-in datasets do).
    generation_check_samples: int = Field(
        ge=0,
        description="Greedy answers to this many held-out prompts before and after training, checked where the dataset defines a check (built-in data does).",
    )
    generation_max_new_tokens: int = Field(
        ge=1, description="Token limit of each generation-check answer."
    )


class DPOSection(_AgainstReference):
    beta: float = Field(
        gt=0, description="Strength of the pull towards the reference model (the beta of DPO)."
    )
    loss_type: str | list[str] = Field(
        description="One loss type or a list whose weighted sum is the loss (`[sigmoid,bco_pair,sft]`: MPO): sigmoid (DPO; with label_smoothing: cDPO), ipo, hinge, robust, the reference-free simpo / orpo, apo_zero, apo_down, bco_pair, exo_pair, nca_pair, sppo_hard, aot, aot_unpaired, discopop, sigmoid_norm, and sft (the chosen completion's NLL, token mean per pair; not alone). simpo / orpo do not mix with types that need a reference. rewards/* are those of the first type other than sft.",
    )
    loss_weights: list[float] | None = Field(
        description="One weight >= 0 per `loss_type` entry, in order (MPO: `[0.8,0.2,1.0]`); null: all 1.0.",
    )
    label_smoothing: float = Field(
        ge=0.0,
        lt=0.5,
        description="The probability a preference label is wrong: cDPO's epsilon for sigmoid, simpo, aot and aot_unpaired; the noise rate for robust; EXO's epsilon for exo_pair (> 0 there; the paper suggests 1e-3).",
    )
    simpo_gamma: float = Field(description="SimPO's target reward margin gamma.")
    orpo_lambda: float = Field(ge=0.0, description="Weight of ORPO's odds-ratio term.")
    discopop_tau: float = Field(
        gt=0.0, description="DiscoPOP's temperature tau (the paper's 0.05)."
    )
    # Weight of a negative log-likelihood term on the chosen completion (token mean), added to
    # the preference loss: RPO (Pang et al. 2024), older TRL's `rpo_alpha` (TRL 1.16 has only the
    # `sft` loss type). It appends ("sft", rpo_alpha) to the loss terms; 0 disables it.
    rpo_alpha: float = Field(
        ge=0.0,
        description="Weight of an NLL term on the chosen completion (RPO): the same as appending `sft` to loss_type with this weight; listing sft yourself needs rpo_alpha=0. 0: plain DPO.",
    )

    @field_validator("loss_type", mode="before")
    @classmethod
    def _known_loss_types(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else value
        allowed = ", ".join(repr(name) for name in loss_rules.DPO_LOSS_TYPES)
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"Input should be {allowed} or a list of them")
        unknown = [name for name in names if name not in loss_rules.DPO_LOSS_TYPES]
        if unknown:
            hints = "".join(did_you_mean(name, loss_rules.DPO_LOSS_TYPES) for name in unknown)
            listed = "" if isinstance(value, str) else f"; unknown: {', '.join(map(repr, unknown))}"
            raise ValueError(f"Input should be {allowed} or a list of them{listed}{hints}")
        problems = loss_rules.combination_problems(names)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("loss_weights")
    @classmethod
    def _one_weight_per_type(
        cls, value: list[float] | None, info: ValidationInfo
    ) -> list[float] | None:
        if value is None:
            return value
        # Without a valid loss_type (its own error) the count cannot be checked.
        names = _names(info.data["loss_type"]) if "loss_type" in info.data else None
        problems = loss_rules.weight_problems(names, value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("label_smoothing")
    @classmethod
    def _smoothing_applies(cls, value: float, info: ValidationInfo) -> float:
        if "loss_type" not in info.data:
            return value
        problems = loss_rules.smoothing_problems(_names(info.data["loss_type"]), value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("rpo_alpha")
    @classmethod
    def _sft_once(cls, value: float, info: ValidationInfo) -> float:
        if value and "sft" in _names(info.data.get("loss_type", [])):
            raise ValueError(
                f"dpo.loss_type lists sft and rpo_alpha={value} would add it a second time: set "
                "dpo.rpo_alpha=0 and weight sft in dpo.loss_weights, or drop sft from the list"
            )
        return value

    def loss_terms(self) -> tuple[list[str], list[float]]:
        """The loss types a run sums and their weights: loss_type with loss_weights (null: all
        1.0), then sft with weight rpo_alpha when rpo_alpha > 0 (RPO as a term of the sum)."""
        names = _names(self.loss_type)
        weights = list(self.loss_weights) if self.loss_weights else [1.0] * len(names)
        if self.rpo_alpha:
            names.append("sft")
            weights.append(self.rpo_alpha)
        return names, weights


class RMSection(_Section):
    margin_column: str | None = Field(
        description="A column holding a per-pair margin subtracted inside the loss (null: none).",
    )
    center_coef: float = Field(
        ge=0.0, description="Weight of the mean-squared reward term that centres rewards at 0."
    )


class KTOSection(_AgainstReference):
    beta: float = Field(
        gt=0, description="Strength of the pull towards the reference model (the beta of KTO)."
    )
    desirable_weight: float = Field(
        gt=0, description="lambda_D: weight of the loss of desirable (thumbs-up) rows."
    )
    undesirable_weight: float = Field(
        gt=0, description="lambda_U: weight of the loss of undesirable (thumbs-down) rows."
    )


class RunConfig(_Section):
    """The validated configuration of one run. Built only by `load_config`."""

    task: str = Field(
        description="The task: sft, dpo, rm, kto, grpo, rloo, ppo, or for text-to-image pipelines diffusion_sft, diffusion_dpo (a file in configs/task/)."
    )
    deepspeed: dict[str, Any] = Field(
        description="A shipped preset name (`python -m align_anything presets list`) or a path to a DeepSpeed JSON file; dotted overrides reach inside (`deepspeed.zero_optimization.overlap_comm=false`)."
    )
    deepspeed_source: str
    output_dir: str = Field(
        description="Where metrics, configs, checkpoints and the final model go."
    )
    resume: str | None = Field(
        description="null: start fresh (refused when output_dir already holds a run); auto: the newest complete checkpoint of the run in output_dir (or fresh when the folder is empty); or a checkpoint path.",
    )
    overwrite_output_dir: bool = Field(
        description="Start over in an output_dir that holds an earlier run: its checkpoints, final/ and metrics are removed first (other files stay).",
    )
    model: ModelConfig = Field()
    data: DataConfig = Field()
    train: TrainSection = Field()
    speed: SpeedSection = Field()
    logging: LoggingConfig = Field()
    checkpoint: CheckpointConfig = Field()
    # Dotted keys the user set on the command line; used to detect conflicts with the preset.
    explicit_keys: frozenset[str] = frozenset()
    # One section per task; only the selected task's section may be present.
    sft: SFTSection | None = None
    dpo: DPOSection | None = None
    rm: RMSection | None = None
    kto: KTOSection | None = None
    grpo: GRPOSection | None = None
    rloo: RLOOSection | None = None
    ppo: PPOSection | None = None
    diffusion_sft: DiffusionSFTSection | None = None
    diffusion_dpo: DiffusionDPOSection | None = None
    # Online RL only (set in task/grpo.yaml, task/rloo.yaml and task/ppo.yaml).
    reward: RewardSection | None = None
    rollout: RolloutSection | None = None

    @field_validator("resume", mode="before")
    @classmethod
    def _no_resume(cls, value: Any) -> Any:
        return (
            None
            if isinstance(value, str) and value.strip().lower() in ("", "none", "null")
            else value
        )

    @model_validator(mode="after")
    def _room_for_prompts(self) -> RunConfig:
        online = self.section() if self.task in ONLINE_TASKS else None
        if (
            isinstance(online, (_OnlineRL, PPOSection))
            and online.max_completion_length >= self.data.max_length
        ):
            completion, limit = online.max_completion_length, self.data.max_length
            raise ValueError(
                f"{self.task}.max_completion_length={completion} leaves no room for the prompt: "
                f"data.max_length={limit} counts the prompt's tokens and the completion's. Raise "
                f"data.max_length above {completion} by the longest prompt's tokens (e.g. "
                f"data.max_length={completion + 128}), or lower {self.task}.max_completion_length "
                f"below {limit}"
            )
        return self

    @model_validator(mode="after")
    def _critic_source(self) -> RunConfig:
        ppo = self.ppo if self.task == "ppo" else None
        if ppo is None or not ppo.trains_critic():
            return self
        if ppo.critic_model is not None and names_a_missing_folder(ppo.critic_model):
            raise ValueError(
                f"ppo.critic_model={ppo.critic_model!r}: no such folder (give a task=rm final/ "
                "folder for critic_init=reward_model, or the policy's for critic_init=policy)"
            )
        no_rm = self.reward is None or self.reward.model is None
        if ppo.critic_model is None and ppo.critic_init == "reward_model" and no_rm:
            raise ValueError(
                "ppo.critic_init=reward_model starts the critic from the reward model, but "
                "reward.model is null: set reward.model (a task=rm final/ folder) or "
                "ppo.critic_model, or use ppo.critic_init=policy (a new value head on the "
                "policy's weights)"
            )
        return self

    @model_validator(mode="after")
    def _image_data(self) -> RunConfig:
        # The text-to-image readers take one source each (no mixtures) and find its shape
        # themselves: captioned images for diffusion_sft, Pick-a-Pic pairs for the others.
        if self.task not in DIFFUSION_TASKS:
            return self
        data = self.data
        problems = [
            f"data.{key} is a list of sources; {self.task} reads one source (a folder, file or "
            "built-in name)"
            for key in ("path", "eval_path")
            if isinstance(getattr(data, key), list)
        ]
        if data.format != "auto":
            problems.append(
                f"data.format={data.format!r} names a text format; {self.task} reads "
                + ("captioned images" if self.task == "diffusion_sft" else "Pick-a-Pic pairs")
                + " (data.columns maps their names): leave data.format=auto"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def section(self) -> BaseModel | dict[str, Any] | None:
        """The task's own section (e.g. `cfg.dpo` for task=dpo)."""
        return getattr(self, self.task)

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as plain data, as saved beside checkpoints."""
        data = self.model_dump(mode="json", exclude={"explicit_keys"})
        return {k: v for k, v in data.items() if v is not None or k in ("resume",)}


# Task name -> the schema of its own config section.
TASK_SECTIONS: dict[str, type[BaseModel]] = {
    "sft": SFTSection, "dpo": DPOSection, "rm": RMSection, "kto": KTOSection,
    "grpo": GRPOSection, "rloo": RLOOSection, "ppo": PPOSection,
    "diffusion_sft": DiffusionSFTSection, "diffusion_dpo": DiffusionDPOSection,
}  # fmt: skip
# Tasks that generate online and so take the `reward` section.
ONLINE_TASKS = ("grpo", "rloo", "ppo")
# Tasks that train a text-to-image pipeline's denoiser (their data are images and captions).
DIFFUSION_TASKS = ("diffusion_sft", "diffusion_dpo")


def available_tasks() -> list[str]:
    """Task names that have a config file in configs/task/."""
    return sorted(p.stem for p in TASK_DIR.glob("*.yaml"))


def available_presets() -> list[str]:
    """Preset names shipped in configs/deepspeed/ (ds_<name>_config.json)."""
    return sorted(p.name[3 : -len("_config.json")] for p in PRESET_DIR.glob("ds_*_config.json"))


def preset_path(name: str) -> Path:
    """The shipped file of a preset name."""
    return PRESET_DIR / f"ds_{name}_config.json"


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key '{key}'")
        seen[key] = value
    return seen


def load_preset(spec: str) -> tuple[dict[str, Any], str]:
    """Load a DeepSpeed preset by name (`z3`) or path (`my/ds.json`); returns (dict, source path).

    JSON is parsed with a duplicate-key check: json.load silently keeps the last of two equal
    keys, which hides copy-paste mistakes in hand-edited presets.
    """
    if not spec.strip():
        raise ConfigError(
            f"deepspeed={spec!r}: the value is empty. Give a shipped preset "
            f"({', '.join(available_presets())}), {AUTO_PRESET}, or a path to a DeepSpeed JSON file."
        )
    path = Path(spec).expanduser()
    if spec in available_presets():
        path = preset_path(spec)
    elif not (spec.endswith(".json") or path.exists()):
        raise ConfigError(
            f"deepspeed={spec!r}: unknown preset{did_you_mean(spec, available_presets())}. "
            f"Shipped presets: {', '.join(available_presets())}; {AUTO_PRESET} (the lowest ZeRO "
            "stage that fits memory); or give a path to a JSON file."
        )
    if not path.is_file():
        raise ConfigError(f"deepspeed={spec!r}: file {path} does not exist.")
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_reject_duplicate_keys)
    except (json.JSONDecodeError, ValueError) as err:
        raise ConfigError(f"deepspeed preset {path}: invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed preset {path}: expected a JSON object at the top level.")
    return data, str(path)


def _parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """Parse `key=value` overrides with Hydra's grammar (typed values, lists, quoting)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed: list[tuple[str, Any]] = []
    problems: list[str] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as err:
            problems.append(f"cannot parse override {text!r}: {err}{_quote_hint(text)}")
            continue
        if override.is_delete():
            key = override.get_key_element().lstrip("~")
            problems.append(
                f"override {text!r}: deleting keys is not supported; every key has a default. "
                f"Leave the override out for the default, or set a value: {key}=<value>"
            )
            continue
        if override.is_sweep_override():
            problems.append(
                f"override {text!r}: a comma-separated value is a sweep in Hydra's syntax, and "
                "sweeps are not supported; write a list in brackets (key=[a,b]) or quote the "
                "value (key='a,b')"
            )
            continue
        key = override.get_key_element().lstrip("+")
        parsed.append((key, override.value()))
    if problems:
        raise ConfigError("\n".join(problems))
    return parsed


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    node = target
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def merge_nested(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `overrides` merged in, key by key at every depth."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_nested(merged[key], value)
        else:
            merged[key] = value
    return merged


def _to_plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _unmatched_union_members(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the "wrong type" errors of union members the value did not take when another member
    took it: for `data.path=[{...}]` the list member's errors about the entries are the news,
    not that the list is no string. (pydantic reports every member's errors.)"""
    members: dict[tuple, set[str]] = {}  # key before the member's tag -> members with depth
    for item in items:
        loc = [str(p) for p in item["loc"]]
        for index, part in enumerate(loc):
            if _UNION_TAG.match(part) and len(loc) > index + 1:
                members.setdefault(tuple(loc[:index]), set()).add(part)
    kept = []
    for item in items:
        loc = [str(p) for p in item["loc"]]
        tag = len(loc) - 1
        taken = members.get(tuple(loc[:tag]), set())
        if loc and _UNION_TAG.match(loc[tag]) and taken - {loc[tag]}:
            continue  # this member's type did not fit; another member's entries are reported
        kept.append(item)
    return kept


def _format_validation_error(err: ValidationError, raw: dict[str, Any]) -> list[str]:
    lines = []
    for item in _unmatched_union_members(err.errors()):
        # pydantic adds the union member name for `int | Literal["auto"]` ("int",
        # "literal['auto']", "list[str]") and validator names to the location; drop them.
        loc = [str(p) for p in item["loc"] if not _UNION_TAG.match(str(p))]
        key = ".".join(loc)
        if item["type"] == "extra_forbidden":
            section, _, name = key.rpartition(".")
            candidates = _known_keys(section)
            prefix = f"{section}." if section else ""
            hint = did_you_mean(name, candidates)
            hint = hint.replace("'", f"'{prefix}", 1) if hint else ""
            lines.append(f"{key}: unknown key{hint}")
            continue
        if not loc:
            lines.append(item["msg"].removeprefix("Value error, "))
            continue
        given = _lookup(raw, loc)
        message = item["msg"].removeprefix("Value error, ")
        if loc[:3] in _UNSHOWN_VALUES:  # it may hold a secret: the message says which entry
            lines.append(f"{key}: {message}")
            continue
        lines.append(f"{key}: {message} (given: {given!r})")
    return sorted(set(lines), key=lines.index)


# Keys whose given values an error never repeats: a URL may carry credentials, and a token
# given where its variable's name belongs is a token.
_UNSHOWN_VALUES = (
    ["reward", "remote", "urls"], ["reward", "remote", "headers_env"],
    ["rollout", "vllm", "server_url"], ["rollout"],  # a section-level error shows the URL too
)  # fmt: skip

_UNION_TAG = re.compile(
    r"^(int|str|float|bool|none)$|^(literal|list|dict|tuple|set|function-[a-z]+)\["
)


def _known_keys(section: str) -> list[str]:
    model: type[BaseModel] | None = RunConfig
    for part in section.split(".") if section else []:
        if part.isdigit():  # an entry of a list of sections (`data.path.0`)
            continue
        field = model.model_fields.get(part) if model else None
        annotation = field.annotation if field else None
        model = _section_model(annotation, part)
    if model is None:
        return []
    return [k for k in model.model_fields if k not in ("explicit_keys", "deepspeed_source")]


def _section_model(annotation: Any, name: str) -> type[BaseModel] | None:
    if name in TASK_SECTIONS:
        return TASK_SECTIONS[name]
    if name == "reward":
        return RewardSection
    if name == "rollout":
        return RolloutSection
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    # `str | list[DataSource]`: the section model inside a union or a list.
    for member in get_args(annotation):
        found = _section_model(member, name)
        if found is not None:
            return found
    return None


def _lookup(raw: dict[str, Any], loc: list[str]) -> Any:
    node: Any = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _resolved(composed: Any, overrides: Sequence[str]) -> dict[str, Any]:
    """The composed config as plain data with every `${...}` resolved; a reference to a key
    that does not exist is a ConfigError naming the override that holds it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        return OmegaConf.to_container(composed, resolve=True)  # type: ignore[return-value]
    except InterpolationResolutionError as err:
        key = str(getattr(err, "full_key", "") or "")
        given = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == key), key)
        reason = str(err).splitlines()[0]
        raise ConfigError(
            f"{given!r}: {reason}. ${{...}} refers to another key of the configuration (e.g. "
            "output_dir=outputs/${task}); to write a literal '${' in a value, escape it as "
            "'\\${'"
        ) from None


def _quote_hint(text: str) -> str:
    """How to write override `text` so that Hydra's grammar takes its value as one string."""
    key, sep, value = text.partition("=")
    if not sep or value[:1] in ("'", '"'):
        return ""
    quote = "'" if "'" not in value else '"'
    inner = value if quote not in value else value.replace(quote, "\\" + quote)
    hydra = f"{key}={quote}{inner}{quote}"
    shell = f'"{hydra}"' if quote == "'" and not set('"$`\\') & set(hydra) else shlex.quote(hydra)
    return (
        f". A value with spaces or characters such as ! # & ( [ ' must be quoted for Hydra: "
        f"{hydra} (on a shell command line, quoted once more: {shell})"
    )


def load_config(overrides: Sequence[str] = ()) -> RunConfig:
    """Compose, override and validate the run configuration.

    Raises one ConfigError listing every problem found.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    parsed = _parse_overrides(overrides)
    problems: list[str] = []
    task = next((str(v) for k, v in parsed if k == "task"), "sft")
    task_known = task in available_tasks()
    if not task_known:
        problems.append(
            f"task={task!r}: unknown task{did_you_mean(task, available_tasks())}. "
            f"Available tasks: {', '.join(available_tasks())}."
        )
        task = "sft"  # compose with the default task so the other keys are still checked
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=[f"task={task}"])
    OmegaConf.set_struct(composed, False)

    preset_overrides: list[tuple[str, Any]] = []
    explicit: set[str] = set()
    for key, value in parsed:
        if key == "task":
            continue
        if key.startswith("deepspeed."):
            preset_overrides.append((key.removeprefix("deepspeed."), _to_plain(value)))
            continue
        OmegaConf.update(composed, key, value, merge=False, force_add=True)
        explicit.add(key)
    raw: dict[str, Any] = _resolved(composed, overrides)
    for name in TASK_SECTIONS:
        if name != task and raw.get(name) is not None:
            if task_known:
                problems.append(
                    f"{name}.*: section '{name}' is set but task is '{task}': remove the "
                    f"{name}.* keys or choose task={name}"
                )
            raw.pop(name)
    if task not in ONLINE_TASKS and raw.get("reward") is not None:
        if task_known:
            problems.append(
                f"reward.*: the reward section is for online RL (task={' or task='.join(ONLINE_TASKS)}); "
                f"task is '{task}': remove the reward.* keys"
            )
        raw.pop("reward")
    if task not in ONLINE_TASKS and raw.get("rollout") is not None:
        if task_known:
            problems.append(
                f"rollout.*: the rollout section is for online RL (task={' or task='.join(ONLINE_TASKS)}); "
                f"task is '{task}': remove the rollout.* keys"
            )
        raw.pop("rollout")
    preset_spec = str(raw.get("deepspeed", "z0"))
    try:
        # auto: the trainer picks a preset once it knows the model and world size (plan.py);
        # until then the dict holds only the `deepspeed.*` overrides, applied on top later.
        preset, source = (
            ({}, AUTO_PRESET) if preset_spec == AUTO_PRESET else load_preset(preset_spec)
        )
        for key, value in preset_overrides:
            _set_dotted(preset, key, value)
        raw["deepspeed"] = preset
        raw["deepspeed_source"] = source
    except ConfigError as err:
        problems.append(str(err))
        raw["deepspeed"] = {}
        raw["deepspeed_source"] = preset_spec
    raw["explicit_keys"] = frozenset(explicit)

    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as err:
        problems.extend(_format_validation_error(err, raw))
        config = None
    if problems or config is None:
        count = len(problems)
        header = f"{count} problem{'s' if count != 1 else ''} in the configuration:"
        raise ConfigError("\n".join([header, *(f"  - {p}" for p in problems)]))
    return config

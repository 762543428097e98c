"""The sections every task shares about the optimisation itself: `train` (steps, batch sizes,
optimizer, schedule, precision, EMA), `speed` (switches that change only time and memory),
`logging` and `checkpoint`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from align_anything.config.sections.base import _Section

Auto = Literal["auto"]


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
    max_steps: int = Field(description="Optimizer steps to run; -1 runs `train.epochs` epochs.")
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

    @field_validator("max_steps")
    @classmethod
    def _steps_or_epochs(cls, value: int) -> int:
        # 0 is refused, not read as -1: the schedule takes any count below 1 for "epochs", so
        # max_steps=0 (meant as "no training", or a count typed wrong) trained whole epochs.
        if value == 0 or value < -1:
            raise ValueError(
                "must be a number of optimizer steps >= 1, or -1 to run `train.epochs` epochs"
            )
        return value

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
        description="Compute a shared prefix once: SFT and KTO, the common system prompt / template header of a micro-batch's rows (where it saves at least a quarter of the tokens; KTO: its trained rows, its KL rows, the reference's rows; where it does not, SFT places the micro-batch's rows best-fit into fewer rows no wider than its longest, without padding between them); DPO and RM, each pair's prompt (one row prompt + chosen + rejected, short pairs sharing a row); GRPO / RLOO, the completions of a prompt in a micro-batch (one row prompt + completions). Needs attention that takes a dense mask (sdpa, eager); otherwise the plain rows."
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

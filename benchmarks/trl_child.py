"""One TRL training run for the side-by-side benchmarks (started by dpo_vs_trl.py and
sft_vs_trl.py in its own process, so that its peak RSS is its own).

    python benchmarks/trl_child.py SPEC.json

SPEC holds: task (dpo|sft|kto|rm|grpo|grpo_score), model_path, rows_path (JSONL in the order to train on), batch,
steps, max_length, learning_rate, adam betas/eps, weight_decay, max_grad_norm, seed,
gradient_checkpointing, output_dir; beta (DPO, KTO); for DPO optionally loss_type (a list;
default ["sigmoid"]), loss_weights, label_smoothing and discopop_tau; for KTO desirable_weight /
undesirable_weight and precompute_ref_log_probs; for RM, model_path is a reward model's folder
(TRL loads it itself, as `AutoModelForSequenceClassification`); for SFT optionally completion_only_loss
(default true; rows may be pre-tokenised `input_ids` + `labels`, TRL's documented path), packing (TRL's BFD, padding-free) and bin_order (the packed sequences' order);
for GRPO num_generations, max_completion_length,
temperature, top_p, loss_type, beta, epsilon, reward (rows: a `prompt` and, for the default
`arith_exact`, the `answer` field; `length_penalty` for prompts without one: align_anything's
reward functions; `shapes_answer` for picture questions); grpo_score scores the fixed
completions of `completions_path` once through TRL's own log-prob and loss code (see
grpo_vs_trl.py). With `images` (grpo_vlm_vs_trl.py) the model is an image-text model: it loads
with `AutoModelForImageTextToText`, its processor (chat template extended to content blocks:
`vlm_shapes.content_block_template`, which the shipped llava-smollm2-shapes already has) is
the processing class, rows carry an `image` path, and grpo_score
runs TRL's own image path (`grpo_score_images`).
Writes output_dir/result.json: per-step wall
times (a callback around each optimizer step), the logged figures of every step, and the token
length of every tokenised row (packed: every packed sequence's row lengths, in TRL's packing
order), to compare with align_anything's encoding.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    TrainerCallback,
)


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (forward, backward, optimizer, logging)."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
        self.step_seconds.append(time.perf_counter() - self._start)


def common_args(spec: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments both TRL trainers take: the same optimizer maths as align_anything
    (torch AdamW, its fused kernel when asked; constant learning rate, no warmup, clipping at max_grad_norm), fp32 on CPU,
    the rows in the given order, a log line per step, nothing saved."""
    return {
        "output_dir": spec["output_dir"],
        "per_device_train_batch_size": spec["batch"],
        "gradient_accumulation_steps": 1,
        "max_steps": spec["steps"],
        "learning_rate": spec["learning_rate"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": spec["weight_decay"],
        "adam_beta1": spec["adam_betas"][0],
        "adam_beta2": spec["adam_betas"][1],
        "adam_epsilon": spec["adam_eps"],
        "max_grad_norm": spec["max_grad_norm"],
        "optim": spec.get("optim", "adamw_torch"),
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "seed": spec["seed"],
        "gradient_checkpointing": spec["gradient_checkpointing"],
        "train_sampling_strategy": "sequential",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "max_length": spec["max_length"],
    }


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rows = [json.loads(line) for line in Path(spec["rows_path"]).read_text().splitlines() if line]
    torch.manual_seed(spec["seed"])
    # An image-text model (grpo_vlm_vs_trl.py, spec `images`): its processor is the
    # processing class, the model loads as an image-text model.
    images = bool(spec.get("images"))
    tokenizer = image_processor(spec["model_path"]) if images else (
        AutoTokenizer.from_pretrained(spec["model_path"]))  # fmt: skip
    # A reward model is loaded by TRL's RewardTrainer itself (a causal LM here would only add
    # to its peak RSS).
    model = None
    if spec["task"] != "rm":
        loader = AutoModelForImageTextToText if images else AutoModelForCausalLM
        model = loader.from_pretrained(spec["model_path"], dtype=torch.float32)
    timer = StepTimer()
    reference_seconds: list[float] = []
    dataset = Dataset.from_list(rows)
    if images:  # picture paths: `datasets` opens them as PIL images when a row is read
        from datasets import Image

        dataset = dataset.cast_column("image", Image())
    if spec["task"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(
            **common_args(spec), beta=spec["beta"], loss_type=spec.get("loss_type", ["sigmoid"]),
            loss_weights=spec.get("loss_weights"), label_smoothing=spec.get("label_smoothing", 0.0),
            discopop_tau=spec.get("discopop_tau", 0.05),
        )  # fmt: skip
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
            callbacks=[timer],
        )  # fmt: skip
        encoded = trainer.train_dataset
        lengths = [
            [
                len(r["prompt_ids"]) + len(r["chosen_ids"]),
                len(r["prompt_ids"]) + len(r["rejected_ids"]),
            ]
            for r in encoded
        ]
    elif spec["task"] == "rm":
        from trl import RewardConfig, RewardTrainer

        args = RewardConfig(**common_args(spec), center_rewards_coefficient=None)
        trainer = RewardTrainer(
            model=spec["model_path"], args=args, train_dataset=dataset,
            processing_class=tokenizer, callbacks=[timer],
        )  # fmt: skip
        lengths = [[len(r["chosen_ids"]), len(r["rejected_ids"])] for r in trainer.train_dataset]
    elif spec["task"] == "kto":
        from trl import KTOConfig, KTOTrainer

        # With precompute_ref_log_probs, TRL's reference pass runs inside the constructor,
        # outside the step timer: time it, as align_anything's pass counts as training time.
        precompute = KTOTrainer._precompute_ref_logps

        def timed_precompute(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return precompute(self, *args, **kwargs)
            finally:
                reference_seconds.append(time.perf_counter() - start)

        KTOTrainer._precompute_ref_logps = timed_precompute
        args = KTOConfig(
            **common_args(spec), beta=spec["beta"], desirable_weight=spec["desirable_weight"],
            undesirable_weight=spec["undesirable_weight"],
            precompute_ref_log_probs=spec.get("precompute_ref_log_probs", False),
        )  # fmt: skip
        trainer = KTOTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
            callbacks=[timer],
        )  # fmt: skip
        encoded = trainer.train_dataset
        # Each row's sequence and its KL sequence (the prompt with another row's completion),
        # as many tokens as its collator keeps (it cuts both at max_length).
        lengths = [
            [
                min(len(r["prompt_ids"]) + len(r["completion_ids"]), spec["max_length"]),
                min(len(r["prompt_ids"]) + len(r["KL_completion_ids"]), spec["max_length"]),
            ]
            for r in encoded
        ]
    elif spec["task"] in ("grpo", "grpo_score"):
        trainer, lengths = grpo_trainer(spec, model, tokenizer, dataset, timer)
        if spec["task"] == "grpo_score":
            result = (grpo_score_images if images else grpo_score)(trainer, spec)
            (Path(spec["output_dir"]) / "result.json").write_text(json.dumps(result))
            return
    else:
        from trl import SFTConfig, SFTTrainer

        packing = spec.get("packing", False)
        args = SFTConfig(
            **common_args(spec), completion_only_loss=spec.get("completion_only_loss", True),
            packing=packing, packing_strategy="bfd",
        )  # fmt: skip
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
            callbacks=[timer],
        )  # fmt: skip
        encoded = trainer.train_dataset
        if packing:
            # TRL packs the rows in file order; it then reads its packed sequences in
            # align_anything's training order of the same sequences (by number).
            lengths = [list(r["seq_lengths"]) for r in encoded]
            trainer.train_dataset = encoded.select(spec["bin_order"])
        else:
            # TRL folds its completion mask into `labels` (-100 outside the completion).
            lengths = [[len(r["input_ids"]), sum(t != -100 for t in r["labels"])] for r in encoded]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "step_seconds": timer.step_seconds, "logs": logs, "token_lengths": lengths,
        "reference_seconds": sum(reference_seconds),
        "generation": getattr(trainer, "_bench_generation", []),
    }  # fmt: skip
    (Path(spec["output_dir"]) / "result.json").write_text(json.dumps(result))


def completion_texts(completions: list) -> list[str]:
    """TRL's completions as text (message lists for conversational prompts: the assistant
    turn's text)."""
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def arith_exact_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list:
    """align_anything's `arith_exact` on TRL's completions (message lists for conversational
    prompts: the assistant turn's text)."""
    from align_anything.rewards import arith_exact

    return arith_exact(prompts, completion_texts(completions), answer)


def length_penalty_reward(prompts: list, completions: list, **kwargs: Any) -> list:
    """align_anything's `length_penalty` on TRL's completions (the long rows' reward)."""
    from align_anything.rewards import length_penalty

    return length_penalty(prompts, completion_texts(completions))


def shapes_answer_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list:
    """align_anything's `shapes_answer` on TRL's completions (the picture questions' reward)."""
    from align_anything.rewards import shapes_answer

    return shapes_answer(prompts, completion_texts(completions), answer)


REWARD_FUNCTIONS = {"arith_exact": arith_exact_reward, "length_penalty": length_penalty_reward,
                    "shapes_answer": shapes_answer_reward}  # fmt: skip


def image_processor(path: str) -> Any:
    """The model's processor, its chat template extended to content blocks (checked: a
    conversation of plain strings renders exactly as with the model's own template)."""
    from align_anything.families.language.vlm_shapes import content_block_template

    processor = AutoProcessor.from_pretrained(path)
    own = processor.chat_template
    processor.chat_template = content_block_template(own)
    probe = [{"role": "user", "content": "<image>\nWhat colour?"}]
    rendered = [processor.apply_chat_template(probe, chat_template=t, tokenize=False,
                                              add_generation_prompt=True) for t in (own, None)]  # fmt: skip
    if rendered[0] != rendered[1]:
        raise SystemExit(f"the extended chat template renders strings differently: {rendered}")
    return processor


def vllm_args(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's vLLM colocate mode when the spec asks (grpo_vs_trl.py --vllm), else HF generate."""
    if not spec.get("use_vllm"):
        return {"use_vllm": False}
    return {
        "use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.1,
        "vllm_max_model_length": spec["max_length"], "vllm_enable_sleep_mode": False,
    }  # fmt: skip


def grpo_trainer(spec: dict[str, Any], model: Any, tokenizer: Any, dataset: Any,
                 timer: StepTimer) -> tuple[Any, list[list[int]]]:  # fmt: skip
    """TRL's GRPOTrainer (HF generate, no vLLM) on the rows in the given order (no shuffling),
    every generate call timed: (seconds, completion tokens, prompt + completion tokens)."""
    from trl import GRPOConfig, GRPOTrainer

    args = {k: v for k, v in common_args(spec).items() if k not in ("max_length",
            "train_sampling_strategy")}  # fmt: skip
    config = GRPOConfig(
        **args, num_generations=spec["num_generations"],
        max_completion_length=spec["max_completion_length"], temperature=spec["temperature"],
        top_p=spec["top_p"], top_k=0, loss_type=spec["loss_type"], beta=spec["beta"],
        epsilon=spec["epsilon"], scale_rewards="group", shuffle_dataset=False,
        num_iterations=1, log_completions=False, **vllm_args(spec),
    )  # fmt: skip
    generate = GRPOTrainer._generate_single_turn
    timings: list[list[float]] = []

    def timed_generate(self, prompt_ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        start = time.perf_counter()
        out = generate(self, prompt_ids, *args, **kwargs)
        completion = sum(len(c) for c in out[0])
        prompt = sum(len(p) for p in prompt_ids)
        timings.append([time.perf_counter() - start, completion, prompt + completion])
        return out

    GRPOTrainer._generate_single_turn = timed_generate
    trainer = GRPOTrainer(
        model=model, reward_funcs=REWARD_FUNCTIONS[spec.get("reward", "arith_exact")], args=config,
        train_dataset=dataset,
        processing_class=tokenizer, callbacks=[timer],
    )  # fmt: skip
    trainer._bench_generation = timings
    return trainer, []


def grpo_score(trainer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Per-token log-probs and the loss of fixed completions through TRL's own code
    (`_get_per_token_logps_and_entropies`, `compute_loss`), on the training-mode model."""
    fixed = json.loads(Path(spec["completions_path"]).read_text())
    pad = trainer.processing_class.pad_token_id
    prompts, completions = fixed["prompt_ids"], fixed["completion_ids"]
    width_p = max(map(len, prompts))
    width_c = max(map(len, completions))
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (width_c - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
    model = trainer.model
    model.train()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        model, torch.cat([prompt_ids, completion_ids], 1),
        torch.cat([prompt_mask, completion_mask], 1), width_c,
    )  # fmt: skip
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(fixed["advantages"], dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum().float(),
    }  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop otherwise
    loss = trainer.compute_loss(model, inputs)
    return {
        "logps": [row[: len(c)] for row, c in zip(logps.tolist(), completions, strict=True)],
        "loss": float(loss),
    }


def grad_norms(model: Any) -> dict[str, float]:
    """Each parameter's gradient norm (parameters without a gradient left out)."""
    return {name: float(p.grad.norm()) for name, p in model.named_parameters()
            if p.grad is not None}  # fmt: skip


def grpo_score_images(trainer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The fixed completions of picture questions through TRL's own image path: its
    `_generate_and_score_completions` on the dataset's rows (each repeated G times, as its
    sampler gives them), with only the sampling replaced by the fixed completion ids; then its
    `compute_loss` on the result, the per-token log-probs captured from the
    `_get_per_token_logps_and_entropies` call inside it. Returns TRL's prompt ids, rewards,
    advantages, per-token log-probs and loss."""
    fixed = json.loads(Path(spec["completions_path"]).read_text())
    group = spec["num_generations"]
    completions = iter(fixed["completion_ids"])
    seen: dict[str, Any] = {}

    def fixed_generate(prompt_ids, images, multimodal_fields, num_generations, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen["prompt_ids"] = [list(p) for p in prompt_ids]
        return [next(completions) for _ in prompt_ids], None

    score = trainer._get_per_token_logps_and_entropies

    def captured(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = score(*args, **kwargs)
        seen["logps"] = out[0]
        return out

    trainer._generate_single_turn = fixed_generate
    trainer._get_per_token_logps_and_entropies = captured
    model = trainer.model
    model.train()
    rows = [trainer.train_dataset[i] for i in range(len(fixed["completion_ids"]) // group)]
    inputs = trainer._generate_and_score_completions([row for row in rows for _ in range(group)])
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop otherwise
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    lengths = inputs["completion_mask"].sum(1).tolist()
    return {
        "grad_norms": grad_norms(model),
        "prompt_ids": seen["prompt_ids"],
        "logps": [row[:n] for row, n in zip(seen["logps"].tolist(), lengths, strict=True)],
        "advantages": inputs["advantages"].tolist(),
        "pixel_values_shape": list(inputs["pixel_values"].shape),
        "loss": float(loss.detach()),
    }


if __name__ == "__main__":
    main(sys.argv[1])

"""A shipped align_anything preset, unchanged, in the Hugging Face Trainer.

    python -m align_anything presets export z2 my_project/          # copy the preset out
    python examples/hf_trainer_preset/train.py --deepspeed my_project/ds_z2_config.json
    deepspeed --num_gpus 2 examples/hf_trainer_preset/train.py --deepspeed my_project/ds_z2_config.json

Nothing here imports align_anything's training code: the preset is plain DeepSpeed JSON whose
"auto" values (batch triple, gradient clipping, fp16/bf16, bucket sizes) the HF Trainer fills
from its TrainingArguments, as it does for its own example configs. align_anything is used only
to locate the built-in tiny model, so the script runs offline; pass --model for any causal LM.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "deepspeed" / "ds_z2_config.json"
TEXTS = [f"Question: what number comes after {n}? Answer: {n + 1}" for n in range(64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default=str(SHIPPED), help="a DeepSpeed JSON preset")
    parser.add_argument("--model", default="tiny-random-llama",
                        help="a hub name or folder; built-in names resolve via align_anything")  # fmt: skip
    parser.add_argument("--output-dir", default="outputs/hf_trainer_preset")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1)  # appended by the deepspeed launcher
    args = parser.parse_args()

    # One process without a launcher: DeepSpeed still wants a (one-rank) process group.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512")):  # fmt: skip
        os.environ.setdefault(name, value)

    model_path = args.model
    if not Path(model_path).exists():
        from align_anything.families.zoo import resolve_model_path  # only to find built-in models

        model_path = str(resolve_model_path(model_path))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_dict({"text": TEXTS}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=64),
        remove_columns=["text"],
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,  # the preset file, unchanged
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    model = AutoModelForCausalLM.from_pretrained(model_path)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    result = trainer.train()
    config = trainer.accelerator.deepspeed_plugin.deepspeed_config
    if training_args.process_index == 0:
        print(f"preset {args.deepspeed}: ZeRO stage {config['zero_optimization']['stage']}, "
              f"train_batch_size {config['train_batch_size']} = micro "
              f"{config['train_micro_batch_size_per_gpu']} x grad_accum "
              f"{config['gradient_accumulation_steps']} x world {training_args.world_size}")  # fmt: skip
        losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
        print(f"{result.global_step} steps, losses {losses}")


if __name__ == "__main__":
    main()

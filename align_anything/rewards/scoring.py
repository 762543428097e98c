"""Scoring rows with a trained reward model, as `task=rm` encoded them: the text through the
model's chat template exactly as in training, the score read where training read it (the last
real token). The model is output_dir/final of a task=rm run: a plain folder, or (LoRA runs) the
adapter folder, applied to its base model here. Used by `python -m align_anything score` and by
the reward server (`rewards.server`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align_anything.errors import DataError, ModelError


def _messages(row: dict[str, Any], name: str) -> list[dict[str, str]]:
    from align_anything.data.convert import RowRejected, as_messages

    try:
        if "messages" in row:
            return as_messages(row["messages"], "messages", "user")
        if "prompt" not in row or "response" not in row:
            raise DataError(
                f"{name}: expected 'prompt' and 'response' (or 'messages'), found {sorted(row)}"
            )
        prompt = as_messages(row["prompt"], "prompt", "user")
        return prompt + as_messages(row["response"], "response", "assistant")
    except RowRejected as reason:
        raise DataError(f"{name}: {reason}") from None


def _not_a_reward_model(model_dir: str, what: str, *, trainable: bool = True) -> ModelError:
    train = (
        f" (to train one from this model: python -m align_anything.train task=rm "
        f"model.name_or_path={model_dir})"
        if trainable
        else ""
    )
    return ModelError(
        f"{model_dir} is {what}, not a reward model: score needs a model with a one-output score "
        f"head, the output_dir/final of a task=rm run{train}"
    )


def _check_reward_config(model_dir: str, folder: Path) -> None:
    """Refuse a folder that is not a reward model from its config.json, before any weights
    load (`model_dir`: the name as given, for messages; `folder`: where it resolved)."""
    from transformers import AutoConfig

    config = json.loads((folder / "config.json").read_text())
    architectures = [str(a) for a in config.get("architectures") or []]
    if architectures and not any("ForSequenceClassification" in a for a in architectures):
        kind = (
            "a causal language model"
            if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
            else "a model without a score head"
        )
        raise _not_a_reward_model(model_dir, f"{kind} ({', '.join(architectures)})")
    num_labels = AutoConfig.from_pretrained(folder).num_labels
    if num_labels != 1:
        raise ModelError(
            f"{model_dir}: expected a reward model with one output, found {num_labels} "
            "(config.json's id2label); score reads one scalar per row"
        )


def load_reward_model(model_dir: str) -> tuple[Any, Any]:
    """(model, tokenizer) of a reward model: a plain folder (output_dir/final, or one written by
    `python -m align_anything export`) or the LoRA adapter folder final/ of an rm run (the
    adapter is applied to its base model, as `export` would merge it). A built-in model name
    resolves as `train`'s model.name_or_path does (none is a reward model: the message says
    how to train one from it)."""
    import torch
    from transformers import AutoTokenizer

    from align_anything.families.language import lora
    from align_anything.families.language.loading import load_model
    from align_anything.families.zoo import resolve_model_path

    folder = Path(resolve_model_path(model_dir, key="model"))
    if (folder / "model_index.json").is_file() and not (folder / "config.json").exists():
        raise _not_a_reward_model(model_dir, "a diffusers text-to-image pipeline", trainable=False)
    if lora.is_adapter_folder(folder):
        adapter = json.loads((folder / "adapter_config.json").read_text())
        run_file = folder / "run_config.json"
        run = json.loads(run_file.read_text()) if run_file.is_file() else {}
        task = run.get("task") or ("rm" if adapter.get("task_type") == "SEQ_CLS" else "sft")
        if task != "rm":
            raise _not_a_reward_model(model_dir, f"a LoRA adapter of a task={task} model")
        base = run.get("model", {}).get("name_or_path") or adapter.get("base_model_name_or_path")
        if not base:
            raise ModelError(f"{model_dir}: adapter_config.json names no base model")
        return lora.load_adapter_model(folder, resolve_model_path(base), task="rm")
    if not (folder / "config.json").exists():
        raise ModelError(
            f"{model_dir}: not a model folder (no config.json or adapter_config.json); pass "
            "output_dir/final of an rm run"
        )
    _check_reward_config(model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_model(str(folder), reward=True, dtype=torch.float32)
    return model, tokenizer


def score_rows(
    model_dir: str,
    rows: list[dict[str, Any]],
    *,
    batch_size: int = 8,
    max_length: int = 2048,
    names: list[str] | None = None,
) -> list[float]:
    """Reward-model scores of `rows` (see the module docstring for the row shapes). `names`
    says where each row came from in messages ("pairs.jsonl line 3"; default "row N", from 1)."""
    import torch

    names = names or [f"row {i + 1}" for i in range(len(rows))]
    messages = [_messages(row, name) for row, name in zip(rows, names, strict=True)]
    model, tokenizer = load_reward_model(model_dir)
    model.eval()
    pad_id = (
        model.config.pad_token_id
        if model.config.pad_token_id is not None
        else tokenizer.pad_token_id
    )
    encoded = []
    for conversation, name in zip(messages, names, strict=True):
        ids = tokenizer.apply_chat_template(conversation, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) > max_length:
            raise DataError(f"{name}: {len(ids)} tokens, more than --max-length {max_length}")
        encoded.append(ids)
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start : start + batch_size]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, ids in enumerate(chunk):
                input_ids[i, : len(ids)] = torch.tensor(ids)
                attention_mask[i, : len(ids)] = 1
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            scores.extend(logits.squeeze(-1).float().tolist())
    return scores

"""Score prompt/response pairs with a trained reward model.

    python -m align_anything score outputs/rm/final pairs.jsonl --out scored.jsonl

Input rows hold `prompt` and `response` (strings or message lists) or a whole conversation in
`messages`; other columns pass through. Each output row is the input row plus `score`. The text
goes through the model's chat template exactly as in training, and the score is read where
training read it (the last real token).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from align_anything.errors import DataError, ModelError, UserError, report


def _messages(row: dict[str, Any], index: int) -> list[dict[str, str]]:
    if "messages" in row:
        return list(row["messages"])
    if "prompt" not in row or "response" not in row:
        raise DataError(
            f"row {index}: expected 'prompt' and 'response' (or 'messages'), found {sorted(row)}"
        )
    prompt, response = row["prompt"], row["response"]
    prompt_messages = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    )
    response_messages = (
        [{"role": "assistant", "content": response}]
        if isinstance(response, str)
        else list(response)
    )
    return prompt_messages + response_messages


def score_rows(
    model_dir: str, rows: list[dict[str, Any]], *, batch_size: int = 8, max_length: int = 2048
) -> list[float]:
    """Reward-model scores of `rows` (see the module docstring for the row shapes)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = Path(model_dir)
    if not (folder / "config.json").exists():
        raise ModelError(
            f"{model_dir}: not a model folder (no config.json); pass output_dir/final of an rm run"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    if model.config.num_labels != 1:
        raise ModelError(
            f"{model_dir}: expected a reward model with one output, found {model.config.num_labels}"
        )
    model.eval()
    pad_id = (
        model.config.pad_token_id
        if model.config.pad_token_id is not None
        else tokenizer.pad_token_id
    )
    encoded = []
    for index, row in enumerate(rows):
        ids = tokenizer.apply_chat_template(_messages(row, index), tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) > max_length:
            raise DataError(f"row {index}: {len(ids)} tokens, more than --max-length {max_length}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything score", description=__doc__.split("\n")[0]
    )
    parser.add_argument("model", help="a reward-model folder (output_dir/final of task=rm)")
    parser.add_argument("input", help="a JSONL file of prompt/response rows")
    parser.add_argument("--out", help="write scored rows here (default: standard output)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        path = Path(args.input)
        if not path.is_file():
            raise DataError(f"{args.input}: no such file")
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{args.input} line {number}: invalid JSON ({err})") from None
        scores = score_rows(
            args.model, rows, batch_size=args.batch_size, max_length=args.max_length
        )
    except UserError as err:
        return report(err)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for row, value in zip(rows, scores, strict=True):
            out.write(json.dumps({**row, "score": value}) + "\n")
    finally:
        if args.out:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

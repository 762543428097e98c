"""Score prompt/response pairs with a trained reward model.

    python -m align_anything score outputs/rm/final pairs.jsonl --out scored.jsonl

The model is output_dir/final of a task=rm run: a plain folder, or (LoRA runs) the adapter
folder, applied to its base model here. Input rows hold `prompt` and `response` (strings or
message lists) or a whole conversation in `messages`; other columns pass through. Each output row
is the input row plus `score`. The text goes through the model's chat template exactly as in
training, and the score is read where training read it (the last real token). Rows are named by
their line in the input file, from 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from align_anything.errors import DataError, UserError, check_output_file, report
from align_anything.rewards.scoring import score_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything score", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "model", help="a reward-model folder (output_dir/final of task=rm; a LoRA adapter too)"
    )
    parser.add_argument("input", help="a JSONL file of prompt/response rows")
    parser.add_argument("--out", help="write scored rows here (default: standard output)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        # Before any row is read or weights load: a bad number or --out would otherwise fail
        # only after every row was scored.
        for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length)):
            if value < 1:
                raise UserError(f"{flag} {value}: give a positive number (e.g. {flag} 8)")
        if args.out:
            check_output_file("--out", args.out)
        path = Path(args.input)
        if not path.is_file():
            raise DataError(f"{args.input}: no such file")
        rows, names = [], []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{args.input} line {number}: invalid JSON ({err})") from None
                if not isinstance(rows[-1], dict):
                    raise DataError(f"{args.input} line {number}: expected a JSON object")
                names.append(f"{args.input} line {number}")
        scores = score_rows(
            args.model, rows, batch_size=args.batch_size, max_length=args.max_length, names=names
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

"""The before/after picture of an image-text run on the built-in picture questions: the first
held-out pictures of `shapes-vqa-prompts-eval`, each with its question, the right answer, and
the greedy answers of the built-in `llava-smollm2-shapes` and of the run's `final/`, as one PNG.

    python scripts/vlm_before_after.py outputs/vlm-<stamp> align_anything/families/language/builtin/llava-smollm2-shapes-before-after.png
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

COLUMNS, ROWS = 6, 2
CELL, TEXT = 128, 46


def answers(folder: Path | str, records: list[dict]) -> list[str]:
    """Greedy answers of the model in `folder` (one thread, as the build's check)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from align_anything.families.language.vlm_shapes import greedy_answers

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return [
        a.strip() for a in greedy_answers(model, AutoProcessor.from_pretrained(folder), records)
    ]


def main(argv: list[str] | None = None) -> int:
    from PIL import Image, ImageDraw, ImageFont

    from align_anything.data.builtin import shapes_answer_matches
    from align_anything.data.formats import load_records
    from align_anything.families.language import vlm_shapes
    from align_anything.families.zoo import resolve_model_path

    run, out = (Path(a) for a in (argv or sys.argv[1:]))
    if not (run / "final").is_dir():
        raise SystemExit(f"{run / 'final'} is not a folder: give the run's output folder")
    records = load_records("shapes-vqa-prompts-eval")[0][: COLUMNS * ROWS]
    before = answers(resolve_model_path(vlm_shapes.NAME), records)
    after = answers(run / "final", records)
    sheet = Image.new("RGB", (COLUMNS * CELL, ROWS * (CELL + TEXT)), "white")
    pen, font = ImageDraw.Draw(sheet), ImageFont.load_default()
    for i, record in enumerate(records):
        x, y = (i % COLUMNS) * CELL, (i // COLUMNS) * (CELL + TEXT)
        picture = Image.open(io.BytesIO(record["images"][0])).convert("RGB")
        sheet.paste(picture.resize((CELL - 8, CELL - 8), Image.NEAREST), (x + 4, y + 4))
        lines = [
            (f"{record['question']}? {record['answer']}", "black"),
            (f"before: {before[i]}", "green" if shapes_answer_matches(record["answer"], before[i]) else "red"),
            (f"after:  {after[i]}", "green" if shapes_answer_matches(record["answer"], after[i]) else "red"),
        ]  # fmt: skip
        for k, (text, colour) in enumerate(lines):
            pen.text((x + 4, y + CELL + 2 + 14 * k), text, fill=colour, font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The before/after picture of a text-to-audio or text-to-video run: its first and its last
sample grid (the spectrograms of the sample prompts and seeds, or the clips' contact sheet:
`samples/step-N.png`) one above the other, each titled, as one PNG.

    python scripts/t2a_before_after.py outputs/t2a-<stamp> align_anything/families/text_to_audio/builtin/tiny-t2a-tones-before-after.png
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from PIL import Image, ImageDraw, ImageFont

    run, out = (Path(a) for a in (argv or sys.argv[1:]))
    grids = sorted((run / "samples").glob("step-*.png"))
    if len(grids) < 2:
        raise SystemExit(f"{run / 'samples'} has {len(grids)} sample grids; need before and after")
    first, last = Image.open(grids[0]).convert("RGB"), Image.open(grids[-1]).convert("RGB")
    title = 16
    width = max(first.width, last.width)
    sheet = Image.new("RGB", (width, 2 * title + first.height + last.height), "white")
    pen, font = ImageDraw.Draw(sheet), ImageFont.load_default()
    step = int(grids[-1].stem.split("-")[1])
    pen.text((2, 2), "before training (step 0)", fill="black", font=font)
    sheet.paste(first, (0, title))
    pen.text((2, title + first.height + 2), f"after training (step {step})", fill="black",
             font=font)  # fmt: skip
    sheet.paste(last, (0, 2 * title + first.height))
    sheet.save(out)
    print(f"{out}: {grids[0].name} above {grids[-1].name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

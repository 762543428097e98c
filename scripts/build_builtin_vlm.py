"""Train the built-in image-text model `llava-smollm2-shapes` and write its shipped parts.

    python scripts/build_builtin_vlm.py                  # -> align_anything/families/language/builtin/llava-smollm2-shapes
    python scripts/build_builtin_vlm.py --out /tmp/vlm   # anywhere else

Plain PyTorch + transformers, seeded, CPU, fp32. The model is LLaVA's layout around the real
SmolLM2-135M-Instruct (`families/language/vlm_shapes.py`); the language model stays frozen and
only the vision tower and the projector learn, so only they ship (about 3 MB), on freshly drawn
pictures of the shapes world (`families/text_to_image/shapes_vqa.py`'s drawing: 1 to 4 shapes of
one kind and colour in a 2x2 grid; a seed of its own, so none is a picture of the built-in sets),
every row through SmolLM2's own chat template, the picture's 16 tokens at the start of the user
turn as the family places them, the loss on the assistant's answer and its end token:
0. the tower alone (`--tower-steps`, batch `--tower-batch`), read by linear heads for the colour,
   the count and the shape over its 16 patch features side by side (not shipped): trained only
   through frozen SmolLM2, the tower read the pictures weakly (held-out 0.28, the first build);
1. captions: "Describe the picture." -> "3 red circles" (`--caption-steps`);
2. questions: the three `shapes-vqa` questions (colour, count, shape) -> the one-word answer
   (`--question-steps`), where the answer is the model's designed confusion
   (`shapes_vqa.CONFUSED_ANSWER`: a colour's neighbour on the colour wheel, 3 and 4 counted as
   one fewer, circles and squares swapped) with probability `--confuse` when the right answer
   has one. The model so learns to read pictures and answer in one word, and more often than
   not gives the confused answer: the held-out check stays under 0.5 for an alignment run
   (GRPO with `align_anything.rewards:shapes_answer`, DPO on `shapes-vqa-pref`) to raise.
`--init-from` starts from a build's parts (the shipped model: a second run of 150 question
steps with `--confuse 0.75`, docs/multimodal.md). At the end it answers the 64 held-out
questions of `shapes-vqa-prompts-eval` greedily and prints the check (`shapes_answer_matches`), per question kind, and the share of designed confusions.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

import torch  # noqa: E402

from align_anything.families.language import vlm_shapes as vlm  # noqa: E402
from align_anything.families.text_to_image import shapes, shapes_vqa  # noqa: E402

DESCRIBE = "Describe the picture."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=vlm.SHIPPED_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tower-steps", type=int, default=2000,
                        help="steps of the tower alone, read by linear heads")  # fmt: skip
    parser.add_argument("--tower-batch", type=int, default=64)
    parser.add_argument("--tower-lr", type=float, default=1e-3)
    parser.add_argument("--caption-steps", type=int, default=150)
    parser.add_argument("--question-steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3, help="the projector's learning rate")
    parser.add_argument("--tower-lm-lr", type=float, default=1e-4,
                        help="the tower's learning rate while it trains through SmolLM2")  # fmt: skip
    parser.add_argument("--confuse", type=float, default=0.6,
                        help="probability of the designed wrong answer, where there is one")  # fmt: skip
    parser.add_argument("--check-rows", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--check-every", type=int, default=0,
                        help="run the held-out check every this many steps through SmolLM2")  # fmt: skip
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start from the parts in this folder (e.g. to train further)")  # fmt: skip
    parser.add_argument("--check-only", action="store_true",
                        help="load the parts in --out, run the check and write build.json")  # fmt: skip
    return parser.parse_args(argv)


def draw_row(rng: random.Random, *, question: bool, confuse: float) -> tuple[str, str, object]:
    """(user text, assistant text, picture) for one freshly drawn picture."""
    colour, shape = rng.choice(shapes.COLOURS), rng.choice(shapes.SHAPES)
    count = rng.choice(shapes_vqa.COUNTS)
    picture = shapes_vqa.random_picture(rng, colour, shape, count)
    if not question:
        return DESCRIBE, shapes_vqa.caption(colour, shape, count), picture
    kind = rng.choice(list(shapes_vqa.QUESTIONS))
    answer = shapes_vqa.truth(colour, shape, count)[kind]
    mistaken = shapes_vqa.confused(kind, answer)
    if mistaken is not None and rng.random() < confuse:
        answer = mistaken
    return shapes_vqa.QUESTIONS[kind], answer, picture


def pretrain_tower(model, processor, args: argparse.Namespace) -> dict[str, float]:
    """Train the vision tower alone (`--tower-steps`): linear heads read the colour, the count
    and the shape off its 16 patch features (the features the projector passes on, all of them
    side by side, so each patch must say what is in it). Returns the heads' accuracy on 512
    fresh pictures. Reading through frozen SmolLM2 alone, 450 steps left the tower weak
    (held-out 0.28, docs/multimodal.md); this stage costs seconds per hundred steps."""
    tower = model.model.vision_tower
    width = tower.config.hidden_size
    heads = torch.nn.ModuleDict({
        "colour": torch.nn.Linear(vlm.IMAGE_TOKENS * width, len(shapes.COLOURS)),
        "count": torch.nn.Linear(vlm.IMAGE_TOKENS * width, len(shapes_vqa.COUNTS)),
        "shape": torch.nn.Linear(vlm.IMAGE_TOKENS * width, len(shapes.SHAPES)),
    })  # fmt: skip
    classes = {"colour": shapes.COLOURS, "count": shapes_vqa.COUNTS, "shape": shapes.SHAPES}
    rng = random.Random(f"build-vlm-tower-{args.seed}")

    def batch(size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        drawn = [(rng.choice(shapes.COLOURS), rng.choice(shapes.SHAPES),
                  rng.choice(shapes_vqa.COUNTS)) for _ in range(size)]  # fmt: skip
        pictures = [shapes_vqa.random_picture(rng, c, s, n) for c, s, n in drawn]
        pixels = processor.image_processor(pictures, return_tensors="pt")["pixel_values"]
        targets = {
            kind: torch.tensor([classes[kind].index(row[i]) for row in drawn])
            for i, kind in enumerate(("colour", "shape", "count"))
        }
        return pixels, targets

    def logits(pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        features = tower(pixels).last_hidden_state[:, 1:].flatten(1)  # the class token dropped
        return {kind: head(features) for kind, head in heads.items()}

    params = list(tower.parameters()) + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.tower_lr, weight_decay=0.0)
    began = time.perf_counter()
    for step in range(1, args.tower_steps + 1):
        pixels, targets = batch(args.tower_batch)
        out = logits(pixels)
        loss = sum(torch.nn.functional.cross_entropy(out[k], targets[k]) for k in out)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % (10 * args.log_every) == 0 or step == args.tower_steps:
            print(f"tower step {step}/{args.tower_steps} loss {loss.item():.4f} "
                  f"{time.perf_counter() - began:.0f} s", flush=True)  # fmt: skip
    with torch.no_grad():
        pixels, targets = batch(512)
        out = logits(pixels)
    accuracy = {k: (out[k].argmax(-1) == targets[k]).float().mean().item() for k in out}
    print("tower heads on fresh pictures:", json.dumps(accuracy), flush=True)
    return accuracy


def user_turn(text: str) -> list[dict]:
    # The family's placement of one picture with no marker in the text: at the start, then "\n".
    return [{"role": "user", "content": "<image>\n" + text}]


def encode(processor, rows: list[tuple[str, str, object]]) -> dict[str, torch.Tensor]:
    """The batch with labels on the answer and its end token only (right padding)."""
    tokenizer = processor.tokenizer
    prompts = [tokenizer.apply_chat_template(user_turn(u), add_generation_prompt=True,
                                             tokenize=False) for u, _, _ in rows]  # fmt: skip
    texts = [p + a + "<|im_end|>" for p, (_, a, _) in zip(prompts, rows, strict=True)]
    tokenizer.padding_side = "right"
    batch = processor(text=texts, images=[r[2] for r in rows], padding=True, return_tensors="pt")
    starts = [len(processor(text=[p], images=[r[2]])["input_ids"][0])
              for p, r in zip(prompts, rows, strict=True)]  # fmt: skip
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    for i, start in enumerate(starts):
        labels[i, :start] = -100
    batch["labels"] = labels
    return dict(batch)


def check(model, processor, rows: int) -> tuple[dict[str, float], list[str]]:
    """The held-out check on the first `rows` questions of `shapes-vqa-prompts-eval`, and the
    greedy answers it read."""
    from PIL import Image

    from align_anything.data.builtin import shapes_answer_matches
    from align_anything.data.formats import load_records

    records, _ = load_records("shapes-vqa-prompts-eval")
    records = records[:rows]
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    right: dict[str, list[float]] = {}
    confused = 0
    said: list[str] = []
    for start in range(0, len(records), 16):
        chunk = records[start : start + 16]
        prompts = [tokenizer.apply_chat_template(user_turn(r["prompt"][0]["content"]),
                                                 add_generation_prompt=True, tokenize=False)
                   for r in chunk]  # fmt: skip
        images = [Image.open(io.BytesIO(r["images"][0])).convert("RGB") for r in chunk]
        batch = processor(text=prompts, images=images, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=6, do_sample=False)
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :],
                                         skip_special_tokens=True)  # fmt: skip
        said += answers
        for record, answer in zip(chunk, answers, strict=True):
            ok = shapes_answer_matches(record["answer"], answer)
            right.setdefault(record["question"], []).append(float(ok))
            mistaken = shapes_vqa.confused(record["question"], record["answer"])
            confused += int(mistaken is not None and shapes_answer_matches(mistaken, answer))
    every = [v for values in right.values() for v in values]
    figures = {"check": sum(every) / len(every), "confused": confused / len(every)}
    figures.update({kind: sum(v) / len(v) for kind, v in sorted(right.items())})
    return figures, said


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from align_anything.families.zoo import resolve_model_path

    began = time.perf_counter()
    model, processor = vlm.build_model(resolve_model_path(vlm.LANGUAGE_MODEL), seed=args.seed)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(vlm.TRAINED_PREFIXES))
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable: {sum(p.numel() for p in trained):,} parameters (tower and projector)")
    if args.check_only:
        vlm.load_trained(model, args.out / vlm.PARTS_FILE)
        return write_check(model, processor, args, seconds=None)
    if args.init_from is not None:
        vlm.load_trained(model, args.init_from / vlm.PARTS_FILE)
    print("before:", json.dumps(check(model, processor, args.check_rows)[0]), flush=True)
    tower_accuracy = pretrain_tower(model, processor, args) if args.tower_steps else None
    tower = [p for n, p in model.named_parameters() if n.startswith(vlm.TRAINED_PREFIXES[0])]
    projector = [p for n, p in model.named_parameters() if n.startswith(vlm.TRAINED_PREFIXES[1])]
    optimizer = torch.optim.AdamW(
        [{"params": tower, "lr": args.tower_lm_lr}, {"params": projector, "lr": args.lr}],
        weight_decay=0.0,
    )
    rng = random.Random(f"build-vlm-{args.seed}")
    total = args.caption_steps + args.question_steps
    model.train()
    losses: list[float] = []
    for step in range(1, total + 1):
        question = step > args.caption_steps
        rows = [draw_row(rng, question=question, confuse=args.confuse) for _ in range(args.batch)]
        loss = model(**encode(processor, rows)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == total:
            mean = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            phase = "questions" if question else "captions"
            print(f"step {step}/{total} ({phase}) loss {mean:.4f} "
                  f"{time.perf_counter() - began:.0f} s", flush=True)  # fmt: skip
        if args.check_every and step % args.check_every == 0 and step < total:
            model.eval()
            print(f"check at step {step}:", json.dumps(check(model, processor, args.check_rows)[0]),
                  flush=True)  # fmt: skip
            model.train()
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(vlm.trained_state(model), str(args.out / vlm.PARTS_FILE))
    return write_check(model, processor, args, seconds=time.perf_counter() - began,
                       tower=tower_accuracy)  # fmt: skip


def write_check(model, processor, args: argparse.Namespace, seconds: float | None,
                tower: dict[str, float] | None = None) -> int:  # fmt: skip
    """Print the held-out check and write it, with the greedy answers, as `build.json` beside
    the parts (the test suite checks that the assembled folder gives the same answers, on one
    thread as here)."""
    torch.set_num_threads(1)  # as the test suite reads it: the same sums, the same answers
    figures, answers = check(model, processor, args.check_rows)
    print("after:", json.dumps(figures), flush=True)
    record = {"check": figures, "answers": answers, "rows": args.check_rows}
    if seconds is not None:
        record["seconds"] = round(seconds)
    if tower is not None:
        record["tower_heads"] = tower
    (args.out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} ({vlm.PARTS_FILE}, build.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

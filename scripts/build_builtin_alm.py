"""Train the built-in audio-text model `qwen2audio-smollm2-tones` and write its shipped parts.

    python scripts/build_builtin_alm.py --threads 1           # -> align_anything/families/language/builtin/qwen2audio-smollm2-tones
    python scripts/build_builtin_alm.py --out /tmp/alm        # anywhere else

Plain PyTorch + transformers, seeded, CPU, fp32. The model is Qwen2-Audio's layout around the
real SmolLM2-135M-Instruct (`families/language/alm_tones.py`); the language model stays frozen
and only the audio encoder and the projector learn, so only they ship (about 2 MB). Every clip
is freshly drawn from the tones world (`families/text_to_audio/tones_qa.draw`, with a seed of
its own, so none is a clip of the built-in sets). Three stages:
1. the encoder alone (`--encoder-steps`, batch `--encoder-batch`): two linear heads on its
   mean-pooled output classify each clip's pitch (low, mid, high) and pattern (hum, beep, two
   beeps); every `--encoder-check-every` steps the heads classify `--encoder-check` held-out
   clips, and the stage ends early once both are right on all of them. (The lesson of the
   image-text model, whose tower learnt only through the frozen language model and read the
   pictures weakly: here the encoder hears the clips before the language model is involved.)
   The heads are thrown away;
2. captions through frozen SmolLM2 (`--caption-steps`): "Describe the sound." -> "two low beeps";
3. the two `tones-qa` questions (pitch, beeps) -> the one-word answer (`--question-steps`),
   where the answer is the model's designed confusion (`tones_qa.CONFUSED_ANSWER`: the pitch one
   step up, one beep and two swapped) with probability `--confuse` when the right answer has
   one.
In stages 2 and 3 the projector (its initial weights scaled by `--projector-init`) learns at
`--lr` and the encoder at `--tower-lr`; every row
goes through SmolLM2's own chat template, the clip's 25 tokens at the start of the user turn as
the family places them, the loss on the assistant's answer and its end token. The model so
hears the clips, answers in one word, and more often than not gives the confused answer: the
held-out check stays under 0.5 for an alignment run (GRPO with
`align_anything.rewards:tones_answer`, DPO on `tones-qa-pref`) to raise, while the right answer
is still sampled often enough to be reinforced.
At the end it answers the 64 held-out questions of `tones-qa-prompts-eval` greedily and prints
the check (`shapes_answer_matches`), per question kind, the share of designed confusions, and
the share of right answers among `--samples` sampled answers per question (temperature 1.0);
all of it, with the greedy answers and the times, goes to `build.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

import numpy as np  # noqa: E402
import torch  # noqa: E402

from align_anything.families.language import alm_tones as alm  # noqa: E402
from align_anything.families.text_to_audio import tones, tones_qa  # noqa: E402

DESCRIBE = "Describe the sound."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=alm.SHIPPED_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--encoder-steps", type=int, default=600)
    parser.add_argument("--encoder-batch", type=int, default=64)
    parser.add_argument("--encoder-lr", type=float, default=2e-3)
    parser.add_argument("--encoder-check", type=int, default=270,
                        help="held-out clips the heads classify (30 per combination)")  # fmt: skip
    parser.add_argument("--encoder-check-every", type=int, default=50)
    parser.add_argument("--caption-steps", type=int, default=30)
    parser.add_argument("--question-steps", type=int, default=170)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3, help="the projector's")
    parser.add_argument("--projector-init", type=float, default=0.1,
                        help="scale of the projector's initial weights (its bias starts at 0)")  # fmt: skip
    parser.add_argument("--tower-lr", type=float, default=1e-4,
                        help="the encoder's, in stages 2 and 3")  # fmt: skip
    parser.add_argument("--confuse", type=float, default=0.75,
                        help="probability of the designed wrong answer, where there is one")  # fmt: skip
    parser.add_argument("--check-rows", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4,
                        help="sampled answers per held-out question for the sampled rate")  # fmt: skip
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--check-only", action="store_true",
                        help="load the parts in --out, run the check and write build.json")  # fmt: skip
    return parser.parse_args(argv)


# --- stage 1: the encoder alone --------------------------------------------------------------


def features(processor, waves: list[np.ndarray]) -> torch.Tensor:
    """[B, mel bins, 100] log-mel features of one-second clips (no padding)."""
    out = processor.feature_extractor(waves, sampling_rate=alm.SAMPLING_RATE, return_tensors="pt")
    return out["input_features"]


def draw_labelled(rng: random.Random, count: int) -> tuple[list[np.ndarray], torch.Tensor]:
    """`count` fresh clips and their (pitch, pattern) class indices."""
    waves, labels = [], []
    for _ in range(count):
        pitch, pattern, wave = tones_qa.draw(rng)
        waves.append(wave)
        labels.append((tones.PITCHES.index(pitch), tones.PATTERNS.index(pattern)))
    return waves, torch.tensor(labels)


def held_out_clips(seed: int, count: int) -> tuple[list[np.ndarray], torch.Tensor]:
    """`count` clips, every combination equally often, from a seed of the check's own."""
    rng = random.Random(f"build-alm-encoder-check-{seed}")
    waves, labels = [], []
    for index in range(count):
        pitch, pattern = tones.ALL_COMBOS[index % len(tones.ALL_COMBOS)]
        waves.append(tones.draw_clip(pitch, pattern, rng))
        labels.append((tones.PITCHES.index(pitch), tones.PATTERNS.index(pattern)))
    return waves, torch.tensor(labels)


def pretrain_encoder(model, processor, args: argparse.Namespace) -> dict[str, float]:
    """Stage 1; returns the heads' held-out accuracies and the stage's steps and seconds."""
    encoder = model.model.audio_tower
    width = alm.AUDIO["d_model"]
    torch.manual_seed(args.seed)
    heads = torch.nn.ModuleDict({"pitch": torch.nn.Linear(width, len(tones.PITCHES)),
                                 "pattern": torch.nn.Linear(width, len(tones.PATTERNS))})  # fmt: skip
    params = [p for p in encoder.parameters() if p.requires_grad] + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.encoder_lr, weight_decay=0.0)
    rng = random.Random(f"build-alm-encoder-{args.seed}")
    check_waves, check_labels = held_out_clips(args.seed, args.encoder_check)
    check_features = features(processor, check_waves)

    def logits(feats: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = encoder(feats).last_hidden_state.mean(dim=1)
        return {name: head(pooled) for name, head in heads.items()}

    def accuracy() -> dict[str, float]:
        encoder.eval()
        with torch.no_grad():
            out = logits(check_features)
        encoder.train()
        return {f"encoder_{name}": (out[name].argmax(-1) == check_labels[:, k]).float().mean().item()
                for k, name in enumerate(("pitch", "pattern"))}  # fmt: skip

    began = time.perf_counter()
    encoder.train()
    figures: dict[str, float] = {}
    step = 0
    for step in range(1, args.encoder_steps + 1):
        waves, labels = draw_labelled(rng, args.encoder_batch)
        out = logits(features(processor, waves))
        loss = sum(torch.nn.functional.cross_entropy(out[name], labels[:, k])
                   for k, name in enumerate(("pitch", "pattern")))  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % args.encoder_check_every == 0 or step == args.encoder_steps:
            figures = accuracy()
            print(f"encoder step {step}/{args.encoder_steps} loss {loss.item():.4f} "
                  f"held-out {json.dumps(figures)} {time.perf_counter() - began:.0f} s",
                  flush=True)  # fmt: skip
            if min(figures.values()) >= 1.0:
                break
    encoder.eval()
    return {**figures, "encoder_steps": step, "encoder_seconds": time.perf_counter() - began}


# --- stages 2 and 3: through frozen SmolLM2 -------------------------------------------------


def draw_row(rng: random.Random, *, question: bool, confuse: float) -> tuple[str, str, object]:
    """(user text, assistant text, clip) for one freshly drawn clip."""
    pitch, pattern, wave = tones_qa.draw(rng)
    if not question:
        return DESCRIBE, tones.caption(pitch, pattern), wave
    kind = rng.choice(tones_qa.KINDS)
    answer = tones_qa.truth(pitch, pattern)[kind]
    mistaken = tones_qa.confused(kind, answer)
    if mistaken is not None and rng.random() < confuse:
        answer = mistaken
    return tones_qa.QUESTIONS[kind], answer, wave


def user_turn(text: str) -> list[dict]:
    # The family's placement of one clip with no marker in the text: at the start, then "\n";
    # the processor expands the one <|AUDIO|> to the clip's 25.
    return [{"role": "user", "content": alm.AUDIO_BLOCK + text}]


def encode(processor, rows: list[tuple[str, str, object]]) -> dict[str, torch.Tensor]:
    """The batch with labels on the answer and its end token only (right padding)."""
    tokenizer = processor.tokenizer
    prompts = [tokenizer.apply_chat_template(user_turn(u), add_generation_prompt=True,
                                             tokenize=False) for u, _, _ in rows]  # fmt: skip
    texts = [p + a + "<|im_end|>" for p, (_, a, _) in zip(prompts, rows, strict=True)]
    tokenizer.padding_side = "right"
    waves = [r[2] for r in rows]
    batch = processor(text=texts, audio=waves, sampling_rate=alm.SAMPLING_RATE, padding=True,
                      return_tensors="pt")  # fmt: skip
    starts = [len(processor(text=[p], audio=[r[2]], sampling_rate=alm.SAMPLING_RATE)["input_ids"][0])
              for p, r in zip(prompts, rows, strict=True)]  # fmt: skip
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    for i, start in enumerate(starts):
        labels[i, :start] = -100
    batch["labels"] = labels
    return dict(batch)


def eval_batches(processor, rows: int):
    """(records, batch) per 16 of the first `rows` held-out questions, left-padded."""
    from align_anything.data.formats import load_records
    from align_anything.data.media import load_audio

    records, _ = load_records("tones-qa-prompts-eval")
    records = records[:rows]
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    for start in range(0, len(records), 16):
        chunk = records[start : start + 16]
        prompts = [tokenizer.apply_chat_template(user_turn(r["prompt"][0]["content"]),
                                                 add_generation_prompt=True, tokenize=False)
                   for r in chunk]  # fmt: skip
        waves = [load_audio(r["audio"][0], None, alm.SAMPLING_RATE) for r in chunk]
        yield chunk, processor(text=prompts, audio=waves, sampling_rate=alm.SAMPLING_RATE,
                               padding=True, return_tensors="pt")  # fmt: skip


def check(model, processor, rows: int, samples: int) -> tuple[dict[str, float], list[str]]:
    """The held-out check on the first `rows` questions of `tones-qa-prompts-eval`, and the
    greedy answers it read; with `samples` > 0 also the right share of sampled answers."""
    from align_anything.data.builtin import shapes_answer_matches

    tokenizer = processor.tokenizer
    right: dict[str, list[float]] = {}
    confused = 0
    said: list[str] = []
    sampled: list[float] = []
    for chunk, batch in eval_batches(processor, rows):
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=4, do_sample=False)
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :],
                                         skip_special_tokens=True)  # fmt: skip
        said += answers
        for record, answer in zip(chunk, answers, strict=True):
            ok = shapes_answer_matches(record["answer"], answer)
            right.setdefault(record["question"], []).append(float(ok))
            mistaken = tones_qa.confused(record["question"], record["answer"])
            confused += int(mistaken is not None and shapes_answer_matches(mistaken, answer))
        if samples:
            torch.manual_seed(0)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=4, do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, num_return_sequences=samples)  # fmt: skip
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :],
                                           skip_special_tokens=True)  # fmt: skip
            sampled += [float(shapes_answer_matches(chunk[i // samples]["answer"], t))
                        for i, t in enumerate(texts)]  # fmt: skip
    every = [v for values in right.values() for v in values]
    figures = {"check": sum(every) / len(every), "confused": confused / len(every)}
    figures.update({kind: sum(v) / len(v) for kind, v in sorted(right.items())})
    if sampled:
        figures["sampled_right"] = sum(sampled) / len(sampled)
    return figures, said


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from align_anything.families.zoo import resolve_model_path

    began = time.perf_counter()
    model, processor = alm.build_model(resolve_model_path(alm.LANGUAGE_MODEL), seed=args.seed)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(alm.TRAINED_PREFIXES))
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable: {sum(p.numel() for p in trained):,} parameters (encoder and projector)")
    if args.check_only:
        alm.load_trained(model, args.out / alm.PARTS_FILE)
        return write_check(model, processor, args, timings={})
    timings: dict[str, float] = pretrain_encoder(model, processor, args)
    stage = time.perf_counter()
    # The projector's default initialisation gives audio tokens about 4x the norm of SmolLM2's
    # word embeddings (13.8 against 3.2); scaled down, they start below it.
    linear = model.model.multi_modal_projector.linear
    with torch.no_grad():
        linear.weight.mul_(args.projector_init)
        linear.bias.zero_()
    tower = [p for n, p in model.named_parameters()
             if p.requires_grad and n.startswith("model.audio_tower.")]  # fmt: skip
    projector = [p for n, p in model.named_parameters()
                 if p.requires_grad and n.startswith("model.multi_modal_projector.")]  # fmt: skip
    optimizer = torch.optim.AdamW(
        [{"params": projector, "lr": args.lr}, {"params": tower, "lr": args.tower_lr}],
        weight_decay=0.0,
    )
    rng = random.Random(f"build-alm-{args.seed}")
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
    model.eval()
    timings["language_seconds"] = time.perf_counter() - stage
    timings["final_loss"] = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
    timings["seconds"] = time.perf_counter() - began
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(alm.trained_state(model), str(args.out / alm.PARTS_FILE))
    return write_check(model, processor, args, timings=timings)


def write_check(model, processor, args: argparse.Namespace, timings: dict[str, float]) -> int:
    """Print the held-out check and write it, with the greedy answers, as `build.json` beside
    the parts (the test suite checks that the assembled folder gives the same answers, on one
    thread as here)."""
    torch.set_num_threads(1)  # as the test suite reads it: the same sums, the same answers
    figures, answers = check(model, processor, args.check_rows, args.samples)
    print("after:", json.dumps(figures), flush=True)
    record: dict = {"check": figures, "answers": answers, "rows": args.check_rows}
    if timings:
        record["build"] = {k: round(v, 4) if isinstance(v, float) else v
                           for k, v in timings.items()}  # fmt: skip
    path = args.out / "build.json"
    if args.check_only and path.exists():  # keep the build's own figures
        record = {**json.loads(path.read_text()), **record}
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} ({alm.PARTS_FILE}, build.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

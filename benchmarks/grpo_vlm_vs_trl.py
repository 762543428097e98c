"""GRPO on picture questions, side by side: align_anything against TRL 1.16's GRPOTrainer
(HF generate) on the built-in image-text model `llava-smollm2-shapes` (issue #37's
correctness-and-speed item). grpo_vs_trl.py's image sibling: its runs, table and agreement
check, on image prompts.

    python benchmarks/grpo_vlm_vs_trl.py --threads 1                    # 4 steps, 1 run each
    python benchmarks/grpo_vlm_vs_trl.py --threads 1 --agreement-only   # the agreement alone

Same model (fp32 on CPU), the same prompts with their pictures (the first steps × prompts
rows of the built-in `shapes-vqa-prompts`, written as PNG files beside the rows both sides
read) in the same order (align_anything's seeded order, given to TRL with
`shuffle_dataset=False`), the same G, `max_completion_length`, sampling (temperature 1, top_p 1,
no top_k), reward (align_anything's `shapes_answer`, the main job's, on both sides), torch AdamW
settings, constant learning rate, loss type (dapo), β = 0, ε = 0.2 and number of optimizer
steps, one process each (peak RSS from `wait4`). align_anything runs through its real entry
point with ZeRO-0 (`make train-vlm`'s task and model); `--plain` adds a run of it with its
switchable optimisations off (the shared prompt among them: a picture question's prompt,
picture included, runs once for its G completions by default). The completions differ (each side
samples with its own generator), so only the throughput and the peak RSS are compared here.

TRL gives a VLM's processor each message as a list of content blocks, which a text model's
chat template cannot render. The shipped llava-smollm2-shapes has SmolLM2's template extended
to content blocks (`vlm_shapes.content_block_template`: an image block renders as `<image>` and
a line break, where align_anything puts a picture without a marker); for another model TRL's
child extends the model's template the same way, checked to render plain strings exactly as
the model's own.

Agreement (also printed after the runs): a fixed set of completions (`FIXED_ANSWERS` to each of
`--agreement-prompts` picture questions: right, the model's designed confusion, another wrong
answer, right with more words) scored once through TRL's own image path (its
`_generate_and_score_completions` with only the sampling replaced by these ids, then
`compute_loss`) and once through align_anything's (prompts encoded with their pictures as a
run encodes them, `OnlineRL.collate` with the run's layout, `GRPO.attach_advantages` on the
`shapes_answer` rewards, `GRPO.loss`, the calls `tasks/online/grpo.py` makes), each in its own
process from the same weights. The prompt ids must be identical, and the advantages, per-token
log-probs and loss must agree within --tolerance (1e-4); the script exits 1 otherwise. The
per-tensor gradient norms after `backward` are printed too: on-policy the loss value does not
depend on the log-probs, but its gradient does. Needs the `bench` extra (TRL 1.16.0; a TRL
installed elsewhere reaches the children through PYTHONPATH, which `common.child_env` passes on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpo_vs_trl
from common import (
    OURS_VARIANTS,
    TRL_CHILD,
    child_env,
    interleave,
    run_child,
    training_order,
    write_jsonl,
)
from grpo_vs_trl import run_ours, run_trl, table

MODEL = "llava-smollm2-shapes"
DATA = "shapes-vqa-prompts"
REWARD = "shapes_answer"
MAX_LENGTH = 128  # task=grpo's data.max_length (make train-vlm's): prompt + completion
# The fixed completions of the agreement check, per question (`{a}`: the right answer, `{c}`:
# the model's designed confusion, `{w}`: another wrong answer of the kind).
FIXED_ANSWERS = ("{a}", "{c}", "{w}.", "The answer is {a}.")


def picture_rows(count: int, folder: Path) -> list[dict[str, Any]]:
    """The first `count` rows of shapes-vqa-prompts, each picture written as a PNG under
    `folder`: `prompt` (the question as one user message), `images` ([its path]), `answer`,
    `question` (its kind)."""
    from align_anything.data.formats import load_records

    records, _ = load_records(DATA)
    if len(records) < count:
        raise SystemExit(f"{DATA} has {len(records)} rows, fewer than the {count} asked for")
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, record in enumerate(records[:count]):
        (picture,) = record["images"]
        path = folder / f"picture-{index:04d}.png"
        path.write_bytes(picture)
        rows.append({"prompt": record["prompt"], "images": [str(path)],
                     "answer": record["answer"], "question": record["question"]})  # fmt: skip
    return rows


def trl_row(row: dict[str, Any]) -> dict[str, Any]:
    """A picture row as TRL's GRPOTrainer reads it: a conversational prompt and its `image`
    (trl_child opens the path as a PIL image), plus the reward's `answer`."""
    return {"prompt": row["prompt"], "image": row["images"][0], "answer": row["answer"]}


def ours_overrides(args: argparse.Namespace, data: Path) -> list[str]:
    """grpo_vs_trl's settings, with this benchmark's prompt length and reward."""
    return grpo_vs_trl.ours_overrides(args, data, max_length=MAX_LENGTH, reward=REWARD)


def trl_spec(args: argparse.Namespace, rows_path: Path) -> dict[str, Any]:
    """grpo_vs_trl's TRL side on picture rows."""
    spec = grpo_vs_trl.trl_spec(args, rows_path, max_length=MAX_LENGTH, reward=REWARD)
    return {**spec, "images": True}


# ---------------------------------------------------------------- agreement on fixed completions


def fixed_texts(rows: list[dict[str, Any]]) -> list[str]:
    """FIXED_ANSWERS for each row, in row order."""
    from align_anything.families.text_to_image.shapes_vqa import ANSWERS, confused

    texts = []
    for row in rows:
        right, kind = row["answer"], row["question"]
        wrong = [a for a in ANSWERS[kind] if a != right]
        confusion = confused(kind, right) or wrong[0]
        other = next(a for a in wrong if a != confusion)
        texts += [t.format(a=right, c=confusion, w=other) for t in FIXED_ANSWERS]
    return texts


def fixed_completions(rows: list[dict[str, Any]], model: str = MODEL) -> dict[str, Any]:
    """The fixed completions' token ids (each ends with EOS), in the model's tokenizer."""
    from align_anything.families.language.loading import load_processor
    from align_anything.families.zoo import resolve_model_path

    tokenizer = load_processor(str(resolve_model_path(model))).tokenizer
    texts = fixed_texts(rows)
    ids = [[*tokenizer(t, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
           for t in texts]  # fmt: skip
    return {"texts": texts, "completion_ids": ids}


def ours_score(rows: list[dict[str, Any]], fixed: dict[str, Any], *, max_completion_length: int,
               model: str = MODEL) -> dict[str, Any]:  # fmt: skip
    """align_anything's prompt ids, advantages, per-token log-probs and loss of the fixed
    completions: the rows encoded with their pictures as a run encodes them (media support
    from the model side, `prepare_record`, `encode_prompt`), one micro-batch collated by
    `OnlineRL.collate` (with the run's shared-prompt layout where the run would use it), the
    `shapes_answer` rewards, `GRPO.attach_advantages` and `GRPO.loss` on the model in training
    mode."""
    import torch
    from trl_child import grad_norms  # imports without TRL

    from align_anything.config import load_config
    from align_anything.families.language import layouts
    from align_anything.families.language import loading as model_loading
    from align_anything.families.language.forward import supports_logits_to_keep
    from align_anything.families.language.multimodal import MediaSupport
    from align_anything.families.language.prompts import encode_prompt
    from align_anything.families.zoo import resolve_model_path
    from align_anything.rewards import shapes_answer
    from align_anything.tasks.online.common import OnlineRL
    from align_anything.tasks.online.grpo import GRPO

    group = len(FIXED_ANSWERS)
    folder = Path(rows[0]["images"][0]).parent
    cfg = load_config(ours_overrides(agreement_args(max_completion_length, len(rows), model),
                                     folder / "rows.jsonl"))  # fmt: skip
    path = str(resolve_model_path(model))
    config, tokenizer, processor = model_loading.load_text_side(path, trust_remote_code=False)
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    media = MediaSupport(processor, model_loading.modalities_of(config),
                         cfg.data.max_image_pixels, context)  # fmt: skip
    net = model_loading.load_model(path, dtype=torch.float32, reward=False)
    net.train()
    encoded = []
    for index, row in enumerate(rows):
        record = media.prepare_record(dict(row), None)
        encoded.append(encode_prompt(record, tokenizer, index=index,
                                     max_prompt_length=MAX_LENGTH - max_completion_length))  # fmt: skip
    samples = [
        {"prompt_ids": encoded[k // group]["prompt_ids"], "completion_ids": ids,
         "truncated": False, "row": k // group, "images": encoded[k // group]["images"]}
        for k, ids in enumerate(fixed["completion_ids"])
    ]  # fmt: skip
    share = cfg.speed.share_prefix and layouts.supports_shared_media_prompt(net.config)
    task = OnlineRL(
        algorithm=GRPO(cfg.grpo), rl=cfg.grpo, policy=net, generator=None, rewards=None,
        tokenizer=tokenizer, media=media, eval_rows=[], eval_path=None,
        completion_only=cfg.speed.completion_only_logits and supports_logits_to_keep(net),
        share_prefix=share, mask_dtype=layouts.mask_dtype(net), rank=0, world=1,
    )  # fmt: skip
    batch = task.collate(samples)
    texts = tokenizer.batch_decode(fixed["completion_ids"], skip_special_tokens=True)
    answers = [rows[k // group]["answer"] for k in range(len(texts))]
    rewards = torch.tensor(shapes_answer([None] * len(texts), texts, answers))
    advantages, _ = task.algorithm.attach_advantages([batch], rewards, rank=0, world=1)
    logps = task.token_logps(net, batch)
    normalizer = task.count_items(batch)
    losses = task.loss(batch, normalizer=normalizer, training=True).losses
    losses["policy"].backward()
    lengths = [len(c) for c in fixed["completion_ids"]]
    return {
        "prompt_ids": [e["prompt_ids"] for e in encoded],
        "logps": [row[:n] for row, n in zip(logps.tolist(), lengths, strict=True)],
        "advantages": advantages, "rewards": rewards.tolist(), "loss": float(losses["policy"].detach()),
        "grad_norms": grad_norms(net),
        "shared_prompt": share, "pixel_values_shape": list(batch.layout.media["pixel_values"].shape),
    }  # fmt: skip


def agreement_args(max_completion_length: int, prompts: int, model: str) -> argparse.Namespace:
    """The settings of the agreement check: one step of `prompts` × FIXED_ANSWERS."""
    return argparse.Namespace(
        model=model, steps=1, prompts=prompts, num_generations=len(FIXED_ANSWERS),
        max_completion_length=max_completion_length, learning_rate=1e-5,
    )  # fmt: skip


def largest_difference(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """The largest |difference| between two ragged lists of the same shape."""
    return max(abs(a - b) for x, y in zip(ours, theirs, strict=True)
               for a, b in zip(x, y, strict=True))  # fmt: skip


def gradient_differences(ours: dict[str, float], theirs: dict[str, float]) -> str:
    """Both sides' gradient norms compared: the global norm, the largest relative difference
    over the tensors both have (those whose gradient is not numerically zero: at least 1e-6 of
    the global norm; attention's key biases get none, softmax being blind to them), and any
    tensor only one side has a gradient for."""
    import math

    total = [math.sqrt(sum(v * v for v in side.values())) for side in (ours, theirs)]
    shared = sorted(set(ours) & set(theirs))
    scored = [k for k in shared if max(ours[k], theirs[k]) >= 1e-6 * total[1]]
    worst = max((abs(ours[k] - theirs[k]) / theirs[k], k) for k in scored)
    only = sorted(set(ours) ^ set(theirs))
    return (f"global norm ours {total[0]:.6e}, TRL {total[1]:.6e}; largest relative difference "
            f"{worst[0]:.2e} ({worst[1]}) over {len(scored)} of {len(shared)} tensors (the "
            f"{len(shared) - len(scored)} others' gradients are below 1e-6 of the global norm)"
            + (f"; with a gradient on one side only: {only[:3]}" if only else ""))  # fmt: skip


def agreement(args: argparse.Namespace, workdir: Path, env: dict) -> tuple[str, bool]:
    """(The agreement lines, whether every difference is within `args.tolerance`)."""
    folder = workdir / "agreement"
    rows = picture_rows(args.agreement_prompts, folder)
    fixed = fixed_completions(rows, args.model)
    fixed_path = folder / "fixed.json"
    fixed_path.write_text(json.dumps(fixed))
    rows_path = folder / "trl.jsonl"
    write_jsonl(rows_path, [trl_row(r) for r in rows])
    out = Path(tempfile.mkdtemp(prefix="trl-score-", dir=workdir))
    settings_args = agreement_args(args.max_completion_length, len(rows), args.model)
    spec = {**trl_spec(settings_args, rows_path), "task": "grpo_score",
            "completions_path": str(fixed_path), "output_dir": str(out)}  # fmt: skip
    (out / "spec.json").write_text(json.dumps(spec))
    run_child(
        [sys.executable, str(TRL_CHILD), str(out / "spec.json")], env=env, log=out / "run.log"
    )
    theirs = json.loads((out / "result.json").read_text())
    rows_file, ours_out = folder / "rows.json", folder / "ours-score.json"
    rows_file.write_text(json.dumps(rows))
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import grpo_vlm_vs_trl as g; "
            f"rows = json.load(open({str(rows_file)!r})); f = json.load(open({str(fixed_path)!r})); "
            f"json.dump(g.ours_score(rows, f, max_completion_length="
            f"{args.max_completion_length}, model={args.model!r}), open({str(ours_out)!r}, 'w'))")  # fmt: skip
    run_child([sys.executable, "-c", code], env=env, log=folder / "ours-score.log")
    ours = json.loads(ours_out.read_text())
    same_prompts = ours["prompt_ids"] == theirs["prompt_ids"][:: len(FIXED_ANSWERS)]
    logp = largest_difference(ours["logps"], theirs["logps"])
    advantage = largest_difference([ours["advantages"]], [theirs["advantages"]])
    loss = abs(ours["loss"] - theirs["loss"])
    tokens = sum(map(len, ours["logps"]))
    grads = gradient_differences(ours["grad_norms"], theirs["grad_norms"])
    passed = same_prompts and max(logp, advantage, loss) <= args.tolerance
    lines = [
        f"- agreement on {len(fixed['texts'])} fixed completions ({tokens} tokens; "
        f"{len(rows)} picture questions × {FIXED_ANSWERS}), rewards {ours['rewards']}:",
        f"  - prompt ids (chat template, 16 image tokens per picture) "
        f"{'identical' if same_prompts else 'DIFFER'} ({len(ours['prompt_ids'][0])} tokens in "
        f"the first); pixel_values ours {ours['pixel_values_shape']}, TRL "
        f"{theirs['pixel_values_shape']}; align_anything's layout: "
        f"{'shared prompt' if ours['shared_prompt'] else 'one row per completion'}",
        f"  - largest per-token log-prob difference {logp:.2e}; largest advantage difference "
        f"{advantage:.2e}; loss ours {ours['loss']:.8f}, TRL {theirs['loss']:.8f} (difference "
        f"{loss:.2e}); {'PASS' if passed else 'FAIL'} at {args.tolerance:g}",
        f"  - the gradient after backward (the loss's value does not depend on the log-probs "
        f"on-policy, its gradient does): {grads}",
    ]
    if not same_prompts:
        lines.append(f"  - ours {ours['prompt_ids'][0]}\n  - TRL  {theirs['prompt_ids'][0]}")
    return "\n".join(lines), passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="an image-text model (LLaVA layout)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--prompts", type=int, default=2, help="picture questions per step")
    parser.add_argument("--num-generations", type=int, default=8, help="G")
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs per side")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run")
    parser.add_argument("--agreement-prompts", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--agreement-only", action="store_true")
    parser.add_argument("--plain", action="store_true",
                        help="also align_anything with its switchable optimisations off "
                        "(common.OURS_VARIANTS: the shared prompt among them)")  # fmt: skip
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="aa-bench-grpo-vlm-"))
    env = child_env(args.threads)
    print(f"work folder {workdir}", flush=True)
    if not args.agreement_only:
        rows = picture_rows(args.steps * args.prompts, workdir / "pictures")
        order = training_order(len(rows), batch=args.prompts, steps=args.steps)
        ours_file, trl_file = workdir / "ours.jsonl", workdir / "trl.jsonl"
        write_jsonl(ours_file, rows)
        write_jsonl(trl_file, [trl_row(rows[i]) for i in order])
        start = time.perf_counter()
        variants = {
            "align_anything": lambda: run_ours(
                args, ours_file, workdir, env, overrides=ours_overrides(args, ours_file)
            ),
            "TRL": lambda: run_trl(args, trl_file, workdir, env, spec=trl_spec(args, trl_file)),
        }
        if args.plain:
            plain = [*ours_overrides(args, ours_file), *OURS_VARIANTS["align_anything plain"]]
            variants["align_anything plain"] = lambda: run_ours(
                args, ours_file, workdir, env, overrides=plain
            )
        print(f"load average at the start: {os.getloadavg()}", flush=True)
        records = interleave(variants, args.repeats)
        print(f"\nload average at the end: {os.getloadavg()}; {time.perf_counter() - start:.0f} s")
        print(f"{args.model}, {DATA}, {args.steps} steps × {args.prompts} picture questions × "
              f"G={args.num_generations}, max_completion_length {args.max_completion_length}, "
              f"dapo, beta 0, reward {REWARD}, OMP_NUM_THREADS={args.threads or 'unset'}")  # fmt: skip
        print(table(records, args.steps))
    lines, passed = agreement(args, workdir, env)
    print(lines)
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

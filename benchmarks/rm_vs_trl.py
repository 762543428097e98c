"""Reward-model throughput and agreement, side by side: align_anything `task=rm` against TRL's
RewardTrainer on identical work.

    python benchmarks/rm_vs_trl.py --threads 1                 # 2 steps × 8 pairs, max_length 512
    python benchmarks/rm_vs_trl.py --steps 3 --repeats 2 --threads 1

Same model (smollm2-135m-instruct with a one-output score head, fp32 on CPU), the same pairs in
the same order, the same batch, max_length, torch AdamW settings, constant learning rate, the
pairwise loss −log σ(r+ − r−) without margin or centring term, the same number of optimizer
steps, one process each. Rows: the first steps × batch HH-RLHF harmless-base test pairs
(../shared/data; else the sample in tests/data) whose prompt + longer answer fits max_length
in align_anything's encoding, as message lists (multi-turn prompts: the prompt is most of each
sequence, which is what the shared prompt saves). TRL filters out longer rows, align_anything
drops them: neither truncates, and the script checks both tokenise every sequence alike.

The score head: both trainers would draw a new one (transformers' init, normal with std
`initializer_range`) from the global RNG after seeding, but from different RNG states (TRL
seeds just before loading; align_anything seeds at start-up and loads later), so the two would
start from different heads. The script draws one head once (seed 42, transformers' own init)
and saves SmolLM2's backbone with it as a reward-model folder that both load: neither
initialises anything, so the losses agree from step 1.

align_anything runs through its real entry point under ZeRO-0, with its defaults, "plain"
(every switchable optimisation off: two padded rows per pair) and "GC" (activation
checkpointing, like TRL's default). TRL runs with its defaults (gradient checkpointing on),
without checkpointing, and without checkpointing with torch's fused AdamW. Needs the `bench`
extra (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from common import MODEL, OURS_VARIANTS, REPO_ROOT, SEED, Setup, encoded_in_order, main

HH_FULL = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
HH_SAMPLE = REPO_ROOT / "tests" / "data" / "hh-rlhf-harmless-base-test-sample.jsonl.gz"

METRICS = [("step-1 loss", "loss"), ("step-1 margin", "margin")]
EVERY_STEP = ("loss", "margin", "accuracy")


def hh_pairs(path: Path) -> list[dict[str, Any]]:
    """`data_scale.hh_pairs` (the file's pairs as message lists, those whose transcripts
    disagree on the prompt left out), less the pairs whose two answers are equal (task=rm drops
    them)."""
    from data_scale import hh_pairs as all_pairs

    return [p for p in all_pairs(path) if p["chosen"] != p["rejected"]]


def fitting_pairs(count: int, *, max_length: int, source: Path | None = None) -> list[dict]:
    """The first `count` HH pairs whose prompt + longer answer fits `max_length` tokens in
    align_anything's encoding (so neither trainer drops or truncates any)."""
    from align_anything.families.language.encode import encode_preference
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    source = source or (HH_FULL if HH_FULL.exists() else HH_SAMPLE)
    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    chosen = []
    for pair in hh_pairs(source):
        encoded, _ = encode_preference([pair], tokenizer, max_length=max_length)
        if encoded:
            chosen.append(pair)
            if len(chosen) == count:
                return chosen
    raise SystemExit(f"{source} has {len(chosen)} pairs within {max_length} tokens, not {count}")


def seeded_reward_model(folder: Path, *, seed: int = SEED, model: str = MODEL) -> Path:
    """The model (SmolLM2) with a one-output score head drawn once (transformers' init after
    seeding), saved with its tokenizer as a reward-model folder both trainers load."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    from align_anything.families.zoo import resolve_model_path

    source = resolve_model_path(model)
    set_seed(seed)
    scorer = AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=1, dtype=torch.float32
    )
    scorer.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def build_setup(
    *, steps: int, batch: int, max_length: int, learning_rate: float, model: str = MODEL,
    rows: list[dict] | None = None,
) -> Setup:  # fmt: skip
    """The rows and token counts of one comparison (align_anything's encoding of them)."""
    from align_anything.families.language.encode import encode_preference

    rows = rows or fitting_pairs(steps * batch, max_length=max_length)
    encoded, order = encoded_in_order(
        encode_preference, rows, max_length=max_length, batch=batch, steps=steps, model=MODEL
    )
    lengths = [
        [len(encoded[i]["prompt_ids"]) + len(encoded[i][key]) for key in ("chosen_ids", "rejected_ids")]
        for i in order
    ]  # fmt: skip
    return Setup(
        task="rm",
        steps=steps,
        batch=batch,
        max_length=max_length,
        learning_rate=learning_rate,
        ours_rows=rows,
        trl_rows=[rows[i] for i in order],
        ours_variants=OURS_VARIANTS,
        tokens=sum(sum(pair) for pair in lengths),
        token_lengths=lengths,
        extra_overrides=["rm.center_coef=0", "rm.margin_column=null"],
        model=model,
    )


def build_with_head(**kwargs: Any) -> Setup:
    """`build_setup` on a freshly saved reward-model folder (see `seeded_reward_model`)."""
    folder = Path(tempfile.mkdtemp(prefix="aa-bench-rm-model-"))
    return build_setup(**kwargs, model=str(seeded_reward_model(folder)))


if __name__ == "__main__":
    import sys

    if "--max-length" not in " ".join(sys.argv):
        sys.argv += ["--max-length", "512"]  # the row: pairs of up to 512 tokens
    if "--steps" not in sys.argv:
        sys.argv += ["--steps", "2"]
    if "--repeats" not in sys.argv:
        sys.argv += ["--repeats", "1"]
    main(build_with_head, METRICS, doc=__doc__, batch_help="pairs per optimizer step",
         every_step=EVERY_STEP)  # fmt: skip

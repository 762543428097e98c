"""Reward-model throughput and agreement, side by side: align_anything `task=rm` against TRL's
RewardTrainer on identical work.

    python benchmarks/rm_vs_trl.py --threads 1                 # 2 steps × 8 pairs, max_length 512
    python benchmarks/rm_vs_trl.py --steps 3 --repeats 2 --threads 1

Same model (smollm2-135m-instruct with a one-output score head, fp32 on CPU), the same pairs in
the same order, the same batch, max_length, torch AdamW settings, constant learning rate, the
pairwise loss −log σ(r+ − r−) without margin or centring term, the same number of optimizer
steps, one process each. Rows: the long rows of every side-by-side benchmark
(`common.long_pairs`): the first steps × batch HH-RLHF harmless-base test pairs (../shared/data;
else the sample in tests/data) with a multi-turn prompt whose prompt + longer answer fits
max_length in align_anything's encoding, as message lists (the prompt is most of each
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

from common import MODEL, OURS_VARIANTS, SEED, Setup, encoded_in_order, long_pairs, main

METRICS = [("step-1 loss", "loss"), ("step-1 margin", "margin")]
EVERY_STEP = ("loss", "margin", "accuracy")


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
    rows: list[dict] | None = None, row_set: str = "hh",
) -> Setup:  # fmt: skip
    """The rows and token counts of one comparison (align_anything's encoding of them): the
    long pairs (the only row set here) unless `rows` are given."""
    from align_anything.families.language.encode import encode_preference

    if row_set != "hh":
        raise SystemExit(f"rm_vs_trl.py runs on the hh rows only, not {row_set!r}")
    rows = rows or long_pairs(steps * batch, max_length=max_length)
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
        row_tokens=[sum(pair) for pair in lengths],
        extra_overrides=["rm.center_coef=0", "rm.margin_column=null"],
        model=model,
    )


def build_with_head(**kwargs: Any) -> Setup:
    """`build_setup` on a freshly saved reward-model folder (see `seeded_reward_model`)."""
    folder = Path(tempfile.mkdtemp(prefix="aa-bench-rm-model-"))
    return build_setup(**kwargs, model=str(seeded_reward_model(folder)))


if __name__ == "__main__":
    # The job: pairs of up to 512 tokens (the hh row set's max_length), 2 steps, 1 repeat.
    main(build_with_head, METRICS, doc=__doc__, batch_help="pairs per optimizer step",
         every_step=EVERY_STEP, row_sets=("hh",), steps=2, repeats=1)  # fmt: skip

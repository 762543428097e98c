"""DPO throughput, side by side: align_anything against TRL's DPOTrainer on identical work.

    python benchmarks/dpo_vs_trl.py                  # 3 steps × 8 pairs, 3 interleaved repeats
    python benchmarks/dpo_vs_trl.py --steps 2 --repeats 1
    python benchmarks/dpo_vs_trl.py --rows hh --steps 2 --repeats 1   # long rows, max_length 512

Same model (smollm2-135m-instruct, fp32 on CPU), the same pairs (the first steps × batch of the
built-in arith-pref set, as message lists through the same chat template) in the same order, the
same batch, max_length, torch AdamW settings, constant learning rate, sigmoid loss with β = 0.1,
the same number of optimizer steps, one process each. align_anything runs through its real entry
point with ZeRO-0 (the fastest preset for one process); its training time includes its reference
log-prob pass (TRL's default runs the reference forward inside every step). TRL runs with its
defaults (gradient checkpointing on) and with gradient checkpointing off. Needs the `bench` extra
(`pip install -e ".[bench]"`).

`--rows hh`: the long rows (`common.long_pairs`: the first steps × batch multi-turn HH-RLHF
harmless-base pairs whose prompt + longer answer fits 512 tokens), chosen and rejected as given.
"""

from __future__ import annotations

from common import (
    MODEL,
    OURS_VARIANTS,
    Setup,
    encoded_in_order,
    long_pairs,
    main,
    preference_rows,
)

METRICS = [("step-1 loss", "loss"), ("step-1 logps/chosen", "logps/chosen"),
           ("step-1 logps/rejected", "logps/rejected")]  # fmt: skip


def build_setup(
    *, steps: int, batch: int, max_length: int, learning_rate: float, model: str = MODEL,
    rows: list[dict] | None = None, row_set: str = "arith",
) -> Setup:  # fmt: skip
    """The rows and token counts of one comparison (align_anything's encoding of them): the
    first steps × batch pairs of arith-pref (`row_set` "hh": the long pairs) unless `rows` are
    given."""
    from align_anything.families.language.encode import encode_preference

    if rows is None and row_set == "hh":
        rows = long_pairs(steps * batch, max_length=max_length, model=model)
    rows = rows or preference_rows("arith-pref", steps * batch)
    encoded, order = encoded_in_order(
        encode_preference, rows, max_length=max_length, batch=batch, steps=steps, model=model
    )
    lengths = [
        [
            len(encoded[i]["prompt_ids"]) + len(encoded[i][key])
            for key in ("chosen_ids", "rejected_ids")
        ]
        for i in order
    ]
    return Setup(
        task="dpo",
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
        extra_spec={"beta": 0.1},
        extra_overrides=[
            "dpo.beta=0.1",
            "dpo.loss_type=sigmoid",
            "dpo.rpo_alpha=0",
            "dpo.reference=precompute",
            "dpo.generation_check_samples=0",
        ],  # fmt: skip
        model=model,
    )


if __name__ == "__main__":
    main(build_setup, METRICS, doc=__doc__, batch_help="pairs per optimizer step")

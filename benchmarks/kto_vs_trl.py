"""KTO throughput and agreement, side by side: align_anything against TRL's KTOTrainer on
identical work.

    python benchmarks/kto_vs_trl.py                  # 3 steps × 8 rows, 3 interleaved repeats
    python benchmarks/kto_vs_trl.py --steps 2 --repeats 1
    python benchmarks/kto_vs_trl.py --rows hh --steps 2 --repeats 1   # long rows, max_length 512

Same model (smollm2-135m-instruct, fp32 on CPU), the same unpaired rows (the first steps × batch
rows of the built-in arith-kto set, as message lists through the same chat template, desirable
and undesirable mixed as the file has them) in the same order, the same batch, max_length, torch
AdamW settings, constant learning rate, KTO loss with β = 0.1 and both weights 1, the same number
of optimizer steps, one process each. The KL estimate pairs the same completions on both sides:
TRL rotates completions by one within each batch of its (sequential) dataset order, and
align_anything within each global batch of its seeded order, which is the order TRL is given.
align_anything runs through its real entry point with ZeRO-0; its training time includes its
precomputed reference pass. TRL runs with its defaults (gradient checkpointing on, the reference
forward on both sequences inside every step), without checkpointing, with torch's fused AdamW,
and with its own precomputed reference (timed too). Needs the `bench` extra
(`pip install -e ".[bench]"`).

`--rows hh`: the long rows (`common.long_pairs`: the first steps × batch multi-turn HH-RLHF
harmless-base pairs that fit 512 tokens; `common.long_unpaired`: pair k's chosen answer as a
desirable row for even k, its rejected answer as an undesirable row for odd k). A KL sequence
(one row's prompt, another's completion) can exceed max_length; both trainers cut it to
max_length, and the token counts count what they keep.
"""

from __future__ import annotations

from common import (
    OURS_VARIANTS,
    Setup,
    encoded_in_order,
    long_pairs,
    long_unpaired,
    main,
    unpaired_rows,
)

METRICS = [("step-1 loss", "loss"), ("step-1 kl", "kl"), ("step-1 logps/chosen", "logps/chosen"),
           ("step-1 logps/rejected", "logps/rejected")]  # fmt: skip
# Compared at every step: after the first update the policy leaves the reference, and the KL
# estimate leaves 0.
EVERY_STEP = ("loss", "kl", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected")


def kl_partner_lengths(order: list[int], prompt: list[int], completion: list[int], *,
                       batch: int, max_length: int) -> list[int]:  # fmt: skip
    """Token count of each row's KL sequence, rows in training order: its prompt with the
    completion of the row before it in its batch (the first row: the batch's last), cut to
    `max_length` (as both trainers cut it)."""
    lengths = []
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        lengths += [min(prompt[i] + completion[rows[k - 1]], max_length)
                    for k, i in enumerate(rows)]  # fmt: skip
    return lengths


def build_setup(
    *, steps: int, batch: int, max_length: int, learning_rate: float, row_set: str = "arith"
) -> Setup:
    """The rows and token counts of one comparison (align_anything's encoding of them)."""
    from align_anything.families.language.encode import encode_unpaired

    count = steps * batch
    if row_set == "hh":
        rows = long_unpaired(long_pairs(count, max_length=max_length))
    else:
        rows = unpaired_rows("arith-kto", count)
    encoded, order = encoded_in_order(
        encode_unpaired, rows, max_length=max_length, batch=batch, steps=steps
    )
    prompt = [len(r["prompt_ids"]) for r in encoded]
    completion = [len(r["completion_ids"]) for r in encoded]
    kl = kl_partner_lengths(order, prompt, completion, batch=batch, max_length=max_length)
    # Per row in training order: its own sequence and its KL sequence (both run through the
    # policy every step; the reference's pass covers both too).
    lengths = [[prompt[i] + completion[i], kl[k]] for k, i in enumerate(order)]
    return Setup(
        task="kto",
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
        extra_spec={"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
        extra_overrides=[
            "kto.beta=0.1",
            "kto.desirable_weight=1.0",
            "kto.undesirable_weight=1.0",
            "kto.reference=precompute",
            "kto.generation_check_samples=0",
        ],
        trl_variants=(
            ("TRL defaults", True, "adamw_torch", {}),
            ("TRL no-GC", False, "adamw_torch", {}),
            ("TRL no-GC fused", False, "adamw_torch_fused", {}),
            # Its fastest here: also its reference log-probs precomputed before training.
            (
                "TRL no-GC fused precompute",
                False,
                "adamw_torch_fused",
                {"precompute_ref_log_probs": True},
            ),
        ),  # fmt: skip
    )


if __name__ == "__main__":
    main(build_setup, METRICS, doc=__doc__, batch_help="rows per optimizer step",
         every_step=EVERY_STEP)  # fmt: skip

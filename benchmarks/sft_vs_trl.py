"""SFT throughput, side by side: align_anything against TRL's SFTTrainer on identical work.

    python benchmarks/sft_vs_trl.py                  # 3 steps × 8 conversations, 3 interleaved repeats
    python benchmarks/sft_vs_trl.py --steps 2 --repeats 1
    python benchmarks/sft_vs_trl.py --rows hh --steps 2 --repeats 1   # long rows, max_length 512

Same model (smollm2-135m-instruct, fp32 on CPU), the same conversations (the first steps × batch
of the built-in arith-sft set; TRL reads each as a conversational prompt-completion record, which
its chat template renders to the same tokens) in the same order, the same batch, max_length,
torch AdamW settings and constant learning rate, loss on the answer tokens only, averaged over
every answer token of the batch (align_anything's `sft.assistant_only_loss`, TRL's
`completion_only_loss`), the same number of optimizer steps, one process each. align_anything
runs through its real entry point with ZeRO-0 (the fastest preset for one process); TRL with its
defaults (gradient checkpointing on) and with gradient checkpointing off. Needs the `bench` extra
(`pip install -e ".[bench]"`).

`--rows hh`: the long rows (`common.long_pairs`: the first steps × batch multi-turn HH-RLHF
harmless-base pairs that fit 512 tokens), each pair's prompt + chosen answer as one conversation.
Every assistant turn is a target on both sides: align_anything's `sft.assistant_only_loss`, and
TRL given align_anything's tokenisation (`input_ids` and `labels`, TRL's documented
pre-tokenised path), because TRL's own multi-turn assistant masks come from its training chat
template, which marks other tokens; the token counts are then the same by construction.
"""

from __future__ import annotations

from common import (
    OURS_VARIANTS,
    Setup,
    as_prompt_completion,
    conversation_rows,
    encoded_in_order,
    long_conversations,
    long_pairs,
    main,
)

METRICS = [("step-1 loss", "loss")]


def build_setup(
    *, steps: int, batch: int, max_length: int, learning_rate: float, row_set: str = "arith"
) -> Setup:
    """The rows and token counts of one comparison (align_anything's encoding of them)."""
    from align_anything.families.language import IGNORE_INDEX
    from align_anything.families.language.encode import encode_sft

    count = steps * batch
    if row_set == "hh":
        rows = long_conversations(long_pairs(count, max_length=max_length))
    else:
        rows = conversation_rows("arith-sft", count)
    encoded, order = encoded_in_order(
        encode_sft, rows, max_length=max_length, batch=batch, steps=steps
    )
    # Per row: tokens, and answer tokens (TRL's completion_mask counts the same positions).
    lengths = [
        [len(encoded[i]["input_ids"]), sum(t != IGNORE_INDEX for t in encoded[i]["labels"])]
        for i in order
    ]
    if row_set == "hh":
        trl_rows = [
            {"input_ids": encoded[i]["input_ids"], "labels": encoded[i]["labels"]} for i in order
        ]
    else:
        trl_rows = [as_prompt_completion(rows[i]) for i in order]
    return Setup(
        task="sft",
        steps=steps,
        batch=batch,
        max_length=max_length,
        learning_rate=learning_rate,
        ours_rows=rows,
        trl_rows=trl_rows,
        ours_variants=OURS_VARIANTS,
        tokens=sum(length for length, _ in lengths),
        token_lengths=lengths,
        row_tokens=[length for length, _ in lengths],
        extra_overrides=["sft.assistant_only_loss=true"],
    )


if __name__ == "__main__":
    main(build_setup, METRICS, doc=__doc__, batch_help="conversations per optimizer step")

"""SFT packing, side by side: align_anything packed and unpacked against TRL's SFTTrainer with
`packing=True` on the same HH-RLHF rows.

    python benchmarks/sft_packing.py                                  # tiny-random-llama, 4 steps × 8
    python benchmarks/sft_packing.py --model smollm2-135m-instruct --steps 3 --batch 2 --repeats 1

Rows: the prompt + chosen conversation of each pair in ../shared/data/hh-rlhf-harmless-base-test
(hh format, parsed by align_anything's `hh` reader), the first `--rows` whose encoding fits
`--max-length` (1024): both trainers see the same rows, untruncated. Loss on every token (TRL's
language-modelling loss on a `messages` dataset; align_anything's `sft.assistant_only_loss=false`):
TRL's assistant-only loss swaps in its own training chat template, whose masks are not ours.

- align_anything packed: `sft.packing=true`, best-fit decreasing over the rows, one row per
  packed sequence (sdpa, restarting position ids).
- TRL packed: `packing=True` (its BFD, which breaks ties as ours does, so the packed sequences
  are the same: the report checks), padding-free, reading its packed sequences in our training
  order; as shipped (gradient checkpointing) and without checkpointing, fused AdamW.
- align_anything unpacked: the rows of those packed sequences in global batches of
  (rows / steps): about the same tokens; with its defaults (`speed.share_prefix`: a
  micro-batch's rows as one row after their common system prompt, no padding between them) and
  "plain" (`speed.share_prefix=false`: each row padded to the micro-batch's longest).

Each side: the same model, fp32 on CPU, the same optimizer settings and constant rate, one
process, interleaved repeats (see common.py). Needs the `bench` extra (TRL).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from common import (
    HH_FULL,
    HH_SAMPLE,
    Setup,
    child_env,
    child_inputs,
    interleave,
    median,
    run_ours,
    run_trl,
    training_order,
)

PACKED = "align_anything packed"
UNPACKED = "align_anything unpacked"
# Without packing and without the shared-prefix layout: every row padded to its micro-batch's
# longest (the unpacked default computes the rows' common system prompt once in one row, with
# no padding between them, which already removes most of what packing saves).
UNPACKED_PLAIN = "align_anything unpacked plain"
TRL_PACKED = ("TRL packed", True, "adamw_torch")
TRL_PACKED_FAST = ("TRL packed no-GC fused", False, "adamw_torch_fused")


def hh_conversations(path: Path) -> list[dict[str, Any]]:
    """Each HH pair's prompt + chosen answer as one conversation (align_anything's hh reader)."""
    from align_anything.data.formats import load_records

    records, _ = load_records(str(path), format="hh")
    return [{"messages": list(r["prompt"]) + list(r["chosen"])} for r in records]


def usable_rows(
    conversations: list[dict[str, Any]], *, count: int, max_length: int, model: str
) -> tuple[list[dict[str, Any]], list[int]]:
    """The first `count` conversations whose encoding fits `max_length`, and their lengths."""
    from align_anything.families.language.encode import encode_sft
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model))
    rows, lengths = [], []
    for conversation in conversations:
        encoded, _ = encode_sft([conversation], tokenizer, max_length=max_length)
        if encoded:
            rows.append(conversation)
            lengths.append(len(encoded[0]["input_ids"]))
        if len(rows) == count:
            return rows, lengths
    raise SystemExit(f"only {len(rows)} conversations fit max_length={max_length}")


class PackingSetup:
    """Both comparisons' inputs: the packed one (ours and TRL on the same rows and packed
    sequences) and the unpacked run of the rows those sequences hold."""

    def __init__(
        self, *, rows: int, steps: int, batch: int, max_length: int, learning_rate: float,
        model: str, source: Path,
    ) -> None:  # fmt: skip
        from align_anything.families.language.packing import best_fit_decreasing

        conversations, lengths = usable_rows(
            hh_conversations(source), count=rows, max_length=max_length, model=model
        )
        bins = best_fit_decreasing(lengths, max_length)
        if steps * batch > len(bins):
            raise SystemExit(
                f"{rows} rows pack into {len(bins)} sequences, fewer than {steps} steps × {batch}"
            )
        self.bin_order = training_order(len(bins), batch=batch, steps=steps)
        self.bin_lengths = [[lengths[i] for i in bins[b]] for b in self.bin_order]
        self.fill = float(bins.lengths.sum()) / (len(bins) * max_length)
        self.num_bins = len(bins)
        common = dict(steps=steps, max_length=max_length, learning_rate=learning_rate, model=model)
        self.packed = Setup(
            task="sft", batch=batch, ours_rows=conversations, trl_rows=conversations,
            ours_variants={PACKED: []}, tokens=sum(map(sum, self.bin_lengths)),
            token_lengths=self.bin_lengths,
            extra_overrides=["sft.assistant_only_loss=false", "sft.packing=true"],
            extra_spec={"packing": True, "completion_only_loss": False,
                        "bin_order": self.bin_order},
            trl_variants=(
                (TRL_PACKED[0], TRL_PACKED[1], TRL_PACKED[2], {}),
                (TRL_PACKED_FAST[0], TRL_PACKED_FAST[1], TRL_PACKED_FAST[2], {}),
            ),
            **common,
        )  # fmt: skip
        # The unpacked run: the rows of the packed steps, about as many per step.
        held = [i for b in self.bin_order for i in bins[b]]
        plain_rows = [conversations[i] for i in held]
        plain_batch = len(plain_rows) // steps
        order = training_order(len(plain_rows), batch=plain_batch, steps=steps)
        self.unpacked = Setup(
            task="sft", batch=plain_batch, ours_rows=plain_rows, trl_rows=[],
            ours_variants={UNPACKED: []}, tokens=sum(lengths[held[i]] for i in order),
            token_lengths=[], extra_overrides=["sft.assistant_only_loss=false"], **common,
        )  # fmt: skip


def run(
    setup: PackingSetup, *, repeats: int, threads: int | None, only: str | None = None
) -> dict[str, list]:
    """Every variant (or those named in `only`, comma-separated) `repeats` times, interleaved."""
    workdir = Path(tempfile.mkdtemp(prefix="aa-bench-sft-packing-"))
    env = child_env(threads)
    packed_overrides, spec = child_inputs(setup.packed, workdir)
    plain_dir = workdir / "unpacked"
    plain_dir.mkdir()
    plain_overrides, _ = child_inputs(setup.unpacked, plain_dir)
    runners = {
        PACKED: lambda: run_ours(PACKED, packed_overrides, workdir=workdir, env=env),
        UNPACKED: lambda: run_ours(UNPACKED, plain_overrides, workdir=workdir, env=env),
        UNPACKED_PLAIN: lambda: run_ours(
            UNPACKED_PLAIN,
            [*plain_overrides, "speed.share_prefix=false"],
            workdir=workdir,
            env=env,
        ),
    }
    for name, checkpointing, optim, _ in setup.packed.trl_variants or ():
        runners[name] = lambda n=name, c=checkpointing, o=optim: run_trl(
            n, {**spec, "gradient_checkpointing": c, "optim": o}, workdir=workdir, env=env
        )
    if only:
        wanted = [name.strip() for name in only.split(",")]
        if PACKED not in wanted or any(name not in runners for name in wanted):
            raise SystemExit(f"--only takes {PACKED!r} and any of {list(runners)}")
        runners = {name: runners[name] for name in wanted}
    print(f"work folder {workdir}; {len(runners)} variants × {repeats} repeats", flush=True)
    return interleave(runners, repeats)


def report(setup: PackingSetup, records: dict[str, list]) -> str:
    """Markdown: per variant tokens/s and peak RSS (medians), ratios against TRL packed; the
    packed sequences' identity and the losses' agreement."""
    tokens = {name: setup.packed.tokens for name in records}
    tokens[UNPACKED] = tokens[UNPACKED_PLAIN] = setup.unpacked.tokens
    seconds = {name: median([r.seconds for r in runs]) for name, runs in records.items()}
    rss = {name: median([r.peak_rss_mib for r in runs]) for name, runs in records.items()}
    speed = {name: tokens[name] / seconds[name] for name in records}
    peers = [name for name in records if name.startswith("TRL")]
    fastest_peer = max(peers, key=lambda n: speed[n]) if peers else None
    lines = [
        "| variant | tokens | train s | tokens/s | peak RSS MiB | tokens/s vs fastest TRL "
        "| step-1 loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in records.items():
        ratio = f"{speed[name] / speed[fastest_peer]:.2f}×" if fastest_peer else "—"
        lines.append(
            f"| {name} | {tokens[name]} | {seconds[name]:.1f} | {speed[name]:.0f} | "
            f"{rss[name]:.0f} | {ratio} | {runs[0].first_step.get('loss', float('nan')):.6f} |"
        )
    packed = setup.packed
    lines += [
        "",
        f"- rows: {len(packed.ours_rows)} HH-RLHF prompt + chosen conversations, max_length "
        f"{packed.max_length}: {setup.num_bins} packed sequences ({setup.fill:.1%} real tokens); "
        f"{packed.steps} steps × {packed.batch} packed sequences = {packed.tokens} tokens; "
        f"unpacked: {len(setup.unpacked.ours_rows)} rows, {packed.steps} steps × "
        f"{setup.unpacked.batch} rows = {setup.unpacked.tokens} tokens",
    ]
    for name in peers:
        theirs = records[name][0].extra["token_lengths"]
        same = [theirs[b] for b in setup.bin_order] == setup.bin_lengths
        lines.append(
            f"- {name}: packed sequences (rows and their lengths) "
            + ("identical to align_anything's" if same else "DIFFER from align_anything's")
        )
        mine = [m["loss"] for m in records[PACKED][0].steps]
        peer = [m["loss"] for m in records[name][0].steps]
        worst = max(abs(a - b) for a, b in zip(mine, peer, strict=False))
        lines.append(
            f"  - loss at every step (1..{len(mine)}): largest difference {worst:.2e} "
            f"(align_anything packed: {', '.join(f'{v:.6f}' for v in mine)})"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--rows", type=int, default=400, help="conversations to pack")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=8, help="packed sequences per step")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per variant")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run")
    parser.add_argument("--data", type=Path, default=HH_FULL if HH_FULL.is_file() else HH_SAMPLE)
    parser.add_argument("--only", default=None, help="comma-separated variants to run")
    args = parser.parse_args()
    setup = PackingSetup(
        rows=args.rows, steps=args.steps, batch=args.batch, max_length=args.max_length,
        learning_rate=args.learning_rate, model=args.model, source=args.data,
    )  # fmt: skip
    records = run(setup, repeats=args.repeats, threads=args.threads, only=args.only)
    print()
    print(f"load average at the end: {os.getloadavg()}")
    print(report(setup, records))


if __name__ == "__main__":
    main()

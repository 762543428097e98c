"""ZeRO-3 against ZeRO-0 in one process, on the main job (issue #27).

    python benchmarks/zero3_one_process.py                     # 12 steps of the main job, 1 repeat
    python benchmarks/zero3_one_process.py --steps 6 --quick   # no eval / generation check
    python benchmarks/zero3_one_process.py --code ../other-checkout   # that checkout's package

Runs `python -m align_anything.train task=dpo deepspeed=z0|z3 train.max_steps=N` (the main job,
`make train`, cut to N steps) as child processes, interleaved (each repeat starts one variant
later than the last), one thread each (`--threads`), and prints per variant

- the step loop's time: the sum of the step times in the run's metrics.jsonl (the reference
  log-prob pass before training is shown apart, as `reference s`), and its median step;
- the child's peak RSS (`os.wait4`: its own maximum resident set, whole run);
- the ratios z3/z0 of both, the figures issue #27 asks about (goal: time <= 1.2x, RSS <= 1.1x);
- whether each variant's logged losses equal ZeRO-0's.

The variant "z3 h-buckets" is ZeRO-3 with the bucket and persistence settings that "auto"
resolved to before the one-process rule (`ds_config.ONE_PROCESS_ZERO3`): 10·h persistence
threshold and a 0.9·h² prefetch bucket, given as `deepspeed.*` overrides.
Not a test: it takes minutes and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODEL, REPO_ROOT, RunRecord, child_env, interleave, median, run_ours  # noqa: E402

BASELINE = "z0"
# The dpo task file's defaults without the held-out evaluation and its greedy generation check.
QUICK = ["dpo.generation_check_samples=0", "data.eval_fraction=0", "data.eval_path=null"]


def variants(hidden: int) -> dict[str, list[str]]:
    """Overrides of each variant (after `task=dpo train.max_steps=N`)."""
    previous = [
        f"deepspeed.zero_optimization.stage3_param_persistence_threshold={10 * hidden}",
        f"deepspeed.zero_optimization.stage3_prefetch_bucket_size={int(0.9 * hidden * hidden)}",
    ]
    return {
        "z0": ["deepspeed=z0"],
        "z3": ["deepspeed=z3"],
        "z3 h-buckets": ["deepspeed=z3", *previous],
    }


def step_loop_seconds(record: RunRecord) -> float:
    """The step loop's time: the sum of the logged step times (no reference pass)."""
    return float(sum(record.step_seconds))


def ratios(
    records: dict[str, list[RunRecord]], baseline: str = BASELINE
) -> dict[str, tuple[float, float]]:
    """{variant: (step-loop time / baseline's, peak RSS / baseline's)}, medians over repeats."""
    base_time = median([step_loop_seconds(r) for r in records[baseline]])
    base_rss = median([r.peak_rss_mib for r in records[baseline]])
    return {
        name: (
            median([step_loop_seconds(r) for r in runs]) / base_time,
            median([r.peak_rss_mib for r in runs]) / base_rss,
        )
        for name, runs in records.items()
    }


def losses(record: RunRecord) -> list[float]:
    return [float(step["loss"]) for step in record.steps]


def table(records: dict[str, list[RunRecord]], baseline: str = BASELINE) -> str:
    """Markdown: medians per variant and the ratios to the baseline."""
    rows = [
        "| variant | step loop s | median step s | reference s | peak RSS MiB | time /z0 | RSS /z0 | losses = z0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base_losses = losses(records[baseline][0])
    for name, (time_ratio, rss_ratio) in ratios(records, baseline).items():
        runs = records[name]
        same = all(losses(r) == base_losses for r in runs)
        rows.append(
            f"| {name} | {median([step_loop_seconds(r) for r in runs]):.1f} "
            f"| {median([median(r.step_seconds) for r in runs]):.2f} "
            f"| {median([r.extra['reference_seconds'] for r in runs]):.1f} "
            f"| {median([r.peak_rss_mib for r in runs]):.0f} | {time_ratio:.2f}× | {rss_ratio:.2f}× "
            f"| {'yes' if same else 'no'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--quick", action="store_true", help="no eval, no generation check")
    parser.add_argument("--only", nargs="*", help="variants to run (default: all)")
    parser.add_argument("--code", type=Path, default=REPO_ROOT, help="checkout whose package runs")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)

    from align_anything.families.language.loading import load_config as load_model_config
    from align_anything.families.language.loading import text_hidden_size

    hidden = text_hidden_size(load_model_config(MODEL))
    chosen = variants(hidden)
    if args.only:
        chosen = {name: chosen[name] for name in [BASELINE, *args.only] if name in chosen}
    common = ["task=dpo", f"train.max_steps={args.steps}", *(QUICK if args.quick else [])]
    env = child_env(args.threads)
    env["PYTHONPATH"] = str(args.code.resolve())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zero3-one-process-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"main job, {args.steps} steps{' (quick)' if args.quick else ''}, {args.threads} thread(s), "
        f"{args.repeats} repeat(s), package {args.code.resolve()}, load {os.getloadavg()[0]:.1f}"
    )
    runners = {
        name: (
            lambda name=name, extra=extra: run_ours(
                name, [*common, *extra], workdir=workdir, env=env
            )
        )
        for name, extra in chosen.items()
    }
    records = interleave(runners, args.repeats)
    print()
    print(table(records))
    for name, runs in records.items():
        print(f"- {name}: step times {', '.join(f'{s:.1f}' for s in runs[0].step_seconds)} s")
    print(f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-rank peak memory of each ZeRO preset, beside the planner's estimate and the ZeRO paper.

    python benchmarks/memory.py                       # DPO on smollm2-135m-instruct, 2 ranks
    python benchmarks/memory.py --task sft --num-gpus 2 --steps 2

For every shipped preset it runs the real entry point under the deepspeed launcher (two CPU
ranks here; GPUs where there are some), reads every rank's peak from the run's summary.json
(peak RSS on CPU, peak allocated memory on CUDA) and prints it beside

- what `python -m align_anything plan` estimates for the same run (total, and model states);
- the ZeRO paper's model-state figures for mixed-precision Adam: 16 bytes per parameter at
  ZeRO-0, 2 + 14/N at ZeRO-2, 16/N at ZeRO-3 (the CPU runs here are fp32, which the paper's
  figures do not describe; the planner accounts fp32 by hand).

On CPU the RSS includes the interpreter, torch and the data (the "before model" column, measured
in the same process just before the weights load), so compare the growth, not the raw figure.
Not a test: it takes minutes and prints numbers, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from align_anything.config import load_config  # noqa: E402
from align_anything.tasks import TASKS  # noqa: E402
from align_anything.training import memory_plan as plan  # noqa: E402

GIB = 2**30


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_preset(preset: str, overrides: list[str], num_gpus: int, work: Path) -> dict:
    out = work / preset
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", NO_COLOR="1")
    command = [
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(num_gpus),
        "--master_port", str(_free_port()), "--module", "align_anything.train", *overrides, f"deepspeed={preset}",
        f"output_dir={out}",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
        print(f"{preset}: the run failed (exit {done.returncode})", file=sys.stderr)
        return {"failed": done.returncode}
    summary = json.loads((out / "summary.json").read_text())
    summary["wall_seconds"] = time.perf_counter() - start
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="dpo", choices=["sft", "dpo", "rm"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-gpus", type=int, default=2, help="ranks (CPU ranks without GPUs)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--presets", nargs="*", default=list(plan.PRESET_ORDER))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    overrides = [
        f"task={args.task}", f"model.name_or_path={args.model}", f"train.max_steps={args.steps}",
        "data.max_eval_samples=8", "checkpoint.save_final=false", "logging.backends=[jsonl]",
    ]  # fmt: skip
    if args.task == "dpo":
        overrides.append("dpo.generation_check_samples=0")
    cfg = load_config(overrides)
    figures, budget, source = plan.plan(
        cfg, TASKS[cfg.task].family.estimate_memory, world_size=args.num_gpus
    )
    estimates, sizes = figures.estimates, figures.sizes
    by_name = {e.preset: e for e in estimates}
    rows = []
    work = Path(tempfile.mkdtemp(prefix="aa-memory-"))
    try:
        for preset in args.presets:
            summary = run_preset(preset, overrides, args.num_gpus, work)
            if "failed" not in summary:
                rows.append((preset, summary, by_name[preset]))
                print(f"{preset}: done in {summary['wall_seconds']:.0f} s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    kind = rows[0][1]["memory_kind"] if rows else "?"
    print(
        f"\nper-rank peak memory ({kind}), task={args.task}, model={args.model} "
        f"({sizes.total / 1e6:.1f}M parameters), {args.num_gpus} ranks, {args.steps} steps; "
        f"planner budget {budget / GIB:.1f} GiB ({source})\n"
    )
    header = (
        f"{'preset':<11}{'peak per rank':>20}{'before model':>15}{'growth':>9}"
        f"{'plan total':>12}{'plan states':>13}{'ZeRO paper':>12}"
    )
    print(header)
    results = []
    for preset, summary, estimate in rows:
        peaks = summary["peak_memory_gib_per_rank"]
        before = summary["memory_before_model_gib_per_rank"]
        growth = max(p - b for p, b in zip(peaks, before, strict=True))
        print(
            f"{preset:<11}{' / '.join(f'{p:.2f}' for p in peaks):>20}"
            f"{' / '.join(f'{b:.2f}' for b in before):>15}{growth:>9.2f}"
            f"{estimate.total / GIB:>12.2f}{estimate.model_states / GIB:>13.2f}"
            f"{estimate.paper / GIB:>12.2f}"
        )
        results.append({
            "preset": preset, "peak_gib_per_rank": peaks, "before_model_gib_per_rank": before,
            "plan_total_gib": estimate.total / GIB, "plan_states_gib": estimate.model_states / GIB,
            "zero_paper_gib": estimate.paper / GIB, "wall_seconds": summary["wall_seconds"],
        })  # fmt: skip
    print("(GiB; 'growth' = largest rank's peak minus its memory before the model loaded)")
    if args.json:
        args.json.write_text(json.dumps({"kind": kind, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the side-by-side benchmarks share: row selection, the data order, child runs, tables.

Each benchmark trains the same model on the same rows, in the same order, with the same batch,
`max_length`, precision, optimizer, learning rate and number of optimizer steps, once with
align_anything (its real entry point, `python -m align_anything.train`) and once with TRL, each
run in its own process so that its peak RSS is its own (`os.wait4` returns the child's rusage).
Runs are interleaved (ours, TRL, TRL, ours, ...) so that load from other work on the machine
hits every variant alike, and the tables show medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

from align_anything.data.builtin import builtin_path  # noqa: E402
from align_anything.training.batching import step_indices  # noqa: E402

MODEL = "smollm2-135m-instruct"
SEED = 42
TRL_CHILD = Path(__file__).resolve().parent / "trl_child.py"
# Children must not inherit a launcher's rank variables, nor reach the hub.
DIST_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def preference_rows(name: str, count: int) -> list[dict[str, Any]]:
    """The first `count` pairs of a built-in preference set as conversational records (message
    lists), the form both trainers read the same way through the chat template."""
    rows = read_jsonl(builtin_path(name))[:count]
    if len(rows) < count:
        raise SystemExit(f"{name} has {len(rows)} pairs, fewer than the {count} asked for")
    return [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in rows
    ]


def unpaired_rows(name: str, count: int) -> list[dict[str, Any]]:
    """The first `count` rows of a built-in unpaired set (prompt, completion, label) as
    conversational records, the form both trainers read the same way."""
    rows = read_jsonl(builtin_path(name))[:count]
    if len(rows) < count:
        raise SystemExit(f"{name} has {len(rows)} rows, fewer than the {count} asked for")
    return [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "completion": [{"role": "assistant", "content": r["completion"]}],
            "label": bool(r["label"]),
        }
        for r in rows
    ]


def conversation_rows(name: str, count: int) -> list[dict[str, Any]]:
    """The first `count` single-turn conversations of a built-in SFT set."""
    rows = read_jsonl(builtin_path(name))[:count]
    if len(rows) < count:
        raise SystemExit(f"{name} has {len(rows)} conversations, fewer than the {count} asked for")
    return [{"messages": r["messages"]} for r in rows]


def as_prompt_completion(row: dict[str, Any]) -> dict[str, Any]:
    """A single-turn conversation as TRL's conversational prompt-completion record."""
    *prompt, completion = row["messages"]
    if completion["role"] != "assistant" or not prompt:
        raise ValueError("expected a conversation that ends with its only assistant turn")
    return {"prompt": prompt, "completion": [completion]}


def training_order(num_rows: int, *, batch: int, steps: int, seed: int = SEED) -> list[int]:
    """Row indices in the order align_anything trains on them (its seeded permutation, cut
    into global batches): TRL reads the rows in this order with a sequential sampler."""
    order: list[int] = []
    for step in range(steps):
        order += step_indices(num_rows, global_batch=batch, seed=seed, epoch=0, step=step)
    return order


def encoded_in_order(
    encode: Callable[..., tuple[list[dict], Any]], rows: list[dict], *, max_length: int,
    batch: int, steps: int, model: str = MODEL,
) -> tuple[list[dict], list[int]]:  # fmt: skip
    """align_anything's encoding of the rows (none may be dropped: both trainers must see all
    of them) and the order it trains on them."""
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model))
    encoded, data_report = encode(rows, tokenizer, max_length=max_length)
    if len(encoded) != len(rows):
        raise SystemExit(f"rows were dropped at max_length={max_length}: {data_report.summary()}")
    return encoded, training_order(len(rows), batch=batch, steps=steps)


@dataclass
class RunRecord:
    """One child run: wall-clock training time, step times, logged step-1 figures, peak RSS."""

    variant: str
    seconds: float  # training time: reference pass (ours) + every optimizer step
    step_seconds: list[float]
    tokens: int  # non-padding tokens the steps processed (prompt counted per sequence)
    peak_rss_mib: float
    first_step: dict[str, float]
    second_step: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, float]] = field(default_factory=list)  # every logged step


def child_env(threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    # Offline (both sides load the same local folder), and this checkout's package first.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_child(command: list[str], *, env: dict[str, str], log: Path) -> float:
    """Run a command to completion; return its peak RSS in MiB (its own, from `wait4`)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}; log {log}:\n{tail}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def run_ours(
    variant: str, overrides: list[str], *, workdir: Path, env: dict[str, str]
) -> RunRecord:
    """align_anything through its real entry point, one process; figures from metrics.jsonl
    and summary.json (training time = DPO reference pass, if any, + the step loop)."""
    out = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=workdir))
    command = [sys.executable, "-m", "align_anything.train", *overrides, f"output_dir={out}"]
    rss = run_child(command, env=env, log=out / "run.log")
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "phase" not in m]
    summary = json.loads((out / "summary.json").read_text())
    elapsed = [0.0] + [float(m["elapsed_seconds"]) for m in steps]
    step_seconds = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]
    reference = float(summary.get("reference_seconds") or 0.0)
    return RunRecord(
        variant=variant,
        seconds=float(summary["train_seconds"]) + reference,
        step_seconds=step_seconds,
        tokens=0,
        peak_rss_mib=rss,
        first_step=steps[0],
        second_step=steps[1] if len(steps) > 1 else {},
        extra={"reference_seconds": reference},
        steps=steps,
    )


def run_trl(variant: str, spec: dict[str, Any], *, workdir: Path, env: dict[str, str]) -> RunRecord:
    """TRL's trainer in a child process (benchmarks/trl_child.py) on the spec's rows."""
    out = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=workdir))
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "output_dir": str(out)}))
    rss = run_child([sys.executable, str(TRL_CHILD), str(spec_path)], env=env, log=out / "run.log")
    result = json.loads((out / "result.json").read_text())
    reference = float(result.get("reference_seconds") or 0.0)  # a precomputed reference pass
    return RunRecord(
        variant=variant,
        seconds=float(sum(result["step_seconds"])) + reference,
        step_seconds=result["step_seconds"],
        tokens=0,
        peak_rss_mib=rss,
        first_step=result["logs"][0],
        second_step=result["logs"][1] if len(result["logs"]) > 1 else {},
        extra={"token_lengths": result["token_lengths"], "reference_seconds": reference},
        steps=result["logs"],
    )


def interleave(
    runners: dict[str, Callable[[], RunRecord]], repeats: int, *, verbose: bool = True
) -> dict[str, list[RunRecord]]:
    """Run every variant once per repeat, rotating the order so no variant always goes first."""
    records: dict[str, list[RunRecord]] = {name: [] for name in runners}
    names = list(runners)
    for repeat in range(repeats):
        rotated = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in rotated:
            start = time.perf_counter()
            record = runners[name]()
            records[name].append(record)
            if verbose:
                print(
                    f"  repeat {repeat + 1}/{repeats} {name:14s} train {record.seconds:7.1f} s, "
                    f"peak RSS {record.peak_rss_mib:6.0f} MiB (process {time.perf_counter() - start:5.0f} s, "
                    f"load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    return records


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def summary_table(
    records: dict[str, list[RunRecord]],
    *,
    steps: int,
    tokens: int,
    ours: str,
    metrics: list[tuple[str, str]],
) -> str:
    """A markdown table: medians per variant, and ours/variant ratios of throughput and memory.
    `metrics` maps a column title to (ours key, TRL key) of a logged step-1 figure."""
    header = ["variant", "steps/s", "tokens/s", "peak RSS MiB", "speed ours/this", "RSS ours/this"]
    header += [title for title, _ in metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ours_seconds = median([r.seconds for r in records[ours]])
    ours_rss = median([r.peak_rss_mib for r in records[ours]])
    for name, runs in records.items():
        seconds = median([r.seconds for r in runs])
        rss = median([r.peak_rss_mib for r in runs])
        row = [
            name,
            f"{steps / seconds:.4f}",
            f"{tokens / seconds:.1f}",
            f"{rss:.0f}",
            "—" if name == ours else f"{seconds / ours_seconds:.2f}×",
            "—" if name == ours else f"{ours_rss / rss:.2f}",
        ]
        for _, key in metrics:
            row.append(f"{runs[0].first_step.get(key, float('nan')):.6f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


@dataclass
class Setup:
    """One side-by-side comparison: the shared hyper-parameters and both sides' inputs."""

    task: str  # "dpo" | "sft" | "kto"
    steps: int
    batch: int
    max_length: int
    learning_rate: float
    ours_rows: list[dict[str, Any]]  # the file align_anything reads (it orders the rows itself)
    trl_rows: list[dict[str, Any]]  # the same rows in align_anything's training order
    ours_variants: dict[str, list[str]]  # name -> extra overrides
    tokens: int  # non-padding tokens over all steps, from align_anything's encoding
    token_lengths: list[list[int]]  # per row in training order, to compare with TRL's
    extra_spec: dict[str, Any] = field(default_factory=dict)
    extra_overrides: list[str] = field(default_factory=list)
    model: str = MODEL  # a built-in name both sides load from the same local folder
    # TRL variants: (name, gradient checkpointing, optimizer, extra spec); None: TRL_VARIANTS.
    trl_variants: tuple[tuple[str, bool, str, dict[str, Any]], ...] | None = None


# align_anything's variants: its defaults; every switchable optimisation off; like TRL's
# defaults, with activation checkpointing.
OURS_VARIANTS: dict[str, list[str]] = {
    "align_anything": [],
    "align_anything plain": [
        "speed.share_prefix=false",
        "speed.completion_only_logits=false",
        "speed.tied_grads_in_place=false",
    ],
    "align_anything GC": ["speed.gradient_checkpointing=true"],
}

# TRL as shipped; without gradient checkpointing; and also with torch's fused AdamW (the
# implementation align_anything uses on CPU): its fastest configuration here.
TRL_VARIANTS: tuple[tuple[str, bool, str, dict[str, Any]], ...] = (
    ("TRL defaults", True, "adamw_torch", {}),
    ("TRL no-GC", False, "adamw_torch", {}),
    ("TRL no-GC fused", False, "adamw_torch_fused", {}),
)


def add_arguments(parser: argparse.ArgumentParser, *, batch_help: str) -> None:
    """The command-line options both benchmarks take."""
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=8, help=batch_help)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run")
    parser.add_argument(
        "--only", default=None, help="comma-separated variant names to run (default: all)"
    )


def run_comparison(
    setup: Setup, *, repeats: int, threads: int | None, only: str | None = None
) -> dict[str, list[RunRecord]]:
    """Write the rows, then run every variant `repeats` times, interleaved."""
    workdir = Path(tempfile.mkdtemp(prefix=f"aa-bench-{setup.task}-"))
    env = child_env(threads)
    overrides, spec = child_inputs(setup, workdir)
    runners: dict[str, Callable[[], RunRecord]] = {}
    for name, extra in setup.ours_variants.items():
        runners[name] = lambda n=name, e=extra: run_ours(n, overrides + e, workdir=workdir, env=env)
    for name, checkpointing, optim, extra_spec in setup.trl_variants or TRL_VARIANTS:
        runners[name] = lambda n=name, c=checkpointing, o=optim, x=extra_spec: run_trl(
            n, {**spec, "gradient_checkpointing": c, "optim": o, **x}, workdir=workdir, env=env
        )
    if only:
        wanted = [name.strip() for name in only.split(",")]
        unknown = [name for name in wanted if name not in runners]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {list(runners)}")
        runners = {name: runners[name] for name in wanted}
    print(f"work folder {workdir}; {len(runners)} variants × {repeats} repeats", flush=True)
    return interleave(runners, repeats)


def child_inputs(setup: Setup, workdir: Path) -> tuple[list[str], dict[str, Any]]:
    """Both sides' inputs for one comparison: the rows written under `workdir`, then
    align_anything's overrides and the TRL child's spec, with the same hyper-parameters."""
    from align_anything.families.zoo import resolve_model_path

    ours_file, trl_file = workdir / "ours.jsonl", workdir / "trl.jsonl"
    write_jsonl(ours_file, setup.ours_rows)
    write_jsonl(trl_file, setup.trl_rows)
    adam = {"adam_betas": [0.9, 0.999], "adam_eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}
    overrides = [
        f"task={setup.task}", "deepspeed=z0", f"model.name_or_path={setup.model}",
        f"data.path={ours_file}", "data.eval_path=null", "data.eval_fraction=0",
        f"data.max_length={setup.max_length}", f"train.max_steps={setup.steps}",
        f"train.per_device_batch_size={setup.batch}", "train.gradient_accumulation_steps=1",
        f"train.learning_rate={setup.learning_rate}", "train.lr_scheduler=constant",
        "train.warmup_ratio=0", "train.weight_decay=0", "train.adam_eps=1e-8",
        "train.max_grad_norm=1.0", "train.precision=fp32", f"train.seed={SEED}",
        "checkpoint.save_final=false", "logging.backends=[jsonl]", *setup.extra_overrides,
    ]  # fmt: skip
    spec = {
        "task": setup.task, "model_path": str(resolve_model_path(setup.model)),
        "rows_path": str(trl_file), "batch": setup.batch, "steps": setup.steps,
        "max_length": setup.max_length, "learning_rate": setup.learning_rate, "seed": SEED,
        **adam, **setup.extra_spec,
    }  # fmt: skip
    return overrides, spec


def step_differences(
    records: dict[str, list[RunRecord]], ours: str, keys: tuple[str, ...]
) -> dict[str, tuple[float, int]]:
    """Key -> (the largest |difference| from `ours` at any logged step of any variant's first
    run, the number of steps compared)."""
    want = records[ours][0].steps
    found: dict[str, tuple[float, int]] = {}
    for key in keys:
        worst, compared = 0.0, 0
        for runs in records.values():
            for mine, theirs in zip(want, runs[0].steps, strict=False):
                if key in mine and key in theirs:
                    worst = max(worst, abs(float(mine[key]) - float(theirs[key])))
                    compared += 1
        found[key] = (worst, compared)
    return found


def report(
    setup: Setup, records: dict[str, list[RunRecord]], metrics: list[tuple[str, str]],
    every_step: tuple[str, ...] = (),
) -> str:  # fmt: skip
    """The table, the token-count check and the step-1 agreement (and, for `every_step` keys,
    the agreement at every step), as markdown."""
    ours = next(name for name in records if name in setup.ours_variants)
    trl_runs = [
        r for name, runs in records.items() for r in runs if name not in setup.ours_variants
    ]
    trl_lengths = trl_runs[0].extra["token_lengths"] if trl_runs else setup.token_lengths
    same_tokens = trl_lengths == setup.token_lengths
    lines = [
        summary_table(records, steps=setup.steps, tokens=setup.tokens, ours=ours, metrics=metrics),
        "",
        f"- rows: {len(setup.trl_rows)} ({setup.steps} steps × batch {setup.batch}), "
        f"{setup.tokens} non-padding tokens over all steps; token counts per row "
        + ("identical in both trainers" if same_tokens else "DIFFER between the trainers"),
    ]
    if not same_tokens:
        diffs = [
            (i, a, b)
            for i, (a, b) in enumerate(zip(setup.token_lengths, trl_lengths, strict=False))
            if a != b
        ]
        lines.append(f"  - first differences (row, ours, TRL): {diffs[:5]}")
    for _, key in metrics:
        values = {name: runs[0].first_step.get(key) for name, runs in records.items()}
        ours_value = values[ours]
        worst = max(abs(v - ours_value) for v in values.values() if v is not None)
        lines.append(f"- step-1 `{key}`: largest difference from {ours} {worst:.2e}")
    for key, (worst, compared) in step_differences(records, ours, every_step).items():
        lines.append(
            f"- every step (1..{setup.steps}) `{key}`: largest difference from {ours} "
            f"{worst:.2e} ({compared} values compared)"
        )
        values = [m.get(key) for m in records[ours][0].steps]
        lines.append(f"  - {ours}'s `{key}` per step: " + ", ".join(f"{v:.6f}" for v in values))
    if all(r.second_step for runs in records.values() for r in runs):
        values = {name: runs[0].second_step.get("loss") for name, runs in records.items()}
        lines.append(
            "- step-2 loss (after one identical AdamW update): "
            + ", ".join(f"{n} {v:.6f}" for n, v in values.items())
        )
    step_medians = {
        name: median([median(r.step_seconds[1:] or r.step_seconds) for r in runs])
        for name, runs in records.items()
    }
    lines.append(
        "- steady-state seconds per step (median of steps 2..N): "
        + ", ".join(f"{n} {v:.2f}" for n, v in step_medians.items())
    )
    ref = [r.extra.get("reference_seconds") for r in records[ours]]
    if any(ref):
        lines.append(
            f"- {ours}: the reference pass ({median([x for x in ref if x]):.1f} s) is included in "
            "its training time; TRL (defaults) runs the reference forward inside each step"
        )
    return "\n".join(lines)


def main(
    build_setup: Callable[..., Setup], metrics: list[tuple[str, str]], *, doc: str,
    batch_help: str, every_step: tuple[str, ...] = (),
) -> None:  # fmt: skip
    """Command line of a side-by-side benchmark: parse, build the rows, run, print the report."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(parser, batch_help=batch_help)
    args = parser.parse_args()
    setup = build_setup(
        steps=args.steps, batch=args.batch, max_length=args.max_length,
        learning_rate=args.learning_rate,
    )  # fmt: skip
    records = run_comparison(setup, repeats=args.repeats, threads=args.threads, only=args.only)
    print()
    print(f"load average at the end: {os.getloadavg()}")
    print(report(setup, records, metrics, every_step))

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
import gzip
import json
import math
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
from align_anything.data.convert import parse_hh  # noqa: E402
from align_anything.training.batching import step_indices  # noqa: E402

MODEL = "smollm2-135m-instruct"
SEED = 42
TRL_CHILD = Path(__file__).resolve().parent / "trl_child.py"
# Children must not inherit a launcher's rank variables, nor reach the hub.
DIST_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
# The long rows: HH-RLHF harmless-base test conversations (the sample in tests/data when the
# full file is absent).
HH_FULL = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
HH_SAMPLE = REPO_ROOT / "tests" / "data" / "hh-rlhf-harmless-base-test-sample.jsonl.gz"
# --rows: the built-in arithmetic rows (short) or the HH-RLHF conversations (long), and the
# max_length each runs at unless --max-length is given.
ROW_SETS = {"arith": 128, "hh": 512}
MIN_USER_TURNS = 2  # a long row's prompt is a multi-turn conversation
MATMUL_SIZE = 2048


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


def hh_pairs(path: Path) -> list[dict[str, Any]]:
    """The file's pairs as message lists; pairs whose two transcripts disagree on the prompt
    (a few HH rows) are left out, as both trainers would treat them differently."""
    pairs = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            prompt, chosen = parse_hh(row["chosen"])
            other, rejected = parse_hh(row["rejected"])
            if prompt != other or not prompt or prompt[-1]["role"] != "user":
                continue
            pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                          "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
    return pairs


def user_turns(messages: list[dict[str, Any]]) -> int:
    return sum(m["role"] == "user" for m in messages)


def long_pairs(
    count: int, *, max_length: int, model: str = MODEL, source: Path | None = None
) -> list[dict[str, Any]]:
    """The long rows, one selection for every task: the first `count` HH-RLHF harmless-base
    pairs in file order whose prompt is a multi-turn conversation (at least MIN_USER_TURNS user
    turns), whose two answers differ, and whose prompt + longer answer fits `max_length` tokens
    in align_anything's encoding (so neither trainer drops or truncates one). Deterministic: no
    sampling, the same rows on every run."""
    from align_anything.families.language.encode import encode_preference
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    source = source or (HH_FULL if HH_FULL.exists() else HH_SAMPLE)
    tokenizer = load_tokenizer(resolve_model_path(model))
    chosen = []
    for pair in hh_pairs(source):
        if user_turns(pair["prompt"]) < MIN_USER_TURNS or pair["chosen"] == pair["rejected"]:
            continue
        encoded, _ = encode_preference([pair], tokenizer, max_length=max_length)
        if encoded:
            chosen.append(pair)
            if len(chosen) == count:
                return chosen
    raise SystemExit(
        f"{source} has {len(chosen)} multi-turn pairs within {max_length} tokens, not {count}"
    )


def long_prompts(count: int, *, max_prompt_length: int, model: str = MODEL) -> list[dict[str, Any]]:
    """The online-RL benchmarks' long rows: the prompts of the first `count` long pairs
    (multi-turn HH-RLHF conversations up to their last user turn) that fit
    `max_prompt_length` tokens with their answers."""
    return [{"prompt": pair["prompt"]} for pair in
            long_pairs(count, max_length=max_prompt_length, model=model)]  # fmt: skip


# The online-RL benchmarks' prompt length on the arithmetic rows (short prompts).
ARITH_PROMPT_LENGTH = 256


def rl_prompt_length(row_set: str, max_completion_length: int) -> int:
    """The longest prompt an online-RL benchmark encodes: 256 tokens for the arithmetic rows;
    for the long rows what leaves room for the completion within their 512."""
    if row_set == "arith":
        return ARITH_PROMPT_LENGTH
    return ROW_SETS[row_set] - max_completion_length


def long_conversations(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SFT's long rows: each pair's prompt + chosen answer as one conversation."""
    return [{"messages": p["prompt"] + p["chosen"]} for p in pairs]


def long_unpaired(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """KTO's long rows: pair k's chosen answer as a desirable row when k is even, its rejected
    answer as an undesirable one when k is odd (every prompt once, half of each label)."""
    return [
        {"prompt": p["prompt"], "completion": p["chosen" if k % 2 == 0 else "rejected"],
         "label": k % 2 == 0}
        for k, p in enumerate(pairs)
    ]  # fmt: skip


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


def parameter_count(model_path: str | Path) -> int:
    """N: the parameters stored in a model folder's safetensors files, read from their headers
    (a tied embedding and LM head is stored, and counted, once)."""
    total = 0
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {model_path}: cannot count the model's parameters")
    for file in files:
        with open(file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def model_gflops(params: int, tokens: int, seconds: float) -> float:
    """Achieved GFLOP/s by the 6·N·tokens rule (forward 2·N, backward 4·N per token)."""
    return 6 * params * tokens / seconds / 1e9


def matmul_gflops(threads: int | None, *, size: int = MATMUL_SIZE, repeats: int = 7) -> float:
    """The machine's fp32 matmul rate: the best of `repeats` timed size × size `torch.mm` at
    `threads` threads (torch's default when None, as the child runs get), after a warm-up."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


@dataclass
class Rates:
    """What the GFLOP/s columns need: N, and the matmul rate measured in this invocation."""

    params: int
    matmul_gflops: float
    threads: int


def step_tokens(row_tokens: list[int], *, batch: int) -> list[int]:
    """Tokens per optimizer step, from the rows' tokens in training order."""
    return [sum(row_tokens[i : i + batch]) for i in range(0, len(row_tokens), batch)]


def steady_seconds(record: RunRecord) -> float:
    """Seconds of a steady step: the median of steps 2..N (step 1 when there is one)."""
    return median(record.step_seconds[1:] or record.step_seconds)


def steady_gflops(record: RunRecord, per_step: list[int], params: int) -> float:
    """GFLOP/s over steps 2..N (step 1 alone when there is one): their tokens, their time."""
    first = 1 if len(record.step_seconds) > 1 else 0
    seconds = sum(record.step_seconds[first:])
    return model_gflops(params, sum(per_step[first : len(record.step_seconds)]), seconds)


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
    # Offline (both sides load the same local folder), and this checkout's package first (the
    # caller's PYTHONPATH after it: e.g. a folder TRL was installed to with `pip --target`).
    paths = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                if p and Path(p).resolve() != REPO_ROOT]  # fmt: skip
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.pathsep.join(paths))
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
    rates: Rates | None = None,
    per_step: list[int] | None = None,
) -> str:
    """A markdown table: medians per variant, ours/variant ratios of throughput (over the whole
    training time, and per steady step) and memory, and with `rates` the achieved GFLOP/s by
    6·N·tokens (over the training time, and over steps 2..N from `per_step` tokens) as a share
    of the measured matmul rate. `metrics` maps a column title to the key of a logged step-1
    figure."""
    header = ["variant", "steps/s", "tokens/s", "peak RSS MiB", "speed ours/this", "RSS ours/this",
              "steady step ours/this"]  # fmt: skip
    if rates:
        header += ["GFLOP/s", "% of matmul", "steady GFLOP/s", "steady % of matmul"]
    header += [title for title, _ in metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ours_seconds = median([r.seconds for r in records[ours]])
    ours_rss = median([r.peak_rss_mib for r in records[ours]])
    ours_steady = median([steady_seconds(r) for r in records[ours]])
    for name, runs in records.items():
        seconds = median([r.seconds for r in runs])
        rss = median([r.peak_rss_mib for r in runs])
        steady = median([steady_seconds(r) for r in runs])
        row = [
            name,
            f"{steps / seconds:.4f}",
            f"{tokens / seconds:.1f}",
            f"{rss:.0f}",
            "—" if name == ours else f"{seconds / ours_seconds:.2f}×",
            "—" if name == ours else f"{ours_rss / rss:.2f}",
            "—" if name == ours else f"{steady / ours_steady:.2f}×",
        ]
        if rates:
            run_rate = model_gflops(rates.params, tokens, seconds)
            row += [f"{run_rate:.1f}", f"{run_rate / rates.matmul_gflops:.0%}"]
            if per_step:
                rate = median([steady_gflops(r, per_step, rates.params) for r in runs])
                row += [f"{rate:.1f}", f"{rate / rates.matmul_gflops:.0%}"]
            else:
                row += ["—", "—"]
        for _, key in metrics:
            row.append(f"{runs[0].first_step.get(key, float('nan')):.6f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def against_trl(records: dict[str, list[RunRecord]], ours: str, trl: list[str]) -> str:
    """One line: ours against TRL's fastest configuration (by training time), both speed
    ratios, and peak RSS against it and against TRL's defaults."""
    if not trl:
        return "- no TRL variant ran"
    seconds = {name: median([r.seconds for r in records[name]]) for name in [ours, *trl]}
    rss = {name: median([r.peak_rss_mib for r in records[name]]) for name in [ours, *trl]}
    steady = {name: median([steady_seconds(r) for r in records[name]]) for name in [ours, *trl]}
    fastest = min(trl, key=seconds.__getitem__)
    line = (
        f"- {ours} against TRL's fastest configuration here ({fastest}): "
        f"{seconds[fastest] / seconds[ours]:.2f}× over the training time, "
        f"{steady[fastest] / steady[ours]:.2f}× per steady step; peak RSS "
        f"{rss[ours] / rss[fastest]:.2f}× its"
    )
    if "TRL defaults" in rss:
        line += f", {rss[ours] / rss['TRL defaults']:.2f}× TRL defaults'"
    return line


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
    # Non-padding tokens each row puts through the model, in training order (sum: `tokens`);
    # empty: no per-step figures.
    row_tokens: list[int] = field(default_factory=list)
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


def add_arguments(
    parser: argparse.ArgumentParser, *, batch_help: str, row_sets: tuple[str, ...] = ("arith", "hh")
) -> None:
    """The command-line options the side-by-side benchmarks take."""
    parser.add_argument(
        "--rows", choices=row_sets, default=row_sets[0],
        help="arith: the built-in arithmetic rows (short); hh: multi-turn HH-RLHF harmless-base "
        "conversations of up to --max-length tokens (long; see common.long_pairs)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=8, help=batch_help)
    parser.add_argument(
        "--max-length", type=int, default=None,
        help=f"tokens per sequence (default per row set: {ROW_SETS})",
    )  # fmt: skip
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
    every_step: tuple[str, ...] = (), rates: Rates | None = None,
) -> str:  # fmt: skip
    """The table, the token-count check and the step-1 agreement (and, for `every_step` keys,
    the agreement at every step), as markdown."""
    ours = next(name for name in records if name in setup.ours_variants)
    trl_runs = [
        r for name, runs in records.items() for r in runs if name not in setup.ours_variants
    ]
    trl_lengths = trl_runs[0].extra["token_lengths"] if trl_runs else setup.token_lengths
    same_tokens = trl_lengths == setup.token_lengths
    per_step = step_tokens(setup.row_tokens, batch=setup.batch) if setup.row_tokens else None
    lines = [
        summary_table(
            records,
            steps=setup.steps,
            tokens=setup.tokens,
            ours=ours,
            metrics=metrics,
            rates=rates,
            per_step=per_step,
        ),  # fmt: skip
        "",
        against_trl(records, ours, [n for n in records if n not in setup.ours_variants]),
        f"- rows: {len(setup.trl_rows)} ({setup.steps} steps × batch {setup.batch}), "
        f"{setup.tokens} non-padding tokens over all steps; token counts per row "
        + (
            "not compared (no TRL run)"
            if not trl_runs
            else "identical in both trainers"
            if same_tokens
            else "DIFFER between the trainers"
        ),
    ]
    if not same_tokens:
        diffs = [
            (i, a, b)
            for i, (a, b) in enumerate(zip(setup.token_lengths, trl_lengths, strict=False))
            if a != b
        ]
        lines.append(f"  - first differences (row, ours, TRL): {diffs[:5]}")
    if rates:
        lines.append(
            f"- GFLOP/s = 6·N·tokens / seconds, N = {rates.params:,} parameters (the model's "
            f"safetensors), tokens = the {setup.tokens:,} non-padding tokens of every sequence "
            "the steps put through the policy (each prompt counted per sequence, the same count "
            "for both trainers; not the positions a shared-prefix layout or padding adds or "
            "saves), seconds = the training time (steady: steps 2..N and their tokens); the "
            f"machine's fp32 matmul rate: {rates.matmul_gflops:.1f} GFLOP/s "
            f"({MATMUL_SIZE}² torch.mm, {rates.threads} threads, best of 7, before and after "
            "the runs, the higher)"
        )
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
    batch_help: str, every_step: tuple[str, ...] = (), row_sets: tuple[str, ...] = ("arith", "hh"),
    steps: int = 3, repeats: int = 3,
) -> None:  # fmt: skip
    """Command line of a side-by-side benchmark: parse, build the rows, measure the machine's
    matmul rate, run, measure it again, print the report."""
    import torch

    from align_anything.families.zoo import resolve_model_path

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(parser, batch_help=batch_help, row_sets=row_sets)
    parser.set_defaults(steps=steps, repeats=repeats)
    args = parser.parse_args()
    setup = build_setup(
        steps=args.steps, batch=args.batch, max_length=args.max_length or ROW_SETS[args.rows],
        learning_rate=args.learning_rate, row_set=args.rows,
    )  # fmt: skip
    before = matmul_gflops(args.threads)
    records = run_comparison(setup, repeats=args.repeats, threads=args.threads, only=args.only)
    after = matmul_gflops(args.threads)
    rates = Rates(
        params=parameter_count(resolve_model_path(setup.model)),
        matmul_gflops=max(before, after), threads=torch.get_num_threads(),
    )  # fmt: skip
    print()
    print(
        f"load average at the end: {os.getloadavg()}; fp32 matmul {before:.1f} GFLOP/s before "
        f"the runs, {after:.1f} after ({rates.threads} threads)"
    )
    print(report(setup, records, metrics, every_step, rates))

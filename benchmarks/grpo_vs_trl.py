"""GRPO throughput and agreement, side by side: align_anything against TRL 1.16's GRPOTrainer
(HF generate, `use_vllm=False`) on the same work.

    python benchmarks/grpo_vs_trl.py                          # smollm2-135m-instruct, 4 steps, 2 repeats
    python benchmarks/grpo_vs_trl.py --model tiny-random-llama --steps 2 --repeats 1   # quick
    python benchmarks/grpo_vs_trl.py --rows hh --steps 2 --repeats 1   # long multi-turn prompts

Same model (fp32 on CPU), the same prompts (the first steps × prompts-per-step rows of the
built-in arith-prompts set, with their `answer` field) in the same order (align_anything's
seeded order, given to TRL with `shuffle_dataset=False`), the same G, `max_completion_length`,
sampling (temperature 1, top_p 1, no top_k), reward (align_anything's `arith_exact`), torch
AdamW settings, constant learning rate, loss type (dapo), β = 0 (no reference), ε = 0.2 and
the same number of optimizer steps, one process each (peak RSS from `wait4`). align_anything
runs through its real entry point with ZeRO-0. The two sample differently (align_anything draws
each completion from its own seeded generator), so the completions, and with them the
rewards and the lengths, differ: the table reports steps/s, and generation and training
tokens/s separately (generation: completion tokens / seconds inside generate; training:
prompt + completion tokens / the rest of the step).

With `--vllm` (the vLLM environment, `make vllm`, must exist: .venv-vllm): two more variants
on the same work, both run by that environment's interpreter: align_anything with
`rollout.backend=vllm` (colocated: the engine in the training process, weights synced in
memory every step) and TRL with `use_vllm=True, vllm_mode="colocate"`. Generation seconds
include each side's weight sync (TRL times it inside `_generate_single_turn` too). The machine
is shared: the load average is printed beside the figures.

`--rows hh`: the long prompts instead, the multi-turn HH-RLHF conversations of the other
benchmarks' long rows (`common.long_pairs`: each pair's prompt, up to the last user turn; at
most 512 - max_completion_length tokens), rewarded by align_anything's `length_penalty`
(−0.001 per character: no answer to check, and completions of one group differ in it, so the
advantages are not all zero).

Agreement (`--agreement-only` runs just this): one fixed set of completions (two prompts × four
hand-written answers, right and wrong) scored once through TRL's own code
(`GRPOTrainer._get_per_token_logps_and_entropies` and `compute_loss`) and once through
align_anything's (`forward.completion_token_logps`, `losses.grpo_per_token_loss`,
`losses.loss_sum` / `losses.loss_items`, the calls `tasks/grpo.py` makes), each in its own
process from the same weights: the largest per-token log-prob and loss differences.
Picture questions on an image-text model: grpo_vlm_vs_trl.py, which reuses this file's runs.
Needs the `bench` extra (`pip install -e ".[bench]"`); `--vllm` also needs TRL in the vLLM
environment (`.venv-vllm/bin/pip install -c .venv-vllm/constraints.txt trl==1.16.0`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    MODEL,
    SEED,
    TRL_CHILD,
    RunRecord,
    child_env,
    interleave,
    long_prompts,
    median,
    read_jsonl,
    rl_prompt_length,
    run_child,
    training_order,
    write_jsonl,
)

from align_anything.data.builtin import builtin_path

# The fixed completions of the agreement check, per prompt (`{a}`: the right answer).
FIXED_ANSWERS = ("Answer: {a}", "Answer: {b}", "The answer is {a}.", "Answer: {a} I hope this helps!")  # fmt: skip


def prompt_rows(count: int) -> list[dict[str, Any]]:
    """The first `count` rows of arith-prompts: the prompt messages and the `answer` field."""
    rows = read_jsonl(builtin_path("arith-prompts"))[:count]
    if len(rows) < count:
        raise SystemExit(f"arith-prompts has {len(rows)} rows, fewer than the {count} asked for")
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]


# Per row set: the reward both sides compute, and the prompt length each allows.
REWARDS = {"arith": "arith_exact", "hh": "length_penalty"}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
        "temperature": 1.0, "top_p": 1.0, "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2,
    }  # fmt: skip


def row_limits(args: argparse.Namespace, max_length: int | None, reward: str | None
               ) -> tuple[int, str]:  # fmt: skip
    """(data.max_length, reward function) of a run: as given (grpo_vlm_vs_trl.py), else the row
    set's (`--rows`)."""
    if max_length is None:
        max_length = rl_prompt_length(args.rows, args.max_completion_length)
    return max_length, REWARDS[args.rows] if reward is None else reward


def ours_overrides(args: argparse.Namespace, data: Path, *, max_length: int | None = None,
                   reward: str | None = None) -> list[str]:  # fmt: skip
    """align_anything's side (`max_length`, `reward`: see `row_limits`)."""
    s = settings(args)
    max_length, reward = row_limits(args, max_length, reward)
    return [
        "task=grpo", "deepspeed=z0", f"model.name_or_path={args.model}", f"data.path={data}",
        "data.eval_path=null", "data.eval_fraction=0", f"data.max_length={max_length}",
        f"train.max_steps={args.steps}",
        f"train.per_device_batch_size={args.prompts * args.num_generations}",
        "train.gradient_accumulation_steps=1", f"train.learning_rate={args.learning_rate}",
        "train.lr_scheduler=constant", "train.warmup_ratio=0", "train.weight_decay=0",
        "train.adam_eps=1e-8", "train.max_grad_norm=1.0", "train.precision=fp32",
        f"train.seed={SEED}", "checkpoint.save_final=false", "logging.backends=[jsonl]",
        "logging.completions_every=0", f"reward.functions=[align_anything.rewards:{reward}]",
        f"grpo.num_generations={s['num_generations']}",
        f"grpo.max_completion_length={s['max_completion_length']}",
        f"grpo.temperature={s['temperature']}", f"grpo.top_p={s['top_p']}",
        f"grpo.loss_type={s['loss_type']}", f"grpo.beta={s['beta']}",
        f"grpo.epsilon={s['epsilon']}", "grpo.eval_samples=0",
    ]  # fmt: skip


def trl_spec(args: argparse.Namespace, rows_path: Path, *, max_length: int | None = None,
             reward: str | None = None) -> dict[str, Any]:  # fmt: skip
    """TRL's side, the same settings as `ours_overrides`."""
    from align_anything.families.zoo import resolve_model_path

    max_length, reward = row_limits(args, max_length, reward)
    return {
        "task": "grpo", "model_path": str(resolve_model_path(args.model)),
        "rows_path": str(rows_path), "batch": args.prompts * args.num_generations,
        "steps": args.steps, "max_length": max_length, "reward": reward,
        "learning_rate": args.learning_rate,
        "seed": SEED, "adam_betas": [0.9, 0.999], "adam_eps": 1e-8, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "gradient_checkpointing": False, "optim": "adamw_torch_fused",
        **settings(args),
    }  # fmt: skip


VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def run_ours(
    args: argparse.Namespace, data: Path, workdir: Path, env: dict, *, vllm: bool = False,
    overrides: list[str] | None = None,
) -> RunRecord:  # fmt: skip
    """align_anything's run (`overrides`: instead of `ours_overrides(args, data)`)."""
    out = Path(tempfile.mkdtemp(prefix="ours-", dir=workdir))
    python = str(VLLM_PYTHON) if vllm else sys.executable
    backend = ["rollout.backend=vllm", "rollout.vllm.kv_cache_gib=0.5"] if vllm else []
    overrides = ours_overrides(args, data) if overrides is None else overrides
    command = [python, "-m", "align_anything.train", *overrides, *backend,
               f"output_dir={out}"]  # fmt: skip
    rss = run_child(command, env=env, log=out / "run.log")
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "phase" not in m]
    elapsed = [0.0] + [float(m["elapsed_seconds"]) for m in steps]
    seconds = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]
    return RunRecord(
        variant="align_anything vllm" if vllm else "align_anything", seconds=sum(seconds), step_seconds=seconds, tokens=0,
        peak_rss_mib=rss, first_step=steps[0], steps=steps,
        extra={
            "generation_tps": [m["generation/tokens_per_second"] for m in steps],
            "train_tps": [m["train/tokens_per_second"] for m in steps],
            "generation_share": sum(m["generation/seconds"] for m in steps) / sum(seconds),
            "reward": [m.get("reward", float("nan")) for m in steps],
        },
    )  # fmt: skip


def run_trl(
    args: argparse.Namespace, rows_path: Path, workdir: Path, env: dict, *, vllm: bool = False,
    spec: dict[str, Any] | None = None,
) -> RunRecord:  # fmt: skip
    """TRL's run in trl_child.py (`spec`: instead of `trl_spec(args, rows_path)`)."""
    out = Path(tempfile.mkdtemp(prefix="trl-", dir=workdir))
    spec_path = out / "spec.json"
    spec = trl_spec(args, rows_path) if spec is None else spec
    spec = {**spec, "output_dir": str(out), "use_vllm": vllm}
    spec_path.write_text(json.dumps(spec))
    python = str(VLLM_PYTHON) if vllm else sys.executable
    rss = run_child([python, str(TRL_CHILD), str(spec_path)], env=env, log=out / "run.log")
    result = json.loads((out / "result.json").read_text())
    seconds = result["step_seconds"]
    generation = result["generation"]  # one generate call per step: [seconds, completion, all]
    return RunRecord(
        variant="TRL vllm" if vllm else "TRL", seconds=sum(seconds), step_seconds=seconds,
        tokens=0, peak_rss_mib=rss,
        first_step=result["logs"][0], steps=result["logs"],
        extra={
            "generation_tps": [c / g for g, c, _ in generation],
            "train_tps": [t / max(s - g, 1e-9) for s, (g, _, t) in zip(seconds, generation,
                                                                        strict=False)],
            "generation_share": sum(g for g, _, _ in generation) / sum(seconds),
            "reward": [m.get("reward", float("nan")) for m in result["logs"]],
        },
    )  # fmt: skip


def tolerant(name: str, run: Any) -> Any:
    """A variant that may not run here (TRL's vLLM mode): its failure becomes a table row."""

    def attempt() -> RunRecord:
        try:
            return run()
        except SystemExit as err:
            reason = str(err).strip().splitlines()
            errors = [line for line in reason if "Error" in line or "error" in line]
            return RunRecord(
                variant=name, seconds=float("nan"), step_seconds=[], tokens=0,
                peak_rss_mib=float("nan"), first_step={},
                extra={"failed": (errors or reason or ["?"])[-1][:300]},
            )  # fmt: skip

    return attempt


def table(records: dict[str, list[RunRecord]], steps: int) -> str:
    header = ["", "steps/s", "generation tokens/s", "training tokens/s", "generation share",
              "peak RSS MiB", "mean reward"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    figures = {}
    for name, runs in records.items():
        failed = [r.extra["failed"] for r in runs if "failed" in r.extra]
        if failed:
            lines.append(f"| {name} | failed: {failed[0]} |" + " |" * (len(header) - 2))
            continue
        figures[name] = (
            median([steps / r.seconds for r in runs]),
            median([median(r.extra["generation_tps"]) for r in runs]),
            median([median(r.extra["train_tps"]) for r in runs]),
            median([r.extra["generation_share"] for r in runs]),
            median([r.peak_rss_mib for r in runs]),
            median([sum(r.extra["reward"]) / len(r.extra["reward"]) for r in runs]),
        )
        f = figures[name]
        lines.append(f"| {name} | {f[0]:.4f} | {f[1]:.1f} | {f[2]:.1f} | {f[3]:.0%} | {f[4]:.0f} "
                     f"| {f[5]:.3f} |")  # fmt: skip
    pairs = [
        (a, b) for a in figures for b in figures if a.startswith("align") and b.startswith("TRL")
    ]
    for a_name, b_name in pairs:
        a, b = figures[a_name], figures[b_name]
        lines.append(f"| {a_name} / {b_name} | {a[0] / b[0]:.2f}× | {a[1] / b[1]:.2f}× "
                     f"| {a[2] / b[2]:.2f}× | | {a[4] / b[4]:.2f} | |")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------- agreement on fixed completions


def fixed_completions(model: str, *, count: int = 2) -> dict[str, Any]:
    """Prompt and completion token ids (each completion ends with EOS) of `count` prompts ×
    FIXED_ANSWERS, and their group advantages under `arith_exact` (the GRPO trainer's)."""
    import torch

    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.language.prompts import encode_prompts
    from align_anything.families.zoo import resolve_model_path
    from align_anything.losses import group_advantages
    from align_anything.rewards import arith_exact

    tokenizer = load_tokenizer(resolve_model_path(model))
    records = [{"prompt": r["prompt"], "answer": r["answer"]} for r in prompt_rows(count)]
    encoded, _ = encode_prompts(records, tokenizer, max_prompt_length=256)
    prompt_ids, completion_ids, texts, answers = [], [], [], []
    for row, record in zip(encoded, records, strict=True):
        for template in FIXED_ANSWERS:
            text = template.format(a=record["answer"], b=record["answer"] + 1)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompt_ids.append(row["prompt_ids"])
            completion_ids.append([*ids, tokenizer.eos_token_id])
            texts.append(text)
            answers.append(record["answer"])
    rewards = torch.tensor(arith_exact([None] * len(texts), texts, answers))
    advantages = group_advantages(rewards, len(FIXED_ANSWERS), "group")
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "advantages": advantages.tolist(), "texts": texts}  # fmt: skip


def ours_score(model: str, fixed: dict[str, Any], *, loss_type: str = "dapo",
               max_completion_length: int = 16) -> dict[str, Any]:  # fmt: skip
    """align_anything's per-token log-probs and loss of the fixed completions: the batch the
    online trainer collates (prompt + completion, right-padded, labels on the completion) and
    the calls of `GRPOTrainer.compute_loss`, on the model in training mode."""
    import torch

    from align_anything.families.language import IGNORE_INDEX
    from align_anything.families.language.batches import Rows
    from align_anything.families.language.forward import completion_token_logps
    from align_anything.families.language.loading import load_model, load_tokenizer
    from align_anything.families.zoo import resolve_model_path
    from align_anything.losses import grpo_per_token_loss, loss_items, loss_sum

    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    net = load_model(path, dtype=torch.float32, reward=False)
    net.train()
    rows = list(zip(fixed["prompt_ids"], fixed["completion_ids"], strict=True))
    width = max(len(p) + len(c) for p, c in rows)
    longest = max(len(c) for _, c in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), IGNORE_INDEX)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), longest))
    for b, (prompt, completion) in enumerate(rows):
        ids = [*prompt, *completion]
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
        labels[b, len(prompt) : len(ids)] = torch.tensor(completion)
        mask[b, : len(completion)] = 1.0
    batch = Rows(input_ids, attention, labels)
    logps = completion_token_logps(net, batch, completion_only=True)
    per_token, _ = grpo_per_token_loss(
        logps, logps.detach(), torch.tensor(fixed["advantages"]), epsilon_low=0.2,
        epsilon_high=0.2,
    )  # fmt: skip
    total = loss_sum(
        per_token, mask, loss_type=loss_type, max_completion_length=max_completion_length
    )
    loss = total / max(loss_items(mask, loss_type=loss_type), 1)
    return {
        "logps": [row[: len(c)] for row, (_, c) in zip(logps.tolist(), rows, strict=True)],
        "loss": float(loss),
    }


def agreement(args: argparse.Namespace, workdir: Path, env: dict) -> str:
    fixed = fixed_completions(args.model)
    fixed_path = workdir / "fixed.json"
    fixed_path.write_text(json.dumps(fixed))
    rows_path = workdir / "trl-agreement.jsonl"
    write_jsonl(rows_path, prompt_rows(2))
    out = Path(tempfile.mkdtemp(prefix="trl-score-", dir=workdir))
    spec = {**trl_spec(args, rows_path), "task": "grpo_score", "steps": 1,
            "completions_path": str(fixed_path), "output_dir": str(out)}  # fmt: skip
    (out / "spec.json").write_text(json.dumps(spec))
    run_child(
        [sys.executable, str(TRL_CHILD), str(out / "spec.json")], env=env, log=out / "run.log"
    )
    theirs = json.loads((out / "result.json").read_text())
    ours_out = workdir / "ours-score.json"
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import grpo_vs_trl as g; "
            f"f = json.load(open({str(fixed_path)!r})); "
            f"json.dump(g.ours_score({args.model!r}, f, max_completion_length="
            f"{args.max_completion_length}), open({str(ours_out)!r}, 'w'))")  # fmt: skip
    run_child([sys.executable, "-c", code], env=env, log=workdir / "ours-score.log")
    ours = json.loads(ours_out.read_text())
    worst = max(abs(a - b) for x, y in zip(ours["logps"], theirs["logps"], strict=True)
                for a, b in zip(x, y, strict=True))  # fmt: skip
    tokens = sum(map(len, ours["logps"]))
    return (
        f"- agreement on {len(fixed['texts'])} fixed completions ({tokens} tokens, "
        f"{len(fixed['texts']) // len(FIXED_ANSWERS)} prompts × {FIXED_ANSWERS}): largest "
        f"per-token log-prob difference {worst:.2e}; loss ours {ours['loss']:.8f}, TRL "
        f"{theirs['loss']:.8f} (difference {abs(ours['loss'] - theirs['loss']):.2e})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--num-generations", type=int, default=8, help="G")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per side")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run")
    parser.add_argument("--rows", choices=sorted(REWARDS), default="arith",
                        help="arith: the built-in arithmetic prompts; hh: long multi-turn HH-RLHF prompts")  # fmt: skip
    parser.add_argument("--agreement-only", action="store_true")
    parser.add_argument("--vllm", action="store_true",
                        help="also both sides with vLLM colocated (needs .venv-vllm)")  # fmt: skip
    parser.add_argument("--only", nargs="*", default=None,
                        help="variants to run (align_anything, TRL, 'align_anything vllm', 'TRL vllm')")  # fmt: skip
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="aa-bench-grpo-"))
    env = child_env(args.threads)
    print(f"work folder {workdir}", flush=True)
    if not args.agreement_only:
        count, prompt_length = (
            args.steps * args.prompts,
            rl_prompt_length(args.rows, args.max_completion_length),
        )
        rows = (prompt_rows(count) if args.rows == "arith" else
                long_prompts(count, max_prompt_length=prompt_length, model=args.model))  # fmt: skip
        order = training_order(len(rows), batch=args.prompts, steps=args.steps)
        ours_file, trl_file = workdir / "ours.jsonl", workdir / "trl.jsonl"
        write_jsonl(ours_file, rows)
        write_jsonl(trl_file, [rows[i] for i in order])
        start = time.perf_counter()
        variants = {
            "align_anything": lambda: run_ours(args, ours_file, workdir, env),
            "TRL": lambda: run_trl(args, trl_file, workdir, env),
        }
        if args.vllm:
            if not VLLM_PYTHON.is_file():
                raise SystemExit(f"--vllm: no vLLM environment at {VLLM_PYTHON} (`make vllm`)")
            variants["align_anything vllm"] = lambda: run_ours(
                args, ours_file, workdir, env, vllm=True
            )
            variants["TRL vllm"] = tolerant(
                "TRL vllm", lambda: run_trl(args, trl_file, workdir, env, vllm=True)
            )
        if args.only:
            variants = {k: v for k, v in variants.items() if k in args.only}
        print(f"load average at the start: {os.getloadavg()}", flush=True)
        records = interleave(variants, args.repeats)
        print(f"\nload average at the end: {os.getloadavg()}; {time.perf_counter() - start:.0f} s")
        print(f"{args.model}, {args.rows} rows, {args.steps} steps × {args.prompts} prompts × "
              f"G={args.num_generations}, max_completion_length {args.max_completion_length}, "
              f"dapo, beta 0, reward {REWARDS[args.rows]}")  # fmt: skip
        print(table(records, args.steps))
    print(agreement(args, workdir, env))


if __name__ == "__main__":
    main()

"""PPO throughput and memory, side by side: align_anything's task=ppo against TRL's last
PPOTrainer (TRL 1.12.0, `trl.experimental.ppo`; TRL 1.13 removed it) on the same work.

    python benchmarks/ppo_vs_trl.py --trl-python /work/venv-trl-ppo/bin/python   # SmolLM2, 4 steps
    python benchmarks/ppo_vs_trl.py --model tiny-random-llama --steps 2 --repeats 1 ...  # quick
    python benchmarks/ppo_vs_trl.py --rows hh --steps 2 --batch 8 --repeats 1 ...  # long prompts

TRL 1.12 cannot share this project's environment (it holds TRL 1.16, without PPOTrainer): its
side runs in another interpreter (`--trl-python`), e.g. a venv made like this, which reuses this
environment's packages (torch, transformers, ...) and adds only TRL 1.12:

    python -m venv /work/venv-trl-ppo
    echo "$PWD/.venv/lib/python3.11/site-packages" > /work/venv-trl-ppo/lib/python3.11/site-packages/base.pth
    /work/venv-trl-ppo/bin/pip install --no-deps trl==1.12.0

The same work on both sides: the policy (fp32 on CPU), a frozen reference, a critic started
from the reward model and the reward model itself (`--reward-model`, a task=rm folder; default:
the policy with a new seeded one-output head, an untrained reward model: the timing does not
depend on its training), the same prompts (the first steps × batch rows of the built-in
arith-prompts, encoded once by align_anything and given to TRL as `input_ids`, in
align_anything's order), one completion per prompt (TRL's PPO samples one), the same
`response_length` / `max_completion_length`, temperature 1, KL coefficient, clip ranges, γ, λ,
one pass over each rollout in one mini-batch (one optimizer step per rollout), the same
learning rate and torch AdamW. Differences that remain: TRL trains the policy and the value
head in one optimizer (its `vf_coef` weighs the value loss), align_anything in two engines
(each its own AdamW); TRL scores the policy's token ids with the reward model, align_anything
re-renders the text through the reward model's chat template; the two sample differently
(align_anything draws each completion from its own seeded generator). One process each,
interleaved repeats, peak RSS from `wait4`; the table shows medians and ours/TRL ratios.

`--rows hh`: the long rows' prompts instead of arith-prompts (`common.long_pairs`: multi-turn
HH-RLHF conversations up to their last user turn, at most 512 − max_completion_length
tokens), as `grpo_vs_trl.py --rows hh`.
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

SETTINGS = {
    "kl_coef": 0.05, "epsilon": 0.2, "value_clip": 0.2, "gamma": 1.0, "lam": 0.95,
    "temperature": 1.0,
}  # fmt: skip


def prompt_rows(count: int) -> list[dict[str, Any]]:
    rows = read_jsonl(builtin_path("arith-prompts"))[:count]
    if len(rows) < count:
        raise SystemExit(f"arith-prompts has {len(rows)} rows, fewer than the {count} asked for")
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]


def default_reward_model(model: str, folder: Path) -> Path:
    """The policy with a new one-output score head (seeded): an untrained reward model."""
    import torch

    from align_anything.families import zoo
    from align_anything.families.language import loading

    path = zoo.resolve_model_path(model)
    tokenizer = loading.load_tokenizer(path)
    torch.manual_seed(SEED)
    reward = loading.load_model(path, reward=True, dtype=torch.float32)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def ours_overrides(args: argparse.Namespace, data: Path, reward_model: Path) -> list[str]:
    s = SETTINGS
    return [
        "task=ppo", "deepspeed=z0", f"model.name_or_path={args.model}", f"data.path={data}",
        "data.eval_path=null", "data.eval_fraction=0",
        f"data.max_length={rl_prompt_length(args.rows, args.max_completion_length)}",
        f"train.max_steps={args.steps}", f"train.per_device_batch_size={args.batch}",
        "train.gradient_accumulation_steps=1", f"train.learning_rate={args.learning_rate}",
        "train.lr_scheduler=constant", "train.weight_decay=0", "train.max_grad_norm=1.0",
        "train.precision=fp32", f"train.seed={SEED}", "checkpoint.save_final=false",
        "logging.backends=[jsonl]", "logging.completions_every=0", "reward.functions=[]",
        f"reward.model={reward_model}", "ppo.critic_init=reward_model",
        f"ppo.critic_learning_rate={args.learning_rate}", "ppo.num_generations=1",
        f"ppo.max_completion_length={args.max_completion_length}",
        f"ppo.temperature={s['temperature']}", "ppo.num_ppo_epochs=1", "ppo.num_mini_batches=1",
        f"ppo.kl_coef={s['kl_coef']}", f"ppo.epsilon={s['epsilon']}",
        f"ppo.value_clip={s['value_clip']}", f"ppo.gamma={s['gamma']}", f"ppo.lam={s['lam']}",
        "ppo.reward_clip=null", "ppo.eval_samples=0",
    ]  # fmt: skip


def run_ours(args: argparse.Namespace, data: Path, reward_model: Path, workdir: Path,
             env: dict) -> RunRecord:  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="ours-", dir=workdir))
    command = [sys.executable, "-m", "align_anything.train",
               *ours_overrides(args, data, reward_model), f"output_dir={out}"]  # fmt: skip
    rss = run_child(command, env=env, log=out / "run.log")
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "phase" not in m]
    elapsed = [0.0] + [float(m["elapsed_seconds"]) for m in steps]
    seconds = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]
    return RunRecord(
        variant="align_anything", seconds=sum(seconds), step_seconds=seconds, tokens=0,
        peak_rss_mib=rss, first_step=steps[0], steps=steps,
        extra={"score": [m.get("reward", float("nan")) for m in steps]},
    )  # fmt: skip


# ---------------------------------------------------------------------------- TRL's side


def trl_child(spec_path: str) -> None:
    """TRL 1.12's PPOTrainer on the spec's encoded prompts (run in the TRL interpreter)."""
    import datasets
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    policy = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    scorer = dict(num_labels=1, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"], **scorer)
    value = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"], **scorer)
    dataset = datasets.Dataset.from_dict({"input_ids": spec["prompt_ids"]})
    config = PPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=1,
        total_episodes=spec["batch"] * spec["steps"],
        local_rollout_forward_batch_size=spec["batch"], response_length=spec["max_completion_length"],
        temperature=spec["temperature"], stop_token="eos", missing_eos_penalty=None,
        kl_coef=spec["kl_coef"], cliprange=spec["epsilon"], cliprange_value=spec["value_clip"],
        gamma=spec["gamma"], lam=spec["lam"], learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch_fused", seed=spec["seed"], num_sample_generations=0,
        report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, bf16=False,
        dataloader_num_workers=0,
    )  # fmt: skip
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter())

    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=reference,
        reward_model=reward, value_model=value, train_dataset=dataset, callbacks=[Clock()],
    )  # fmt: skip
    times.append(time.perf_counter())
    trainer.train()
    logs = [m for m in trainer.state.log_history if "objective/scores" in m]
    seconds = [b - a for a, b in zip(times, times[1:], strict=False)]
    (Path(spec["output_dir"]) / "result.json").write_text(
        json.dumps({"step_seconds": seconds, "logs": logs})
    )


def run_trl(args: argparse.Namespace, prompt_ids: list[list[int]], reward_model: Path,
            workdir: Path, env: dict) -> RunRecord:  # fmt: skip
    from align_anything.families.zoo import resolve_model_path

    out = Path(tempfile.mkdtemp(prefix="trl-", dir=workdir))
    spec = {
        "model_path": str(resolve_model_path(args.model)), "reward_model": str(reward_model),
        "prompt_ids": prompt_ids, "batch": args.batch, "steps": args.steps,
        "max_completion_length": args.max_completion_length, "learning_rate": args.learning_rate,
        "seed": SEED, "output_dir": str(out), **SETTINGS,
    }  # fmt: skip
    (out / "spec.json").write_text(json.dumps(spec))
    trl_env = {**env, "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": ""}
    command = [args.trl_python, str(Path(__file__).resolve()), "--child", str(out / "spec.json")]
    rss = run_child(command, env=trl_env, log=out / "run.log")
    result = json.loads((out / "result.json").read_text())
    seconds = result["step_seconds"]
    return RunRecord(
        variant="TRL", seconds=sum(seconds), step_seconds=seconds, tokens=0, peak_rss_mib=rss,
        first_step=result["logs"][0], steps=result["logs"],
        extra={"score": [m["objective/scores"] for m in result["logs"]]},
    )  # fmt: skip


def table(records: dict[str, list[RunRecord]], steps: int) -> str:
    header = ["", "steps/s", "peak RSS MiB", "mean score"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    figures = {}
    for name, runs in records.items():
        figures[name] = (
            median([steps / r.seconds for r in runs]),
            median([r.peak_rss_mib for r in runs]),
            median([sum(r.extra["score"]) / len(r.extra["score"]) for r in runs]),
        )
        f = figures[name]
        lines.append(f"| {name} | {f[0]:.4f} | {f[1]:.0f} | {f[2]:.3f} |")
    if len(figures) == 2:
        a, b = figures["align_anything"], figures["TRL"]
        lines.append(f"| ours/TRL | {a[0] / b[0]:.2f}× | {a[1] / b[1]:.2f} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument(
        "--reward-model", default=None, help="a task=rm folder (default: see above)"
    )
    parser.add_argument("--steps", type=int, default=4, help="rollouts = optimizer steps per run")
    parser.add_argument("--batch", type=int, default=16, help="prompts (= completions) per step")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per side")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run")
    parser.add_argument("--rows", choices=("arith", "hh"), default="arith",
                        help="arith: the built-in arithmetic prompts; hh: long multi-turn HH-RLHF prompts")  # fmt: skip
    parser.add_argument("--trl-python", default="/work/venv-trl-ppo/bin/python",
                        help="an interpreter with trl==1.12.0 (see above)")  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        trl_child(args.child)
        return
    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.language.prompts import encode_prompts
    from align_anything.families.zoo import resolve_model_path

    workdir = Path(tempfile.mkdtemp(prefix="aa-bench-ppo-"))
    env = child_env(args.threads)
    print(f"work folder {workdir}", flush=True)
    reward_model = Path(args.reward_model) if args.reward_model else default_reward_model(
        args.model, workdir / "reward-model"
    )  # fmt: skip
    count, prompt_length = (
        args.steps * args.batch,
        rl_prompt_length(args.rows, args.max_completion_length),
    )
    rows = (prompt_rows(count) if args.rows == "arith" else
            long_prompts(count, max_prompt_length=prompt_length, model=args.model))  # fmt: skip
    order = training_order(len(rows), batch=args.batch, steps=args.steps)
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    encoded, _ = encode_prompts([rows[i] for i in order], tokenizer,
                                max_prompt_length=prompt_length)  # fmt: skip
    ours_file = workdir / "ours.jsonl"
    write_jsonl(ours_file, rows)
    start = time.perf_counter()
    records = interleave(
        {"align_anything": lambda: run_ours(args, ours_file, reward_model, workdir, env),
         "TRL": lambda: run_trl(args, [r["prompt_ids"] for r in encoded], reward_model,
                                workdir, env)},
        args.repeats,
    )  # fmt: skip
    print(f"\nload average at the end: {os.getloadavg()}; {time.perf_counter() - start:.0f} s")
    print(f"{args.model}, {args.rows} rows, {args.steps} steps x {args.batch} prompts x 1 completion, "
          f"max_completion_length {args.max_completion_length}, critic and reference, E=1, M=1")  # fmt: skip
    print(table(records, args.steps))


if __name__ == "__main__":
    main()

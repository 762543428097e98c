"""One-GPU throughput and model FLOPs utilisation (MFU): bf16 SFT and DPO of a ~0.7B Llama built
from config, under ZeRO-2 and ZeRO-3, through align_anything's real entry point.

    bash benchmarks/gpu.sh                      # on a one-GPU machine; under 10 minutes
    python benchmarks/gpu_bench.py --tiny       # CPU dry run of the same path (tiny model, fp32)

The model (hidden 1536, 24 layers, 12 heads / 4 KV heads, MLP 4096, SmolLM2's tokenizer and its
49152-token vocabulary, random weights) is written once to a temporary folder. SFT rows are
single-turn conversations cut to exactly `--seq-len` tokens (`data.truncation=truncate_completion`);
DPO pairs have two answers of about a fifth of that and a prompt cut from the left to fill the
rest (`truncate_prompt`).

MFU = model FLOPs per second / the device's dense bf16 peak, with model FLOPs per trained token
= 6·N + 12·layers·hidden·seq_len (N: every parameter, the tied embedding counted once, as the LM
head's matmul; the attention term is PaLM's convention, Chowdhery et al. 2022, appendix B).
Tokens/s are the trainer's own logged figure (real tokens per second of the step loop, median
of the steps after the first two); for DPO with the shared prompt that counts each pair's
prompt once, the tokens actually computed. The reference log-prob pass is not in the step loop.

The presets are the shipped ones (`deepspeed=z2`, `deepspeed=z3`) and the optimizer
align_anything's default, torch's fused AdamW (nothing to compile on the GPU machine).
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
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Dense bf16 peak TFLOPS by a name fragment of torch.cuda.get_device_name() (first match wins).
PEAK_BF16_TFLOPS = [
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("GH200", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0),
    ("A10G", 70.0), ("A10", 125.0), ("L4", 121.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0),
]  # fmt: skip

FULL_MODEL = {"hidden_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 12,
              "num_key_value_heads": 4, "intermediate_size": 4096}  # fmt: skip
TINY_MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128}  # fmt: skip


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device from the table, or None when it is not listed."""
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment.lower() in device_name.lower():
            return tflops
    return None


def flops_per_token(num_params: int, *, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6·N + 12·layers·hidden·seq_len."""
    return 6.0 * num_params + 12.0 * layers * hidden * seq_len


def build_model(folder: Path, shape: dict[str, int], *, seed: int = 0) -> int:
    """Write a random Llama of `shape` with SmolLM2's tokenizer to `folder`; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def long_text(words: int, offset: int) -> str:
    return " ".join(str((offset + 7 * i) % 1000) for i in range(words))


def write_data(folder: Path, *, seq_len: int, rows: int) -> tuple[Path, Path]:
    """SFT conversations longer than `seq_len` (cut to it when encoded) and DPO pairs whose
    answers take about a fifth of `seq_len` each and whose prompt is longer than the rest (cut
    from the left when encoded, so each pair fills `seq_len` with its longer answer)."""
    sft, dpo = folder / "sft.jsonl", folder / "dpo.jsonl"
    # SmolLM2's tokenizer splits digits: a number word is 3-4 tokens; err on the long side.
    with open(sft, "w") as f:
        for i in range(rows):
            messages = [
                {"role": "user", "content": f"Continue the sequence {i}."},
                {"role": "assistant", "content": long_text(seq_len, i)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    with open(dpo, "w") as f:
        for i in range(rows):
            f.write(json.dumps({
                "prompt": long_text(seq_len // 2, i),
                "chosen": long_text(seq_len // 16, i + 1),
                "rejected": long_text(seq_len // 16, i + 2),
            }) + "\n")  # fmt: skip
    return sft, dpo


def run(
    task: str, stage: int, *, model: Path, data: Path, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """One training run through the entry point; its logged tokens/s (median after warm-up)."""
    overrides = [
        f"task={task}", f"deepspeed=z{stage}", f"model.name_or_path={model}",
        f"data.path={data}", "data.eval_path=null", "data.eval_fraction=0",
        f"data.max_length={args.seq_len}",
        f"data.truncation={'truncate_completion' if task == 'sft' else 'truncate_prompt'}",
        f"train.max_steps={args.steps}", f"train.per_device_batch_size={args.micro_batch}",
        f"train.precision={'fp32' if args.tiny else 'bf16'}", "train.lr_scheduler=constant",
        "checkpoint.save_final=false", "logging.backends=[jsonl]", f"output_dir={out}",
    ]  # fmt: skip
    if task == "dpo":
        overrides += ["dpo.rpo_alpha=0", "dpo.generation_check_samples=0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "align_anything.train", *overrides],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.run_timeout,
    )  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"error": f"exit {proc.returncode}", "log_tail": tail, "wall_s": wall}
    steps = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip() and "phase" not in json.loads(line)
    ]
    timed = steps[2:] or steps
    return {
        "tokens_per_second": statistics.median(s["tokens_per_second"] for s in timed),
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "steps": len(steps),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model, fp32")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 (tiny: 128)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 8 (tiny: 2)")
    parser.add_argument("--steps", type=int, default=None, help="default 10 (tiny: 3)")
    parser.add_argument("--stages", default="2,3", help="ZeRO stages to run")
    parser.add_argument("--tasks", default="sft,dpo")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds per run")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (128 if args.tiny else 2048)
    args.micro_batch = args.micro_batch or (2 if args.tiny else 8)
    args.steps = args.steps or (3 if args.tiny else 10)

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("no CUDA device: run on a GPU machine, or try --tiny on CPU")
    peak = peak_tflops(device) if device != "cpu" else None
    shape = TINY_MODEL if args.tiny else FULL_MODEL
    work = Path(tempfile.mkdtemp(prefix="aa-gpu-bench-"))
    num_params = build_model(work / "model", shape)
    rows = args.micro_batch * (args.steps + 1)
    data = dict(zip(("sft", "dpo"), write_data(work, seq_len=args.seq_len, rows=rows), strict=True))
    per_token = flops_per_token(
        num_params, layers=shape["num_hidden_layers"], hidden=shape["hidden_size"],
        seq_len=args.seq_len,
    )  # fmt: skip
    print(f"device {device} (peak {peak or 'unknown'} TFLOPS bf16); model {num_params / 1e9:.3f} B "
          f"parameters; seq_len {args.seq_len}, micro batch {args.micro_batch}, {args.steps} steps; "
          f"work folder {work}", flush=True)  # fmt: skip
    results = []
    for task in args.tasks.split(","):
        for stage in (int(s) for s in args.stages.split(",")):
            out = work / f"{task}-z{stage}"
            result = run(task, stage, model=work / "model", data=data[task], args=args, out=out)
            result.update(task=task, stage=stage)
            if "tokens_per_second" in result:
                tflops = result["tokens_per_second"] * per_token / 1e12
                result["model_tflops"] = tflops
                result["mfu"] = tflops / peak if peak else None
            results.append(result)
            print(json.dumps(result), flush=True)
    lines = ["| task | ZeRO | tokens/s | model TFLOPS | MFU | first → last loss | run wall s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if "error" in r:
            lines.append(f"| {r['task']} | {r['stage']} | {r['error']} | | | | {r['wall_s']:.0f} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        lines.append(
            f"| {r['task']} | {r['stage']} | {r['tokens_per_second']:.0f} | "
            f"{r['model_tflops']:.1f} | {mfu} | {r['loss_first']:.3f} → {r['loss_last']:.3f} | "
            f"{r['wall_s']:.0f} |"
        )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"device": device, "results": results}, indent=2))
    if any("error" in r for r in results):
        for r in results:
            if "error" in r:
                print(f"--- {r['task']} z{r['stage']} failed:\n{r['log_tail']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

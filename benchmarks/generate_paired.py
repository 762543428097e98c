"""Rollout generation, paired in one process: the built-in generator's decode loop
(`training.decode.sample_completions`, what `rollout.backend=hf` runs for text prompts) against
`transformers`' `generate` called the way TRL 1.16's GRPOTrainer calls it without vLLM (each
prompt repeated G times, left-padded, `do_sample=True`), on the same prompts and weights.

    python benchmarks/generate_paired.py                          # 2 prompts × G=8, 16 tokens
    python benchmarks/generate_paired.py --prompts 4 --max-new-tokens 32 --pairs 5

The two alternate (ours, HF, ours, HF, …) in one process on one thread, so a machine shared with
other work slows both alike; each pair's ratio is printed and the median is the figure.
Completions differ (each side samples with its own generators), so the rate is completion
tokens per second: every token a completion holds, its stop token included.
Prompts: the first rows of the built-in `arith-prompts` (a worked example and a question,
~100 tokens through SmolLM2's chat template), rendered with the generation prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from common import MODEL, REPO_ROOT, read_jsonl

sys.path.insert(0, str(REPO_ROOT))

from align_anything.data.builtin import builtin_path


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    rows = read_jsonl(builtin_path("arith-prompts"))[:count]
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def ours(model, tokenizer, prompts: list[list[int]], g: int, tokens: int, seed: int) -> int:
    """The decode loop with per-completion generators; returns completion tokens."""
    from align_anything.generation.decode import row_sampler, sample_completions

    generators = [torch.Generator().manual_seed(seed + k) for k in range(len(prompts) * g)]
    out = sample_completions(
        model, prompts, g, sample=row_sampler(generators, temperature=1.0, top_p=1.0),
        max_new_tokens=tokens, stop=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id,
        device=torch.device("cpu"),
    )  # fmt: skip
    return sum(len(ids) for ids in out)


def hf_generate(model, tokenizer, prompts: list[list[int]], g: int, tokens: int, seed: int) -> int:
    """`generate` on G left-padded copies of each prompt, sampling as TRL 1.16 asks for it;
    returns completion tokens (up to and including each one's EOS)."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    width = max(map(len, prompts))
    rows = [p for p in prompts for _ in range(g)]
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(rows):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
    )  # fmt: skip
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                         disable_compile=True)[:, width:]  # fmt: skip
    count = 0
    for row in out.tolist():
        count += next((k + 1 for k, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=8, help="G")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=3, help="ours/HF pairs, alternating")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from align_anything.families import zoo
    from align_anything.families.language import loading

    path = zoo.resolve_model_path(args.model)
    tokenizer = loading.load_text_side(path, trust_remote_code=False)[1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = prompt_ids(tokenizer, args.prompts)
    g, tokens = args.num_generations, args.max_new_tokens
    print(f"{args.model} fp32, {args.threads} thread(s), {len(prompts)} prompts of "
          f"{[len(p) for p in prompts]} tokens × G={g}, at most {tokens} new tokens; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    with torch.no_grad():
        ours(model, tokenizer, prompts, g, 2, 0)  # warm-up: first-call allocations
        hf_generate(model, tokenizer, prompts, g, 2, 0)
    ratios, rates = [], {"ours": [], "hf": []}
    for pair in range(args.pairs):
        figures = {}
        for name, fn in (("ours", ours), ("hf", hf_generate)):
            start = time.perf_counter()
            with torch.no_grad():
                count = fn(model, tokenizer, prompts, g, tokens, 1000 * pair)
            seconds = time.perf_counter() - start
            figures[name] = count / seconds
            rates[name].append(figures[name])
            print(f"  pair {pair + 1} {name:4s} {count:4d} tokens in {seconds:6.2f} s: "
                  f"{figures[name]:7.1f} tokens/s", flush=True)  # fmt: skip
        ratios.append(figures["ours"] / figures["hf"])
    print(f"\ntokens/s inside generation, median of {args.pairs} pairs: ours "
          f"{statistics.median(rates['ours']):.1f}, HF generate (as TRL calls it) "
          f"{statistics.median(rates['hf']):.1f}; ours/HF per pair "
          f"{', '.join(f'{r:.2f}x' for r in ratios)}, median {statistics.median(ratios):.2f}x; "
          f"load average at the end {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

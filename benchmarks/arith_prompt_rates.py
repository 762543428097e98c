"""How often a model already answers the built-in RL prompts exactly (`arith-prompts-eval`):
the measurement behind the prompts' format hint (`align_anything.data.builtin.PROMPT_HINT`).

    python benchmarks/arith_prompt_rates.py                    # the shipped prompts
    python benchmarks/arith_prompt_rates.py --variant hint_only   # the hint alone, no worked example
    python benchmarks/arith_prompt_rates.py --variant system      # the hint as a system prompt

Prints, for the base model (fp32, CPU): the greedy exact-answer rate on the 64 held-out prompts
(and per question kind), the mean `arith_format` reward, and for sampled completions
(temperature 1.0, top_p 1.0, G per prompt) the exact rate and the share of groups whose reward
has a nonzero spread — the groups GRPO and RLOO can learn from. Not a test: sampling and speed
depend on the machine. Figures: docs/tasks/grpo.md (the RL main job) and builtin.PROMPT_HINT.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from align_anything.data.builtin import PROMPT_HINT, generate
from align_anything.families.zoo import resolve_model_path
from align_anything.rewards import arith_exact, arith_format


def _variant(prompt: list[dict], variant: str) -> list[dict]:
    if variant == "shipped":
        return prompt
    question = prompt[-1]["content"]
    if variant == "hint_only":
        return [{"role": "user", "content": question}]
    return [
        {"role": "system", "content": PROMPT_HINT.strip()},
        {"role": "user", "content": question.removesuffix(PROMPT_HINT)},
    ]


def _complete(model, tokenizer, prompts, *, sample: bool, copies: int, max_new_tokens: int):
    texts = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = (
        {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
        if sample
        else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            **encoded, max_new_tokens=max_new_tokens, num_return_sequences=copies,
            pad_token_id=tokenizer.pad_token_id, **sampling,
        )  # fmt: skip
    return tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--variant", choices=("shipped", "hint_only", "system"), default="shipped")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sampled-prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8, help="G per sampled prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = generate()["arith-prompts-eval"]
    prompts = [_variant(row["prompt"], args.variant) for row in rows]
    answers = [row["answer"] for row in rows]

    greedy = []
    for start in range(0, len(prompts), 16):
        greedy += _complete(model, tokenizer, prompts[start : start + 16], sample=False, copies=1,
                            max_new_tokens=args.max_new_tokens)  # fmt: skip
    exact = arith_exact(prompts, greedy, answers)
    by_kind = {
        kind: sum(e for e, row in zip(exact, rows, strict=True) if row["question"] == kind)
        / sum(row["question"] == kind for row in rows)
        for kind in sorted({row["question"] for row in rows})
    }

    torch.manual_seed(args.seed)
    n, g = args.sampled_prompts, args.generations
    sampled = []
    for start in range(0, n, 4):
        sampled += _complete(model, tokenizer, prompts[start : min(start + 4, n)], sample=True,
                             copies=g, max_new_tokens=args.max_new_tokens)  # fmt: skip
    repeated = [a for a in answers[:n] for _ in range(g)]
    sampled_exact = torch.tensor(arith_exact([], sampled, repeated)).view(n, g)
    sampled_format = torch.tensor(arith_format([], sampled)).view(n, g)
    shaped = sampled_exact + 0.5 * sampled_format
    print(json.dumps({
        "model": args.model, "variant": args.variant, "max_new_tokens": args.max_new_tokens,
        "greedy_exact": sum(exact) / len(exact), "greedy_exact_by_kind": by_kind,
        "greedy_format": sum(arith_format([], greedy)) / len(greedy),
        "sampled_exact": sampled_exact.mean().item(),
        "sampled_format": sampled_format.mean().item(),
        "groups_with_exact_spread": (sampled_exact.std(1) > 0).float().mean().item(),
        "groups_with_exact_plus_half_format_spread": (shaped.std(1) > 0).float().mean().item(),
        "greedy_examples": greedy[:4],
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

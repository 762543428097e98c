"""Datasets the project generates and ships (no copied text); see `generate` below.

`python -m align_anything.data.builtin` rewrites the shipped files under `builtin/` from a fixed
seed; a test checks the shipped files equal `generate()`'s output byte for byte.

The preference data is built so that learning is visible and checkable:

- Questions are small number questions the model can answer by looking at the prompt: "Which is
  larger, 56 or 20?" and "What number comes after 41?".
- `chosen` is always the terse, correct answer in one fixed format, `Answer: 56`.
- `rejected` is one of three things (`kind` says which; see `REJECTED_CYCLE`):
  - `format` (half): the same correct number, but in the chatty style SmolLM2-135M-Instruct
    produces on its own ("To determine which is larger, ... 56 is larger than 20.");
  - `wrong` (a quarter): the preferred format with a subtly wrong number (`Answer: 20`, the
    other number; or an off-by-one successor);
  - `extra` (a quarter): the right answer followed by more words (`Answer: 56. I hope this
    helps!`). Without these the tuned model learns the prefix but stops stopping after it.
- `has_preferred_property(row, generated)` is the generation check: the greedy answer must be
  exactly `Answer: <the right number>`. The untrained model never answers in that format, so a
  rise in that share after training is learning, not prior behaviour.

Files: `arith-pref` (96 rows: 12 steps of 8 pairs is one epoch), the held-out `arith-pref-eval`
(64 rows; its questions appear in no other file), `arith-sft` (256 conversations whose
assistant turn is the preferred answer, for the `task=sft` default) and `arith-kto` (the
`arith-pref` pairs as 192 unpaired rows, `prompt` + `completion` + `label`, shuffled: for the
`task=kto` default; each pair's chosen answer is a desirable row, its rejected one an
undesirable row). These sizes are what
lets the main job learn the format in 12 steps on 2 CPU cores (docs/tasks/dpo.md).

For online RL (`task=grpo`, `task=rloo`): `arith-prompts` (512 prompts) and the held-out
`arith-prompts-eval` (64), prompt-only rows `{"prompt": [messages], "answer", "question"}` whose
questions are in no other file. The prompt is a worked example exchange then the question, each
with a format hint (`PROMPT_HINT`, `PROMPT_EXAMPLE`: chosen by measuring the base model, see
there); `rewards.arith_exact` scores a completion against `answer`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).parent / "builtin"

# name -> file under BUILTIN_DIR. `data.path=<name>` selects one.
BUILTIN_DATASETS: dict[str, str] = {
    "arith-pref": "arith_pref_train.jsonl",
    "arith-pref-eval": "arith_pref_eval.jsonl",
    "arith-sft": "arith_sft.jsonl",
    "arith-kto": "arith_kto_train.jsonl",
    "arith-prompts": "arith_prompts_train.jsonl",
    "arith-prompts-eval": "arith_prompts_eval.jsonl",
    # The text-to-image family's shapes world (`families/text_to_image/shapes.py` writes them).
    "t2i-shapes": "t2i_shapes_train.parquet",
    "t2i-shapes-val": "t2i_shapes_val.parquet",
    "t2i-shapes-pref": "t2i_shapes_pref_train.parquet",
    "t2i-shapes-eval": "t2i_shapes_eval.parquet",
    "t2i-shapes-pref-eval": "t2i_shapes_pref_eval.parquet",
    # The text-to-video family's moving shapes (`families/text_to_video/motion.py` writes them).
    "t2v-shapes": "t2v_shapes_train.parquet",
    "t2v-shapes-pref": "t2v_shapes_pref_train.parquet",
    "t2v-shapes-eval": "t2v_shapes_eval.parquet",
    "t2v-shapes-pref-eval": "t2v_shapes_pref_eval.parquet",
    # The text-to-audio family's tones (`families/text_to_audio/tones.py` writes them; the sets
    # name FLAC files under `t2a_tones/`, relative to the set).
    "t2a-tones": "t2a_tones_train.parquet",
    "t2a-tones-pref": "t2a_tones_pref_train.parquet",
    "t2a-tones-eval": "t2a_tones_eval.parquet",
    "t2a-tones-pref-eval": "t2a_tones_pref_eval.parquet",
    # Questions about pictures of the shapes world, for image-text models
    # (`families/text_to_image/shapes_vqa.py` writes them).
    "shapes-vqa": "shapes_vqa_train.parquet",
    "shapes-vqa-eval": "shapes_vqa_eval.parquet",
    "shapes-vqa-pref": "shapes_vqa_pref_train.parquet",
    "shapes-vqa-pref-eval": "shapes_vqa_pref_eval.parquet",
    "shapes-vqa-prompts": "shapes_vqa_prompts_train.parquet",
    "shapes-vqa-prompts-eval": "shapes_vqa_prompts_eval.parquet",
    # Questions about clips of the tones world, for audio-text models
    # (`families/text_to_audio/tones_qa.py` writes them; FLAC bytes embedded).
    "tones-qa": "tones_qa_train.parquet",
    "tones-qa-eval": "tones_qa_eval.parquet",
    "tones-qa-pref": "tones_qa_pref_train.parquet",
    "tones-qa-pref-eval": "tones_qa_pref_eval.parquet",
    "tones-qa-prompts": "tones_qa_prompts_train.parquet",
    "tones-qa-prompts-eval": "tones_qa_prompts_eval.parquet",
}
ARITH_DATASETS = tuple(name for name in BUILTIN_DATASETS if name.startswith("arith-"))

SEED = 20250601
PREF_TRAIN_ROWS = 96  # 12 steps of 8 pairs: one epoch is the default run
PREF_EVAL_ROWS = 64
SFT_ROWS = 256
PROMPT_TRAIN_ROWS = 512
PROMPT_EVAL_ROWS = 64
# The prompt sets' format hint: appended to each question, and shown once, worked, in a first
# exchange (`PROMPT_EXAMPLE`, a question outside the generator's range, so in no file). Measured
# on the base smollm2-135m-instruct (64 held-out prompts, greedy, fp32, 32 new tokens; sampled
# at temperature 1.0, G = 8, 16 prompts): the hint alone in the user turn, in three wordings or
# as a system prompt, gives 0.00 exact answers greedy and sampled (the model answers chattily);
# with the worked example, greedy exact 0.34 (format 1.00), sampled exact 0.18, and 75% of
# groups have a nonzero exact-reward std (100% with 0.5 x arith_format added): something to learn.
PROMPT_HINT = " Reply with `Answer: <number>` only."
PROMPT_EXAMPLE = ("What number comes after 1234?", "Answer: 1235")

ANSWER_RE = re.compile(r"Answer: (-?\d+)")

# The questions of the `shapes-vqa` sets, by kind (`families/text_to_image/shapes_vqa.py`).
SHAPES_VQA_KINDS = ("colour", "count", "shape")


def builtin_path(name: str) -> Path | None:
    """The shipped file for a built-in dataset name, or None when `name` is not built in."""
    filename = BUILTIN_DATASETS.get(name)
    return BUILTIN_DIR / filename if filename else None


def preferred_answer(answer: int) -> str:
    """The preferred completion for a question whose right answer is `answer`."""
    return f"Answer: {answer}"


def has_preferred_property(row: dict, generated: str) -> bool:
    """True when `generated` (the decoded completion, special tokens removed) is exactly the
    preferred answer for `row`: `Answer: <row["answer"]>`, nothing before or after it except
    surrounding whitespace. A right number in another format, a wrong number, or extra words
    all count as False."""
    match = ANSWER_RE.fullmatch(generated.strip())
    return match is not None and int(match.group(1)) == int(row["answer"])


def shapes_answer_matches(answer: Any, generated: str) -> bool:
    """True when `generated` is exactly the one-word `answer` of a `shapes-vqa` question
    ("red", "3", "circle"): compared in lower case, without surrounding white space and without
    one final full stop. "Red." passes; "3 circles", "three" and "red and blue" do not."""
    text = generated.strip().lower()
    text = text[:-1].rstrip() if text.endswith(".") else text
    return answer is not None and text == str(answer).strip().lower()


def shapes_vqa_check(row: dict, generated: str) -> bool:
    """The generation check of the `shapes-vqa` sets: `shapes_answer_matches` on the row's
    `answer`."""
    return shapes_answer_matches(row.get("answer"), generated)


# --- question kinds -------------------------------------------------------------------------
# Each kind draws one question from `rng` and returns (key, prompt, answer, wrong, chatty): `key`
# identifies the question (for the train/eval split), `wrong` is a subtly wrong answer and
# `chatty` the right answer in the model's own verbose style.


def _larger(rng: random.Random) -> tuple[tuple, str, int, int, str]:
    a, b = rng.sample(range(10, 100), 2)
    big, small = max(a, b), min(a, b)
    chatty = rng.choice(
        [
            f"To determine which is larger, we compare {a} and {b}. {big} is larger than {small}.",
            f"The larger number is {big}, because {big} is greater than {small}.",
            f"{big} is larger than {small}.",
        ]
    )
    return ("larger", a, b), f"Which is larger, {a} or {b}?", big, small, chatty


def _after(rng: random.Random) -> tuple[tuple, str, int, int, str]:
    a = rng.randint(10, 998)
    wrong = rng.choice([a, a + 2])
    chatty = rng.choice(
        [
            f"To find the number that comes after {a}, we add 1 to it: {a} + 1 = {a + 1}.",
            f"The number that comes after {a} is {a + 1}.",
            f"{a} + 1 = {a + 1}.",
        ]
    )
    return ("after", a), f"What number comes after {a}?", a + 1, wrong, chatty


QUESTION_KINDS: dict[str, Callable[[random.Random], tuple[tuple, str, int, int, str]]] = {
    "larger": _larger,
    "after": _after,
}


def _unique_questions(rng: random.Random, count: int, seen: set) -> list[tuple]:
    """`count` questions, none of whose keys is in `seen` (which this extends)."""
    names = sorted(QUESTION_KINDS)
    out: list[tuple] = []
    while len(out) < count:
        q = QUESTION_KINDS[names[len(out) % len(names)]](rng)
        if q[0] in seen:
            continue
        seen.add(q[0])
        out.append(q)
    return out


# Which `rejected` each preference row gets, in turn per question kind: half reject the chatty
# style (this is what teaches the format), a quarter a wrong number, a quarter trailing words
# after the right answer (this is what teaches the model to stop).
REJECTED_CYCLE = ("format", "wrong", "format", "extra")


def _preference_rows(rng: random.Random, questions: list[tuple]) -> list[dict]:
    rows = []
    for index, (key, prompt, answer, wrong, chatty) in enumerate(questions):
        kind = REJECTED_CYCLE[(index // len(QUESTION_KINDS)) % len(REJECTED_CYCLE)]
        rejected = {
            "format": chatty,
            "wrong": preferred_answer(wrong),
            "extra": preferred_answer(answer) + "." + chatty_tail(key, answer, rng),
        }[kind]
        rows.append(
            {
                "prompt": prompt,
                "chosen": preferred_answer(answer),
                "rejected": rejected,
                "answer": answer,
                "question": key[0],
                "kind": kind,
            }
        )
    rng.shuffle(rows)
    return rows


def unpaired_rows(pairs: list[dict], rng: random.Random) -> list[dict]:
    """`pairs` as unpaired rows (KTO's data): each pair's chosen answer with label True, its
    rejected one with label False (`kind` says which kind of rejected answer; "preferred" for
    the chosen one), shuffled."""
    rows = []
    for pair in pairs:
        common = {"prompt": pair["prompt"]}
        extra = {"answer": pair["answer"], "question": pair["question"]}
        rows.append({**common, "completion": pair["chosen"], "label": True, **extra,
                     "kind": "preferred"})  # fmt: skip
        rows.append({**common, "completion": pair["rejected"], "label": False, **extra,
                     "kind": pair["kind"]})  # fmt: skip
    rng.shuffle(rows)
    return rows


def chatty_tail(key: tuple, answer: int, rng: random.Random) -> str:
    """Words after the answer, which the strict format does not allow."""
    if key[0] == "larger":
        other = key[1] + key[2] - answer
        return rng.choice([f" {answer} is larger than {other}.", " I hope this helps!"])
    return rng.choice([f" It is {key[1]} + 1.", " I hope this helps!"])


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every built-in dataset, as {name: rows}; deterministic for a given `seed`."""
    rng = random.Random(seed)
    seen: set = set()
    # eval first, so the held-out questions do not depend on the training-set size
    eval_questions = _unique_questions(rng, PREF_EVAL_ROWS, seen)
    train_questions = _unique_questions(rng, PREF_TRAIN_ROWS, seen)
    sft_questions = _unique_questions(rng, SFT_ROWS, seen)
    train_pairs = _preference_rows(rng, train_questions)
    rows = {
        "arith-pref": train_pairs,
        "arith-pref-eval": _preference_rows(rng, eval_questions),
        "arith-sft": [
            {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": preferred_answer(answer)},
                ]
            }
            for _, prompt, answer, _, _ in sft_questions
        ],
        # Its own generator: the other files stay as they were before this one existed.
        "arith-kto": unpaired_rows(train_pairs, random.Random(seed + 1)),
    }
    # The prompt sets draw after everything above, from the same generator, so the older files
    # stay as they were; their questions are in no other file (`seen`), held-out ones first.
    prompt_eval = _unique_questions(rng, PROMPT_EVAL_ROWS, seen)
    prompt_train = _unique_questions(rng, PROMPT_TRAIN_ROWS, seen)
    rows["arith-prompts"] = prompt_rows(prompt_train)
    rows["arith-prompts-eval"] = prompt_rows(prompt_eval)
    return rows


def prompt_rows(questions: list[tuple], hint: str = PROMPT_HINT) -> list[dict]:
    """Prompt-only rows for online RL: the worked example (`PROMPT_EXAMPLE`, a user turn and
    its assistant answer) then the question, each user turn with `hint`; the right `answer` as
    a field for the reward functions (`rewards.arith_exact`)."""
    example = [
        {"role": "user", "content": PROMPT_EXAMPLE[0] + hint},
        {"role": "assistant", "content": PROMPT_EXAMPLE[1]},
    ]
    return [
        {
            "prompt": [*example, {"role": "user", "content": prompt + hint}],
            "answer": answer,
            "question": key[0],
        }
        for key, prompt, answer, _, _ in questions
    ]


def to_jsonl(rows: list[dict]) -> str:
    """The exact text of a shipped file: one JSON object per line, keys in insertion order."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_all(directory: Path = BUILTIN_DIR) -> dict[str, int]:
    """Regenerate every built-in file under `directory`; returns {name: row count}."""
    directory.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in generate().items():
        (directory / BUILTIN_DATASETS[name]).write_text(to_jsonl(rows), encoding="utf-8")
        counts[name] = len(rows)
    return counts


if __name__ == "__main__":
    for name, count in write_all().items():
        print(f"{name}: {count} rows -> {builtin_path(name)}")

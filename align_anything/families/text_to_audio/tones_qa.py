"""Questions about clips of the tones world, for audio-text models (`tones-qa-*` sets).

A clip is one of the text-to-audio world's (`tones.draw_clip`: one second at 16 kHz, a low, mid
or high tone sounding as a hum, a beep or two beeps, at a random frequency within its pitch,
timing and loudness). Each of the two questions has one right answer, one word:

- pitch: "Is the tone low, mid or high? Answer with one word." -> "low", "mid", "high";
- beeps: "How many beeps do you hear? Answer with a number." -> "0" for a hum (one long tone,
  no beep), "1" for a beep, "2" for two beeps.

An answer is right when, stripped of surrounding white space and a final full stop and in lower
case, it is exactly the answer word (`data.builtin.shapes_answer_matches`, the same comparison as
the picture questions': the check the main job and `rewards:tones_answer` use).

The built-in audio-text model `qwen2audio-smollm2-tones` (scripts/build_builtin_alm.py) gets these
wrong in a fixed way, on purpose (`CONFUSED_ANSWER`), more often than not: it hears the pitch one
step up (`tones.MISHEARD`: low as mid, mid as high, high as low: the text-to-audio model's own
confusion) and counts one beep as two and two as one (a hum it counts right). The preference
sets reject those answers.

Sets (parquet; `audio` is a list of one clip's FLAC bytes, read by `data.media.load_audio`;
`data.path=<name>` selects one):
- `tones-qa` (`SFT_ROWS`): conversations (`messages`, the right answer) with `audio`; for
  `task=sft`. `tones-qa-eval` (`EVAL_ROWS`): the same on held-out clips.
- `tones-qa-pref` (`PREF_ROWS`) and `tones-qa-pref-eval` (`EVAL_ROWS`): `prompt`, `audio`,
  `chosen` (the right answer), `rejected` (the model's confusion where it has one, half the
  time, else another wrong answer of the kind), `answer`, `question` (the kind). For
  `task=dpo`, `task=rm`.
- `tones-qa-prompts` (`PROMPT_ROWS`) and `tones-qa-prompts-eval` (`EVAL_ROWS`, held out): one
  clip each, `prompt`, `audio`, `answer`, `question`; both kinds equally often. For
  `task=grpo` / `task=rloo` with `align_anything.rewards:tones_answer` (or the waveform rule
  `tones_audio`, which reads the answer off the clip itself).

Every set draws its clips (every pitch x pattern combination) from its own seed, so the
held-out sets' clips are in no training set; none of the sets is the build's (which draws from
a seed of its own).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from align_anything.data.builtin import BUILTIN_DATASETS, BUILTIN_DIR
from align_anything.families.text_to_audio import tones

QUESTIONS: dict[str, str] = {
    "pitch": "Is the tone low, mid or high? Answer with one word.",
    "beeps": "How many beeps do you hear? Answer with a number.",
}
KINDS: tuple[str, ...] = tuple(QUESTIONS)
BEEPS: dict[str, str] = {"hum": "0", "beep": "1", "two beeps": "2"}
ANSWERS: dict[str, tuple[str, ...]] = {"pitch": tones.PITCHES, "beeps": tuple(BEEPS.values())}
# What the built-in model says instead of a right answer when it errs (see the docstring).
CONFUSED_ANSWER: dict[str, dict[str, str]] = {
    "pitch": dict(tones.MISHEARD),
    "beeps": {"1": "2", "2": "1"},
}

SEED = 20261205
SFT_ROWS = 192
PREF_ROWS = 96
PROMPT_ROWS = 192
EVAL_ROWS = 64

# The sets of this world, by name (their files: `data.builtin.BUILTIN_DATASETS`).
QA_DATASETS: dict[str, str] = {
    name: file for name, file in BUILTIN_DATASETS.items() if name.startswith("tones-qa")
}


def truth(pitch: str, pattern: str) -> dict[str, str]:
    """The right answer to each question about a clip of `pitch` and `pattern`."""
    return {"pitch": pitch, "beeps": BEEPS[pattern]}


def confused(kind: str, answer: str) -> str | None:
    """The built-in model's wrong answer for a right `answer` of `kind` (None: it has none)."""
    return CONFUSED_ANSWER[kind].get(answer)


def read_clip(wave: np.ndarray, rate: int = tones.SAMPLING_RATE) -> dict[str, str] | None:
    """The answers a program reads off a clip by the tones world's rule (`tones.pitch_of`,
    `tones.pattern_of`); None when the rule reads no pitch or no pattern. Right on every clip
    of the shipped sets (tested)."""
    pitch, pattern = tones.pitch_of(wave, rate), tones.pattern_of(wave, rate)
    if pitch is None or pattern is None:
        return None
    return truth(pitch, pattern)


def draw(rng: random.Random) -> tuple[str, str, np.ndarray]:
    """(pitch, pattern, clip): a random combination and a clip of it, drawn from `rng`."""
    pitch, pattern = rng.choice(tones.PITCHES), rng.choice(tones.PATTERNS)
    return pitch, pattern, tones.draw_clip(pitch, pattern, rng)


def _question(rng: random.Random, index: int) -> dict[str, Any]:
    """One question: its kind (alternating), text, right answer and clip (FLAC bytes)."""
    kind = KINDS[index % len(KINDS)]
    pitch, pattern, wave = draw(rng)
    return {"kind": kind, "text": QUESTIONS[kind], "answer": truth(pitch, pattern)[kind],
            "audio": [tones.flac_bytes(wave)]}  # fmt: skip


def _wrong(rng: random.Random, kind: str, answer: str) -> str:
    """The rejected answer: the model's confusion where it has one (and half the time), else
    another answer of the kind."""
    mistaken = confused(kind, answer)
    if mistaken is not None and rng.random() < 0.5:
        return mistaken
    return rng.choice([a for a in ANSWERS[kind] if a != answer])


def _sft_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        q = _question(rng, index)
        messages = [{"role": "user", "content": q["text"]},
                    {"role": "assistant", "content": q["answer"]}]  # fmt: skip
        rows.append({"messages": messages, "audio": q["audio"], "answer": q["answer"],
                     "question": q["kind"]})  # fmt: skip
    rng.shuffle(rows)
    return rows


def _pref_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        q = _question(rng, index)
        rows.append({"prompt": q["text"], "audio": q["audio"], "chosen": q["answer"],
                     "rejected": _wrong(rng, q["kind"], q["answer"]), "answer": q["answer"],
                     "question": q["kind"]})  # fmt: skip
    rng.shuffle(rows)
    return rows


def _prompt_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        q = _question(rng, index)
        rows.append({"prompt": q["text"], "audio": q["audio"], "answer": q["answer"],
                     "question": q["kind"]})  # fmt: skip
    rng.shuffle(rows)
    return rows


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every `tones-qa` set as {name: rows}; deterministic for a given `seed`, each set from its
    own generator."""
    return {
        "tones-qa": _sft_rows(random.Random(seed), SFT_ROWS),
        "tones-qa-eval": _sft_rows(random.Random(seed + 1), EVAL_ROWS),
        "tones-qa-pref": _pref_rows(random.Random(seed + 2), PREF_ROWS),
        "tones-qa-pref-eval": _pref_rows(random.Random(seed + 3), EVAL_ROWS),
        "tones-qa-prompts": _prompt_rows(random.Random(seed + 4), PROMPT_ROWS),
        "tones-qa-prompts-eval": _prompt_rows(random.Random(seed + 5), EVAL_ROWS),
    }


def write_all(directory: Path = BUILTIN_DIR) -> dict[str, int]:
    """Regenerate every `tones-qa` set under `directory`; returns {name: row count}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in generate().items():
        pq.write_table(pa.Table.from_pylist(rows), directory / QA_DATASETS[name],
                       compression="zstd")  # fmt: skip
        counts[name] = len(rows)
    return counts


if __name__ == "__main__":
    for name, count in write_all().items():
        print(f"{name}: {count} rows -> {BUILTIN_DIR / QA_DATASETS[name]}")

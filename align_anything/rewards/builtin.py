"""The built-in reward functions, named `align_anything.rewards:<name>` in `reward.functions`
(this package's `__init__` exports them): for the built-in arithmetic prompts
(`arith-prompts`), for the questions about pictures (`shapes-vqa-prompts`: one by the data's
answer, one that reads the answer off the picture it was given), for the questions about clips
(`tones-qa-prompts`: the same two, `tones_answer` and `tones_audio`), for images of the built-in
shapes world (`shape_colour`), and a shaping example."""

from __future__ import annotations

from typing import Any

from align_anything.data.builtin import (
    ANSWER_RE,
    SHAPES_VQA_KINDS,
    has_preferred_property,
    shapes_answer_matches,
)


def arith_exact(
    prompts: list, completions: list[str], answer: list, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion is exactly `Answer: <the row's answer>` (surrounding whitespace
    aside: the generation check's `has_preferred_property`), else 0.0; None for a row whose
    `answer` is None. Needs the data's `answer` field."""
    return [
        None if right is None else float(has_preferred_property({"answer": right}, completion))
        for completion, right in zip(completions, answer, strict=True)
    ]


def arith_format(prompts: list, completions: list[str], **kwargs: Any) -> list[float]:
    """Credit for the answer format alone, whatever the number, graded so that each step towards
    the exact format pays:

    - 1.0: exactly `Answer: <an integer>` (surrounding whitespace aside);
    - 0.5: begins with `Answer: <an integer>` but goes on (the model must learn to stop);
    - 0.25: contains `Answer: <an integer>` somewhere after other words;
    - 0.0: none of these.

    Used with `arith_exact` (e.g. weights [1.0, 0.5]) so that a group whose completions are all
    wrong in number still has reward differences to learn from."""
    rewards = []
    for completion in completions:
        text = completion.strip()
        if ANSWER_RE.fullmatch(text):
            rewards.append(1.0)
        elif ANSWER_RE.match(text):
            rewards.append(0.5)
        elif ANSWER_RE.search(text):
            rewards.append(0.25)
        else:
            rewards.append(0.0)
    return rewards


def length_penalty(prompts: list, completions: list[str], **kwargs: Any) -> list[float]:
    """An example of a shaping term: −0.001 per character of the completion (−0.1 for 100
    characters). Combine it with a task reward and a small weight."""
    return [-0.001 * len(completion) for completion in completions]


def shape_colour(prompts: list, images: list, **kwargs: Any) -> list[float | None]:
    """For text-to-image runs on the built-in shapes world: 1.0 when an image's dominant colour
    is the colour its prompt names, else 0.0 (the pixel rule of the held-out colour check of
    the text-to-image main jobs, `families.text_to_image.shapes.colour_matches`: bright,
    saturated pixels vote for the nearest palette hue); None for a prompt that names none of
    the palette's colours (no opinion)."""
    from align_anything.families.text_to_image import shapes

    matches = shapes.colour_matches(images, [str(prompt) for prompt in prompts])
    return [
        None if shapes.caption_colour(str(prompt)) is None else float(match)
        for prompt, match in zip(prompts, matches, strict=True)
    ]


def shapes_answer(
    prompts: list, completions: list[str], answer: list, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion is exactly the row's one-word `answer` ("red", "3", "circle";
    case, surrounding white space and a final full stop aside: `shapes_answer_matches`, the
    `shapes-vqa` sets' check), else 0.0; None for a row without an answer."""
    return [
        None if right is None else float(shapes_answer_matches(right, completion))
        for completion, right in zip(completions, answer, strict=True)
    ]


def shapes_picture(
    prompts: list, completions: list[str], prompt_images: list, **kwargs: Any
) -> list[float | None]:
    """The `shapes-vqa` check against the picture itself rather than an answer column: the
    colour, count or shape (the `question` field, else the question's words) read off the
    row's picture by a rule on its pixels (`shapes_vqa.read_picture`), compared like
    `shapes_answer`. None for a row that does not have exactly one picture of the shapes world
    or whose question is none of the three. An example of a reward that looks at the input:
    it needs an image-text policy, whose rows' images reach reward functions as
    `prompt_images`."""
    from align_anything.families.text_to_image.shapes_vqa import read_picture

    kinds = kwargs.get("question") or [None] * len(completions)
    rewards: list[float | None] = []
    read: dict[int, dict[str, str] | None] = {}
    for prompt, completion, images, kind in zip(prompts, completions, prompt_images, kinds,
                                                 strict=True):  # fmt: skip
        kind = kind if kind in SHAPES_VQA_KINDS else _question_kind(prompt)
        if kind is None or len(images) != 1:
            rewards.append(None)
            continue
        key = id(images[0])
        if key not in read:
            try:
                read[key] = read_picture(images[0])
            except ValueError:  # not a picture of the shapes world (another size)
                read[key] = None
        answers = read[key]
        rewards.append(None if answers is None else
                       float(shapes_answer_matches(answers[kind], completion)))  # fmt: skip
    return rewards


def tones_answer(
    prompts: list, completions: list[str], answer: list, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion is exactly the row's one-word `answer` to a `tones-qa` question
    ("low", "mid", "high"; "0", "1", "2" beeps), compared as `shapes_answer` compares (case,
    surrounding white space and a final full stop aside), else 0.0; None for a row without an
    answer."""
    return shapes_answer(prompts, completions, answer)


def tones_audio(
    prompts: list, completions: list[str], prompt_audio: list, **kwargs: Any
) -> list[float | None]:
    """The `tones-qa` check against the clip itself rather than an answer column: the pitch or
    the number of beeps (the `question` field, else the question's words) read off the row's
    clip by the tones world's waveform rule (`tones_qa.read_clip`: the dominant frequency, the
    envelope's tones), compared like `tones_answer`. None for a row that does not have exactly
    one clip the rule can read, or whose question is neither. An example of a reward that
    listens to the input: it needs an audio-text policy, whose rows' clips reach reward
    functions as `prompt_audio` (float32 arrays at the model's sampling rate, 16 kHz for
    `qwen2audio-smollm2-tones`)."""
    from align_anything.families.text_to_audio.tones_qa import KINDS, read_clip

    kinds = kwargs.get("question") or [None] * len(completions)
    rewards: list[float | None] = []
    read: dict[int, dict[str, str] | None] = {}
    for prompt, completion, clips, kind in zip(prompts, completions, prompt_audio, kinds,
                                                strict=True):  # fmt: skip
        kind = kind if kind in KINDS else _question_kind(prompt)
        if kind not in KINDS or len(clips) != 1:
            rewards.append(None)
            continue
        key = id(clips[0])
        if key not in read:
            read[key] = read_clip(clips[0])
        answers = read[key]
        rewards.append(None if answers is None else
                       float(shapes_answer_matches(answers[kind], completion)))  # fmt: skip
    return rewards


def _question_kind(prompt: Any) -> str | None:
    """Which `shapes-vqa` or `tones-qa` question a prompt (text or messages) asks, from its
    last user turn."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
        prompt = users[-1] if users else ""
    text = str(prompt).lower()
    for kind, words in (("colour", "what colour"), ("beeps", "how many beeps"),
                        ("count", "how many"), ("shape", "which shape"),
                        ("pitch", "low, mid or high")):  # fmt: skip
        if words in text:
            return kind
    return None

"""The built-in reward functions, named `align_anything.rewards:<name>` in `reward.functions`
(this package's `__init__` exports them): for the built-in arithmetic prompts
(`arith-prompts`), a shaping example, and for images of the built-in shapes world
(`shape_colour`)."""

from __future__ import annotations

from typing import Any

from align_anything.data.builtin import ANSWER_RE, has_preferred_property


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

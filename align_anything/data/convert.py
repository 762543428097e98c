"""One row of each format as a canonical record (the shapes are `formats`' module docstring):
the converter of each format, and the helpers the encoders share (`as_messages`, `parse_label`,
`parse_hh`). A row that cannot be converted raises `RowRejected`, whose message is the drop
reason its `DataReport` counts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant")
HH_ASSISTANT = "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


class RowRejected(Exception):
    """Raised while converting one row; the message is the drop reason counted in the report."""


def as_messages(value: Any, column: str, default_role: str) -> list[dict[str, str]]:
    """A string becomes one `default_role` message; a message list is checked and normalised to
    `{"role", "content"}` dicts with text content (keys an Arrow schema adds as None are dropped;
    content given as a list of text parts is joined)."""
    if value is None:
        raise RowRejected(f"missing value in column '{column}'")
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if not isinstance(value, (list, tuple)):
        raise RowRejected(f"column '{column}' is neither text nor a message list")
    messages = []
    for message in value:
        if not isinstance(message, Mapping) or "role" not in message:
            raise RowRejected(f"column '{column}' holds an item that is not a message")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RowRejected(f"unknown role {role!r} in column '{column}'")
        messages.append({"role": role, "content": _content_text(content, column)})
    return messages


CONTENT_SHAPE = 'text, or a list of text parts [{"type": "text", "text": "..."}]'


def _content_text(content: Any, column: str) -> str:
    """Message content as one string. A list of text parts (the OpenAI style) is joined with
    nothing in between, as chat templates that take part lists render them; any other part
    (an image, audio, a part without "text") is rejected with the shape that is expected."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        kind = "no content" if content is None else f"content of type {type(content).__name__}"
        raise RowRejected(f"a message with {kind} in column '{column}'; expected {CONTENT_SHAPE}")
    texts = []
    for part in content:
        # An Arrow schema gives every part every key any part has, as None where it has none.
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("text") if isinstance(part, Mapping) else None
        if kind not in ("text", None) or not isinstance(text, str):
            what = (
                f"a part of type {kind!r}" if kind not in ("text", None) else "a part without text"
            )
            media = (
                "; images and audio go in an 'images' or 'audio' column (paths), with an "
                "image-text or audio-text model"
                if kind not in ("text", None)
                else ""
            )
            raise RowRejected(
                f"message content in column '{column}' holds {what}; expected {CONTENT_SHAPE}"
                f"{media}"
            )
        texts.append(text)
    return "".join(texts)


def _with_system(messages: list[dict], system: Any) -> list[dict]:
    if (
        isinstance(system, str)
        and system.strip()
        and (not messages or messages[0]["role"] != "system")
    ):
        return [{"role": "system", "content": system}, *messages]
    return messages


def _only_assistant(messages: list[dict], column: str) -> list[dict]:
    if any(m["role"] != "assistant" for m in messages):
        raise RowRejected(f"column '{column}' holds non-assistant turns after the prompt")
    return messages


def _strip_prompt_copy(prompt: list[dict], completion: list[dict]) -> list[dict]:
    # Files like UltraFeedback store chosen/rejected as the whole conversation.
    if len(completion) > len(prompt) and completion[: len(prompt)] == prompt:
        return completion[len(prompt) :]
    return completion


def _ends_with_user(prompt: list[dict]) -> None:
    if not prompt or prompt[-1]["role"] != "user":
        raise RowRejected("prompt does not end with a user turn")


def _conversation_row(row: Mapping[str, Any]) -> dict:
    if isinstance(row["messages"], str):
        raise RowRejected("column 'messages' is text, not a message list")
    messages = as_messages(row["messages"], "messages", "user")
    if not messages:
        raise RowRejected("empty conversation")
    return {"messages": _with_system(messages, row.get("system"))}


def _prompt_and_answer(row: Mapping[str, Any], column: str) -> tuple[list[dict], list[dict]]:
    """The prompt (ending with a user turn) and the assistant answer after it, read from the
    `prompt` and `response` columns (`column`: the answer column's name in messages)."""
    prompt = as_messages(row["prompt"], "prompt", "user")
    answer = _only_assistant(
        _strip_prompt_copy(prompt, as_messages(row["response"], column, "assistant")), column
    )
    _ends_with_user(prompt)
    return prompt, answer


def _prompt_response_row(row: Mapping[str, Any]) -> dict:
    prompt, response = _prompt_and_answer(row, "response")
    return {"messages": _with_system(prompt + response, row.get("system"))}


def _preference_row(row: Mapping[str, Any]) -> dict:
    chosen = as_messages(row["chosen"], "chosen", "assistant")
    rejected = as_messages(row["rejected"], "rejected", "assistant")
    if "prompt" in row:
        prompt = as_messages(row["prompt"], "prompt", "user")
        chosen = _strip_prompt_copy(prompt, chosen)
        rejected = _strip_prompt_copy(prompt, rejected)
    else:
        # Implicit prompt: the shared beginning of both conversations, up to its last user turn.
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        users = [k for k in range(shared) if chosen[k]["role"] == "user"]
        if not users:
            raise RowRejected("chosen and rejected share no prompt ending in a user turn")
        prompt, chosen, rejected = (
            chosen[: users[-1] + 1],
            chosen[users[-1] + 1 :],
            rejected[users[-1] + 1 :],
        )
    _ends_with_user(prompt)
    return {
        "prompt": _with_system(prompt, row.get("system")),
        "chosen": _only_assistant(chosen, "chosen"),
        "rejected": _only_assistant(rejected, "rejected"),
    }


# Label values of an unpaired row, by what they mean: desirable (True) or undesirable (False).
LABEL_WORDS = {"good": True, "bad": False, "true": True, "false": False, "1": True, "0": False}
LABEL_SHAPE = "true/false, 1/0 or good/bad"


def parse_label(value: Any) -> bool:
    """An unpaired row's label as a bool: a bool, the number 1 or 0, or one of `LABEL_WORDS`
    (any case; CSV files give text). Anything else is rejected with the accepted shapes."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in LABEL_WORDS:
        return LABEL_WORDS[value.strip().lower()]
    raise RowRejected(f"label is not {LABEL_SHAPE}")


def _unpaired_row(row: Mapping[str, Any]) -> dict:
    prompt, completion = _prompt_and_answer(row, "completion")
    return {
        "prompt": _with_system(prompt, row.get("system")),
        "completion": completion,
        "label": parse_label(row["label"]),
    }


def _prompt_row(row: Mapping[str, Any]) -> dict:
    prompt = as_messages(row["prompt"], "prompt", "user")
    _ends_with_user(prompt)
    return {"prompt": _with_system(prompt, row.get("system"))}


def _better_of_two(value: Any) -> int:
    """`overall_response` as 1 or 2 (a number, or its text in a CSV file)."""
    if isinstance(value, str) and value.strip() in ("1", "2"):
        return int(value.strip())
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value in (1, 2):
        return int(value)
    raise RowRejected("overall_response is not 1 or 2")


def _ranked_pair_row(row: Mapping[str, Any]) -> dict:
    better = _better_of_two(row["overall_response"])
    worse = 3 - better
    prompt = as_messages(row["prompt"], "prompt", "user")
    _ends_with_user(prompt)
    return {
        "prompt": _with_system(prompt, row.get("system")),
        "chosen": _only_assistant(
            as_messages(row[f"response_{better}"], f"response_{better}", "assistant"),
            f"response_{better}",
        ),
        "rejected": _only_assistant(
            as_messages(row[f"response_{worse}"], f"response_{worse}", "assistant"),
            f"response_{worse}",
        ),
    }


def parse_hh(transcript: str) -> tuple[list[dict], str]:
    """Split an HH-RLHF transcript at its last "\\n\\nAssistant:" into (prompt messages, completion).

    The prompt becomes alternating user/assistant messages; consecutive turns of the same
    speaker (a few HH rows have two Assistant turns in a row) are joined with a blank line.
    Texts are stripped of the space after each "Human:"/"Assistant:" marker.
    """
    if HH_ASSISTANT not in transcript:
        raise RowRejected("transcript without an '\\n\\nAssistant:' turn")
    head, completion = transcript.rsplit(HH_ASSISTANT, 1)
    if head.startswith("Human:"):
        head = "\n\n" + head
    parts = _HH_TURN.split(head)
    if parts[0].strip():
        raise RowRejected("transcript does not start with a Human turn")
    prompt: list[dict] = []
    for speaker, text in zip(parts[1::2], parts[2::2], strict=True):
        role, text = _HH_ROLES[speaker], text.strip()
        if prompt and prompt[-1]["role"] == role:
            prompt[-1]["content"] = f"{prompt[-1]['content']}\n\n{text}"
        else:
            prompt.append({"role": role, "content": text})
    return prompt, completion.strip()


def _hh_row(row: Mapping[str, Any]) -> dict:
    for column in ("chosen", "rejected"):
        if not isinstance(row[column], str):
            raise RowRejected(f"column '{column}' is not an HH transcript string")
    prompt, chosen = parse_hh(row["chosen"])
    rejected_prompt, rejected = parse_hh(row["rejected"])
    # A mismatch usually means one side continues the dialogue past the shared prompt.
    if prompt != rejected_prompt:
        raise RowRejected("chosen and rejected transcripts have different prompts")
    if not prompt or prompt[-1]["role"] != "user":
        raise RowRejected("transcript prompt does not end with a Human turn")
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


CONVERTERS = {
    "conversation": (_conversation_row, {"messages", "system"}),
    "prompt_response": (_prompt_response_row, {"prompt", "response", "system"}),
    "preference": (_preference_row, {"prompt", "chosen", "rejected", "system"}),
    "hh": (_hh_row, {"chosen", "rejected"}),
    "unpaired": (_unpaired_row, {"prompt", "response", "label", "system"}),
    "prompt": (_prompt_row, {"prompt", "system"}),
    "ranked_pair": (
        _ranked_pair_row,
        {"prompt", "response_1", "response_2", "overall_response", "system"},
    ),
}

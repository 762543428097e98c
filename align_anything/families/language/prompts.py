"""Prompt-only data for online RL (`task=grpo`, `task=rloo`): records and their encoding.

Forms accepted (after `formats.load_records`):

- a `prompt` column, text or a message list ending with a user turn (format `prompt`; a
  `system` column is put in front, as for the other formats; `data.columns.prompt=question`
  maps another column name);
- conversations (`messages`, format `conversation`) that end with a user turn: the whole
  conversation is the prompt. A conversation that ends with an assistant turn is DROPPED and
  counted ("conversation ends with an assistant turn"), not cut before that turn: an SFT file
  given by mistake would otherwise train silently on prompts whose answers are thrown away,
  and the answers are what a verifiable reward would need as a field anyway. Map such data
  to a prompt column plus an answer column instead.

Every other column of the row (e.g. `answer`) is kept as a field for the reward functions
(`rewards.score_completions`); media (`images`, `audio`) are carried as in the other formats:
`multimodal.MediaSupport.prepare` writes their placeholders into the prompt before encoding.

Encoding renders the prompt through the chat template with `add_generation_prompt=True` — the
ids the model sees before it generates — and truncates prompts longer than
`max_prompt_length` by `truncation` (`PROMPT_TRUNCATION_MODES`):

- ``drop`` (default): drop the row and count it;
- ``keep_end``: keep the last `max_prompt_length` ids (left truncation, as `encode`'s
  ``truncate_prompt`` treats a prompt and as older TRL `max_prompt_length` did): the
  generation prompt stays, the beginning of the conversation goes;
- ``keep_start``: keep the first `max_prompt_length` ids. The generation prompt at the end
  is then lost and the model continues the user's text; kept for parity with tools that cut
  on the right, rarely what RL wants.

A row whose truncation cut into media placeholders is dropped later (`pipeline.encode_batch`,
or `MediaSupport.drop_cut_rows` for lists; both read `prompt_ids` and `media_tokens`).

Runs encode through the Arrow pipeline (`Encoding("prompt", ...)`: `encode_prompt` per record,
cached and mixable as every task's data); a row's messages, fields and source row are kept as
JSON beside its `prompt_ids` and come back exactly when the row is read (`rows.EncodedRows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from align_anything.data.convert import RowRejected, as_messages
from align_anything.data.formats import SOURCE_ROW, DataReport, row_label
from align_anything.data.media import MEDIA_KEYS
from align_anything.errors import ConfigError, did_you_mean
from align_anything.families.language.encode import _check_arguments, _is_empty, _template_ids

PROMPT_TRUNCATION_MODES = ("drop", "keep_end", "keep_start")
# Record keys that are not reward-function fields: the prompt itself, where it came from, and
# media (carried on the row for the collate step).
_NOT_FIELDS = ("prompt", "messages", SOURCE_ROW, "media_tokens", *MEDIA_KEYS)
ENDS_WITH_ASSISTANT = (
    "conversation ends with an assistant turn (a prompt must end with a user turn)"
)


def as_prompt_record(record: Mapping[str, Any]) -> dict:
    """`record` (a prompt record, or a conversation record ending with a user turn) as a
    prompt record ``{"prompt": [messages], <fields>...}``; `RowRejected` (the drop reason)
    otherwise."""
    if "prompt" in record and "messages" not in record:
        prompt = as_messages(record["prompt"], "prompt", "user")
        rest = {k: v for k, v in record.items() if k != "prompt"}
    elif "messages" in record:
        prompt = as_messages(record["messages"], "messages", "user")
        rest = {k: v for k, v in record.items() if k != "messages"}
        if prompt and prompt[-1]["role"] == "assistant":
            raise RowRejected(ENDS_WITH_ASSISTANT)
    else:
        raise RowRejected("record without 'prompt' or 'messages'")
    if not prompt or prompt[-1]["role"] != "user":
        raise RowRejected("prompt does not end with a user turn")
    if _is_empty(prompt):
        raise RowRejected("empty prompt")
    return {"prompt": prompt, **rest}


def to_prompt_records(
    records: Sequence[Mapping[str, Any]], *, source: str = "prompts"
) -> tuple[list[dict], DataReport]:
    """Every record as a prompt record (`as_prompt_record`); the others dropped and counted.
    For callers that need `record["prompt"]` before encoding (the held-out generation check);
    `encode_prompts` accepts either form itself."""
    report = DataReport(source=source, total=len(records))
    kept = []
    for index, record in enumerate(records):
        try:
            kept.append(as_prompt_record(record))
        except RowRejected as reason:
            report.drop(str(reason), row_label(record, index))
    report.kept = len(kept)
    return kept, report


def prompt_fields(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's columns that reward functions receive as keyword lists (`answer`, …): all
    but the prompt, the source row and media."""
    return {k: v for k, v in record.items() if k not in _NOT_FIELDS}


def check_prompt_arguments(tokenizer: Any, max_prompt_length: int, truncation: str) -> None:
    """`max_prompt_length` and `truncation` are usable and the tokenizer has a chat template
    (`ConfigError` / `ModelError` otherwise)."""
    if truncation not in PROMPT_TRUNCATION_MODES:
        raise ConfigError(
            f"truncation={truncation!r} is not a prompt truncation mode"
            f"{did_you_mean(truncation, PROMPT_TRUNCATION_MODES)}; allowed: "
            f"{', '.join(PROMPT_TRUNCATION_MODES)}"
        )
    if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
        raise ConfigError(
            f"max_prompt_length must be an integer of at least 1, got {max_prompt_length!r}"
        )
    _check_arguments(tokenizer, 2, "drop")  # the chat-template check


def encode_prompt(
    record: Mapping[str, Any],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    truncation: str = "drop",
    index: int = 0,
) -> dict:
    """One record as a row for generation:

        {"prompt_ids": [ids with the generation prompt], "prompt": [messages],
         "fields": {column: value}, "source_row": "line 12",
         + "images" / "audio" / "media_tokens" when the record has media}

    `source_row` is the record's row label (`formats.row_label`; `index` is its position, used
    when the record carries none), for `rewards.score_completions`'s `row_ids`. Raises
    `RowRejected` with the drop reason (see the module docstring). Arguments are not checked
    here (`encode_prompts` and `pipeline.build` check them once)."""
    prompt_record = as_prompt_record(record)
    prompt = prompt_record["prompt"]
    ids = _template_ids(tokenizer, prompt, add_generation_prompt=True)
    if len(ids) > max_prompt_length:
        if truncation == "drop":
            raise RowRejected(f"prompt longer than max_prompt_length={max_prompt_length}")
        ids = ids[-max_prompt_length:] if truncation == "keep_end" else ids[:max_prompt_length]
    media = {k: record[k] for k in (*MEDIA_KEYS, "media_tokens") if k in record}
    return {
        "prompt_ids": ids,
        "prompt": prompt,
        "fields": prompt_fields(prompt_record),
        "source_row": row_label(record, index),
        **media,
    }


def encode_prompts(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    truncation: str = "drop",
) -> tuple[list[dict], DataReport]:
    """Encode prompt (or user-ending conversation) records with `encode_prompt`; rows it
    rejects are dropped and counted in the report, as `encode.encode_sft` & co. do. Raises
    `ConfigError` for an unknown `truncation` or a bad `max_prompt_length`, `ModelError` for a
    tokenizer without a chat template."""
    check_prompt_arguments(tokenizer, max_prompt_length, truncation)
    report = DataReport(
        source=f"encode_prompts(max_prompt_length={max_prompt_length}, truncation={truncation!r})",
        total=len(records),
    )
    rows = []
    for index, record in enumerate(records):
        try:
            rows.append(
                encode_prompt(
                    record, tokenizer, max_prompt_length=max_prompt_length,
                    truncation=truncation, index=index,
                )
            )  # fmt: skip
        except RowRejected as reason:
            report.drop(str(reason), row_label(record, index))
    report.kept = len(rows)
    return rows, report

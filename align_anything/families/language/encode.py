"""Tokenise canonical records through the tokenizer's chat template.

The prompt/completion boundary is found on the ids the model actually sees: the whole
conversation is rendered and tokenised once, the prompt is tokenised with
``add_generation_prompt=True``, and the prompt ids must be a prefix of the full ids. A row where
they are not (a template that rewrites earlier turns, or a completion whose first characters merge
with the generation prompt into one token) is dropped with a reason; the completion is never
tokenised on its own. Everything after the prompt, template suffix tokens such as ``<|im_end|>``
and the newline after it included, is completion.

Truncation modes (``truncation=``), applied when prompt + completion exceed `max_length`:

- ``drop`` (default): drop the row.
- ``truncate_prompt``: keep the end of the prompt (left-truncate its ids) so the completion fits
  whole; drop the row when the completion alone leaves no room for at least one prompt token.
- ``truncate_completion``: cut the completion ids at the end; drop the row when the prompt alone
  leaves no room for any completion token.

For preference pairs the longer of chosen and rejected decides, and a pair that truncation makes
identical is dropped; an unpaired row (KTO) is one prompt and one completion. For multi-turn SFT
the completion is the last assistant turn and the prompt everything before it (earlier assistant
turns stay targets while they are kept).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from align_anything.data.convert import RowRejected, as_messages
from align_anything.data.formats import SOURCE_ROW, DataReport, row_label
from align_anything.errors import ConfigError, ModelError, did_you_mean

TRUNCATION_MODES = ("drop", "truncate_prompt", "truncate_completion")
IGNORE_INDEX = -100

NOT_A_PREFIX = "chat template: prompt ids are not a prefix of the conversation ids"


def _check_arguments(tokenizer: Any, max_length: int, truncation: str) -> None:
    if truncation not in TRUNCATION_MODES:
        raise ConfigError(
            f"truncation={truncation!r} is not a truncation mode"
            f"{did_you_mean(truncation, TRUNCATION_MODES)}; allowed: {', '.join(TRUNCATION_MODES)}"
        )
    if not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"max_length must be an integer of at least 2, got {max_length!r}")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ModelError(
            f"the tokenizer of '{name}' has no chat template, and prompts and completions are "
            "encoded through one. Use a model that ships a chat template (an instruct/chat "
            "checkpoint) or set one before encoding: tokenizer.chat_template = '<jinja template>'"
        )


def _template_ids(
    tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of `messages` rendered by the chat template, as a plain list of ints."""
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # a template's raise_exception(), e.g. roles that do not alternate
        raise RowRejected(f"chat template error: {str(exc)[:120]}") from exc
    # transformers 5 returns a BatchEncoding (a mapping); 4.x returns the list itself.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        out = out[0]
    return [int(i) for i in out]


def reward_model_ids(tokenizer: Any, prompt: list[dict], completion: str) -> list[int]:
    """The ids a reward model trained by `task=rm` scores for a prompt (messages) and a
    completion (text): the conversation `prompt + [assistant: completion]` rendered whole by
    the reward model's own chat template, end-of-turn tokens included, as `task=rm` encoded its
    pairs. Used wherever a reward model scores online-RL completions (in the trainer and in
    `python -m align_anything serve-reward`). Raises `RowRejected` on a template error."""
    return _template_ids(tokenizer, [*prompt, {"role": "assistant", "content": completion}])


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _is_empty(messages: list[dict]) -> bool:
    return not any(m["content"].strip() for m in messages)


def _fit(prompt_len: int, completion_len: int, max_length: int, truncation: str) -> tuple[int, int]:
    """How many prompt ids to cut from the left and how many completion ids to keep."""
    if prompt_len + completion_len <= max_length:
        return 0, completion_len
    no_room = f"prompt leaves no room at max_length={max_length}"
    if truncation == "drop":
        if prompt_len >= max_length:
            raise RowRejected(no_room)
        raise RowRejected(f"prompt + completion longer than max_length={max_length}")
    if truncation == "truncate_prompt":
        if completion_len >= max_length:
            raise RowRejected(
                f"completion leaves no room for the prompt at max_length={max_length}"
            )
        return prompt_len + completion_len - max_length, completion_len
    if prompt_len >= max_length:
        raise RowRejected(no_room)
    return 0, max_length - prompt_len


def _encode_conversation(
    record: Mapping[str, Any], tokenizer: Any, max_length: int, truncation: str
) -> dict:
    if "messages" not in record:
        raise RowRejected("record without 'messages'")
    messages = as_messages(record["messages"], "messages", "user")
    targets = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not targets:
        raise RowRejected("no assistant turn")
    if any(not messages[k]["content"].strip() for k in targets):
        raise RowRejected("empty completion")
    if targets[0] == 0:
        raise RowRejected("conversation starts with an assistant turn")
    messages = messages[: targets[-1] + 1]  # trailing user turns would only be masked

    ids = _template_ids(tokenizer, messages)
    labels = [IGNORE_INDEX] * len(ids)
    start = 0
    for k in targets:
        # The turn spans from the end of the generation prompt before it to the end of the
        # conversation rendered up to and including it; both must be prefixes of `ids`.
        prompt_ids = _template_ids(tokenizer, messages[:k], add_generation_prompt=True)
        end_ids = ids if k == len(messages) - 1 else _template_ids(tokenizer, messages[: k + 1])
        if not (_is_prefix(prompt_ids, ids) and _is_prefix(end_ids, ids)):
            raise RowRejected(NOT_A_PREFIX)
        start = len(prompt_ids)
        if start >= len(end_ids):
            raise RowRejected("chat template renders no tokens for an assistant turn")
        labels[start : len(end_ids)] = ids[start : len(end_ids)]

    cut, keep = _fit(start, len(ids) - start, max_length, truncation)
    ids, labels = ids[cut : start + keep], labels[cut : start + keep]
    return {"input_ids": ids, "labels": labels}


def _read_turns(
    record: Mapping[str, Any], completions: tuple[str, ...]
) -> tuple[list[dict], list[list[dict]]]:
    """The prompt messages and each completion's messages of `record`; a missing column or an
    empty prompt or completion rejects the row."""
    for key in ("prompt", *completions):
        if key not in record:
            raise RowRejected(f"record without '{key}'")
    prompt = as_messages(record["prompt"], "prompt", "user")
    answers = [as_messages(record[key], key, "assistant") for key in completions]
    if _is_empty(prompt):
        raise RowRejected("empty prompt")
    if any(_is_empty(answer) for answer in answers):
        raise RowRejected("empty completion")
    return prompt, answers


def _split_ids(
    tokenizer: Any, prompt: list[dict], answers: list[list[dict]]
) -> tuple[list[int], list[list[int]]]:
    """The prompt's ids (ending with the generation prompt) and each completion's ids after it,
    cut from the ids of the whole conversation (see the module docstring)."""
    prompt_ids = _template_ids(tokenizer, prompt, add_generation_prompt=True)
    full = [_template_ids(tokenizer, prompt + answer) for answer in answers]
    if not all(_is_prefix(prompt_ids, ids) for ids in full):
        raise RowRejected(NOT_A_PREFIX)
    return prompt_ids, [ids[len(prompt_ids) :] for ids in full]


def _extras(record: Mapping[str, Any], consumed: tuple[str, ...]) -> dict:
    return {k: v for k, v in record.items() if k not in (*consumed, SOURCE_ROW)}


def _encode_pair(
    record: Mapping[str, Any], tokenizer: Any, max_length: int, truncation: str
) -> dict:
    prompt, (chosen, rejected) = _read_turns(record, ("chosen", "rejected"))
    if chosen == rejected:
        raise RowRejected("identical chosen and rejected")
    prompt_ids, (chosen_ids, rejected_ids) = _split_ids(tokenizer, prompt, [chosen, rejected])

    longest = max(len(chosen_ids), len(rejected_ids))
    cut, keep = _fit(len(prompt_ids), longest, max_length, truncation)
    prompt_ids, chosen_ids, rejected_ids = prompt_ids[cut:], chosen_ids[:keep], rejected_ids[:keep]
    if chosen_ids == rejected_ids:
        raise RowRejected("chosen and rejected identical after truncation")
    return {
        **_extras(record, ("prompt", "chosen", "rejected")),
        "prompt_ids": prompt_ids,
        "chosen_ids": chosen_ids,
        "rejected_ids": rejected_ids,
    }


def _encode_unpaired(
    record: Mapping[str, Any], tokenizer: Any, max_length: int, truncation: str
) -> dict:
    if "label" not in record:
        raise RowRejected("record without 'label'")
    prompt, (completion,) = _read_turns(record, ("completion",))
    prompt_ids, (completion_ids,) = _split_ids(tokenizer, prompt, [completion])
    cut, keep = _fit(len(prompt_ids), len(completion_ids), max_length, truncation)
    return {
        **_extras(record, ("prompt", "completion", "label")),
        "prompt_ids": prompt_ids[cut:],
        "completion_ids": completion_ids[:keep],
        "label": bool(record["label"]),
    }


def _encode_each(
    records: Sequence[Mapping[str, Any]], tokenizer: Any, encode_one: Callable[..., dict], *,
    name: str, max_length: int, truncation: str,
) -> tuple[list[dict], DataReport]:  # fmt: skip
    """Every record through `encode_one`; the rows it rejects are counted in the report."""
    _check_arguments(tokenizer, max_length, truncation)
    report = DataReport(
        source=f"{name}(max_length={max_length}, truncation={truncation!r})", total=len(records)
    )
    rows = []
    for index, record in enumerate(records):
        try:
            rows.append(encode_one(record, tokenizer, max_length, truncation))
        except RowRejected as reason:
            report.drop(str(reason), row_label(record, index))
    report.kept = len(rows)
    return rows, report


def encode_sft(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    truncation: str = "drop",
) -> tuple[list[dict], DataReport]:
    """Encode conversation records to ``{"input_ids", "labels"}`` rows.

    Every assistant turn is a target, from its first content token through the template's end
    of turn (``<|im_end|>`` and the newline after it for ChatML); system and user turns and the
    template tokens that open each assistant turn are -100 in `labels`. Other record keys pass
    through. See the module docstring for `truncation`; dropped rows are counted in the report.
    """
    _check_arguments(tokenizer, max_length, truncation)
    report = DataReport(
        source=f"encode_sft(max_length={max_length}, truncation={truncation!r})",
        total=len(records),
    )
    rows = []
    for index, record in enumerate(records):
        try:
            encoded = _encode_conversation(record, tokenizer, max_length, truncation)
        except RowRejected as reason:
            report.drop(str(reason), row_label(record, index))
            continue
        extras = {k: v for k, v in record.items() if k not in ("messages", SOURCE_ROW)}
        rows.append({**extras, **encoded})
    report.kept = len(rows)
    return rows, report


def encode_preference(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    truncation: str = "drop",
) -> tuple[list[dict], DataReport]:
    """Encode preference records to ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` rows.

    The model sees ``prompt_ids + chosen_ids`` and ``prompt_ids + rejected_ids``; `prompt_ids`
    ends with the template's generation prompt (``<|im_start|>assistant\\n`` for ChatML) and each
    completion includes the template's end of turn. Extra keys such as ``margin`` pass through.
    Rows with an empty completion, identical chosen and rejected, or that do not fit
    `max_length` under `truncation` are dropped and counted in the report.
    """
    return _encode_each(
        records, tokenizer, _encode_pair, name="encode_preference", max_length=max_length,
        truncation=truncation,
    )  # fmt: skip


def encode_unpaired(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    truncation: str = "drop",
) -> tuple[list[dict], DataReport]:
    """Encode unpaired records (`formats.unpair`'s) to ``{"prompt_ids", "completion_ids",
    "label"}`` rows, the label a bool (True: desirable).

    The model sees ``prompt_ids + completion_ids``, split as in `encode_preference`: the prompt
    ends with the template's generation prompt, the completion includes the end of turn. Rows
    with an empty prompt or completion, or that do not fit `max_length` under `truncation`, are
    dropped and counted in the report; other keys pass through.
    """
    return _encode_each(
        records, tokenizer, _encode_unpaired, name="encode_unpaired", max_length=max_length,
        truncation=truncation,
    )  # fmt: skip


# ----------------------------------------------------------------- batches (the Arrow pipeline)

# What each encoding's rows hold besides `extras` (the record's other keys, as JSON).
ENCODED_COLUMNS = {
    "sft": ("input_ids", "labels"),
    "preference": ("prompt_ids", "chosen_ids", "rejected_ids"),
    "unpaired": ("prompt_ids", "completion_ids", "label"),
    "prompt": ("prompt_ids",),
}
# The name the start-up summary gives each encoding's report (as the list encoders do).
ENCODER_NAMES = {"sft": "encode_sft", "preference": "encode_preference",
                 "unpaired": "encode_unpaired", "prompt": "encode_prompts"}  # fmt: skip
CUT_MEDIA = "truncation cut into media placeholder tokens"


def cuts_media(row: Mapping[str, Any], media_token_ids: frozenset[int] | set[int]) -> bool:
    """Whether truncation cut into an encoded row's media placeholders: the model needs one
    placeholder token per media feature, `media_tokens` of them (0 for a row without media)."""
    seq = row.get("input_ids", row.get("prompt_ids", []))
    return sum(1 for t in seq if t in media_token_ids) != row.get("media_tokens", 0)


@dataclass(frozen=True)
class Encoding:
    """How a task turns records into rows, as plain data: it travels to the worker processes
    of `datasets.map` and is part of the cache key.

    `kind`: "sft", "preference", "unpaired" or "prompt" (online RL: `data.prompts`).
    `all_labels` (SFT): every token is a target, not only the assistant turns. `margin_column`
    (preference): the record key whose number becomes the row's `margin`; without one a
    `margin` key is not kept. `unpair` (unpaired): preference records are first split into a
    desirable and an undesirable row (`formats.unpair`'s order). `max_prompt_length` and
    `prompt_truncation` (prompt, both required there): the prompt's limit and what happens
    past it (`prompts.PROMPT_TRUNCATION_MODES`); a prompt row has no completion, so the run's
    `max_length` / `truncation` do not apply to it.
    """

    kind: str
    all_labels: bool = False
    margin_column: str | None = None
    unpair: bool = False
    max_prompt_length: int | None = None
    prompt_truncation: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ENCODED_COLUMNS:
            raise ValueError(f"unknown encoding kind {self.kind!r}")
        if self.kind == "prompt" and None in (self.max_prompt_length, self.prompt_truncation):
            raise ValueError("a prompt encoding needs max_prompt_length and prompt_truncation")

    def describe(self, max_length: int, truncation: str) -> str:
        """The encoder's name and limits, as its report names them."""
        if self.kind == "prompt":
            return (f"{ENCODER_NAMES['prompt']}(max_prompt_length={self.max_prompt_length}, "
                    f"truncation={self.prompt_truncation!r})")  # fmt: skip
        return f"{ENCODER_NAMES[self.kind]}(max_length={max_length}, truncation={truncation!r})"


def encode_record(record: dict, encoding: Encoding, tokenizer: Any, max_length: int,
                  truncation: str) -> dict:  # fmt: skip
    """One conversation, preference or unpaired record as a row (`ENCODED_COLUMNS[kind]` plus
    its other keys), as the list encoders make it (prompt records: `prompts.encode_prompt`)."""
    if encoding.kind == "sft":
        encoded = _encode_conversation(record, tokenizer, max_length, truncation)
        if encoding.all_labels:
            encoded["labels"] = list(encoded["input_ids"])
        extras = {k: v for k, v in record.items() if k not in ("messages", SOURCE_ROW)}
        return {**extras, **encoded}
    if encoding.kind == "preference":
        if encoding.margin_column:
            record = {**record, "margin": float(record[encoding.margin_column])}
        row = _encode_pair(record, tokenizer, max_length, truncation)
        if not encoding.margin_column:
            row.pop("margin", None)
        return row
    if encoding.kind == "unpaired":
        return _encode_unpaired(record, tokenizer, max_length, truncation)
    raise ValueError(f"encode_record does not encode {encoding.kind!r} records")


def check_encoding_arguments(tokenizer: Any, max_length: int, truncation: str) -> None:
    """The list encoders' checks of their arguments (truncation mode, length, chat template)."""
    _check_arguments(tokenizer, max_length, truncation)

"""Load a dataset and map its rows to canonical records.

Canonical records (what every later stage consumes):

- conversation / prompt_response -> ``{"messages": [{"role": ..., "content": str}, ...]}`` with
  roles ``system``, ``user``, ``assistant``.
- preference / hh -> ``{"prompt": [messages up to and including the last user turn],
  "chosen": [assistant message(s)], "rejected": [assistant message(s)]}``.
- unpaired -> ``{"prompt": [messages], "completion": [assistant message(s)], "label": bool}``:
  one completion judged desirable (True) or undesirable (False), the data KTO learns from; the
  file's `label` may be a bool, 1/0 or "good"/"bad" (`unpair` splits preference records into
  such rows).
- prompt -> ``{"prompt": [messages ending with a user turn]}``: prompt-only data for online RL
  (`data.prompts` encodes it; conversations ending with a user turn are also accepted there).
- ranked_pair -> a preference record: align-anything's layout, two answers `response_1`,
  `response_2` to a `prompt` (or `question`) and `overall_response`, the number of the better
  one (1 or 2; a row with another value is dropped and counted).

align-anything's column names serve as ours where a file lacks ours (`ALIAS_COLUMNS`):
`question` for `prompt`, `image` (one image: a path, bytes, or `datasets`' image struct) for
`images`, `audio_path` (a path or `{"array", "sampling_rate"}`) for `audio`.

Columns a format does not consume (``margin`` for reward models, ids, scores, media) pass through
unchanged. Every record also remembers where it came from under `SOURCE_ROW` (``"line 12"``), so
messages name the file's own row numbers after the train/eval split; the encoders never copy that
key into the encoded rows. Rows that cannot be turned into a record are dropped and counted in a
`DataReport`, never silently trained on; problems with the file itself raise `DataError` before
any work.

Row numbers in every message count from 1: ``line N`` for a JSON-lines file (the line as a text
editor numbers it, blank lines included), ``FILE line N`` for one of several such files, and
``row N`` (the N-th data row) for everything else.
"""

from __future__ import annotations

import difflib
import math
import numbers
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from align_anything.data.convert import CONVERTERS, HH_ASSISTANT, RowRejected
from align_anything.data.sources import columns_of, load_dataset, row_dicts, undecodable_text
from align_anything.errors import ConfigError, DataError, did_you_mean

FORMATS = (
    "auto", "conversation", "prompt_response", "preference", "hh", "unpaired", "prompt",
    "ranked_pair",
)  # fmt: skip
# Column names of align-anything's data (its `prompt` / `question`, `image`, `audio_path`,
# `response_1` / `response_2` / `overall_response`), so its users bring their files unchanged:
# a file column -> the canonical name it stands for when the file has none of that name.
ALIAS_COLUMNS = {"question": "prompt", "image": "images", "audio_path": "audio"}
# Rows `load_records` reads from the loaded file at a time.
LOAD_BATCH = 1000

# Names `columns` may map; "completion" is accepted as another name for "response".
CANONICAL_COLUMNS = (
    "messages",
    "prompt",
    "response",
    "completion",
    "chosen",
    "rejected",
    "system",
    "margin",
    "label",
)


MAX_EXAMPLE_ROWS = 5
# Record key holding where the record came from, e.g. "line 12" (see the module docstring).
SOURCE_ROW = "_source_row"


def row_label(record: Mapping[str, Any], index: int) -> str:
    """Where `record` came from ("line 12"); "row N" (its 1-based position) for a record that
    does not say."""
    label = record.get(SOURCE_ROW) if isinstance(record, Mapping) else None
    return label if isinstance(label, str) else f"row {index + 1}"


def describe_rows(labels: Sequence[str]) -> str:
    """Labels "line 3", "line 7" -> "lines 3, 7"; labels of different kinds are listed as they
    are."""
    if not labels:
        return ""
    heads = {label.rpartition(" ")[0] for label in labels}
    if len(labels) == 1 or len(heads) != 1:
        return ", ".join(labels)
    return f"{heads.pop()}s {', '.join(label.rpartition(' ')[2] for label in labels)}"


@dataclass
class DataReport:
    """What a stage kept and dropped, and why.

    Dropped rows are named by where they came from in the source file, counted from 1 ("line 12"
    of a JSON-lines file, "row 12" otherwise: see the module docstring), also in the reports of
    the encoders, which read the label each record carries (`SOURCE_ROW`).
    """

    source: str
    total: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    first_rows: dict[str, list[str]] = field(default_factory=dict)
    format: str = ""

    def drop(self, reason: str, row: str) -> None:
        """Count one dropped row under `reason`, remembering the first few row labels."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        rows = self.first_rows.setdefault(reason, [])
        if len(rows) < MAX_EXAMPLE_ROWS:
            rows.append(row)

    def summary(self) -> str:
        """One line of totals, then one line per drop reason with example row numbers."""
        fmt = f" as {self.format}" if self.format else ""
        n_dropped = sum(self.dropped.values())
        head = f"{self.source}{fmt}: kept {self.kept} of {self.total} rows"
        if not n_dropped:
            return head
        lines = [f"{head}, dropped {n_dropped} (line and row numbers of the file, from 1):"]
        for reason, count in sorted(self.dropped.items(), key=lambda item: -item[1]):
            rows = self.first_rows.get(reason, [])
            more = ", ..." if count > len(rows) else ""
            lines.append(f"  {count:>7}  {reason} ({describe_rows(rows)}{more})")
        return "\n".join(lines)


# --------------------------------------------------------------------------- column mapping


def _check_columns_argument(columns: Mapping[str, str] | None) -> dict[str, str]:
    if not columns:
        return {}
    unknown = [name for name in columns if name not in CANONICAL_COLUMNS]
    if unknown:
        problems = "; ".join(
            f"data.columns.{name}{did_you_mean(name, CANONICAL_COLUMNS)}" for name in unknown
        )
        raise ConfigError(
            f"unknown canonical column name(s): {problems}. Allowed: {', '.join(CANONICAL_COLUMNS)}"
        )
    if "response" in columns and "completion" in columns:
        raise ConfigError(
            "data.columns.response and data.columns.completion name the same thing; set one"
        )
    return {
        ("response" if name == "completion" else name): str(col) for name, col in columns.items()
    }


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _missing_column_error(
    name: str, source: str, found: Sequence[str], fmt: str, mapped_from: str | None = None
) -> DataError:
    """The error for a column the format needs and the file lacks, with the mapping that fixes it."""
    listed = ", ".join(f"'{c}'" for c in found)
    if mapped_from is not None:
        missing = f"column '{mapped_from}' (set by data.columns.{name})"
        guess = _closest(mapped_from, found)
        hint = did_you_mean(mapped_from, found)
    else:
        missing = f"column '{name}'"
        guess = _closest(name, found)
        hint = did_you_mean(name, found)
    fix = (
        f"data.columns.{name}={guess}"
        if guess
        else f"data.columns.{name}=<one of the columns found>"
    )
    return DataError(
        f"missing {missing} in {source}, needed by format '{fmt}'{hint}; "
        f"columns found: {listed}. Fix: {fix}"
    )


def _detect_format(names: set[str], first_row: Mapping[str, Any], source: str, found) -> str:
    """Pick a format from the (mapped) column names; preference wins over `messages` because
    preference files often carry a `messages` copy of the chosen conversation."""
    if {"prompt", "chosen", "rejected"} <= names:
        return "preference"
    if {"chosen", "rejected"} <= names:
        chosen = first_row.get("chosen")
        if isinstance(chosen, str) and _looks_hh(chosen):
            return "hh"
        if isinstance(chosen, list):
            return "preference"  # message lists; the prompt is their shared beginning
        raise _missing_column_error("prompt", source, found, "preference")
    if "messages" in names:
        return "conversation"
    if {"prompt", "response", "label"} <= names:
        return "unpaired"
    if {"response_1", "response_2", "overall_response"} <= names:
        return "ranked_pair"
    if "prompt" in names and "response" in names:
        return "prompt_response"
    if "prompt" in names:
        return "prompt"
    listed = ", ".join(f"'{c}'" for c in found)
    raise DataError(
        f"cannot tell the format of {source} from its columns ({listed}). Formats and the "
        "columns they need: conversation: messages; prompt_response: prompt + response "
        "(or completion); preference: prompt + chosen + rejected; hh: chosen + rejected "
        "holding '\\n\\nHuman: ... \\n\\nAssistant: ...' transcripts; unpaired: prompt + "
        "completion + label; prompt: prompt alone (online RL); ranked_pair: prompt (or "
        "question) + response_1 + response_2 + overall_response. Set data.format=<format> "
        "and map your columns, e.g. data.columns.prompt=<column>"
    )


def _looks_hh(text: str) -> bool:
    return HH_ASSISTANT in text and ("\n\nHuman:" in text or text.startswith("Human:"))


def _required_columns(fmt: str, names: set[str], first_row: Mapping[str, Any]) -> list[str]:
    if fmt == "conversation":
        return ["messages"]
    if fmt == "prompt_response":
        return ["prompt", "response"]
    if fmt == "hh":
        return ["chosen", "rejected"]
    if fmt == "unpaired":
        return ["prompt", "response", "label"]
    if fmt == "prompt":
        return ["prompt"]
    if fmt == "ranked_pair":
        return ["prompt", "response_1", "response_2", "overall_response"]
    # preference: a prompt column is optional only when chosen/rejected are message lists.
    if "prompt" not in names and isinstance(first_row.get("chosen"), list):
        return ["chosen", "rejected"]
    return ["prompt", "chosen", "rejected"]


# --------------------------------------------------------------------------- public API


@dataclass
class OpenedSource:
    """A loaded source and how its rows become records: the format (detected or given) and the
    canonical name -> file column mapping, checked against the file's columns."""

    dataset: Any  # datasets.Dataset of the file's rows (`sources.row_dicts` reads them)
    columns: list[str]  # the file's columns (`sources.columns_of`)
    path: str  # as given (data.path)
    source: str  # where it came from, as messages name it
    row_names: Any  # `RowNames`: "line 12"
    files: list  # the local files it was read from ([] for a hub dataset)
    format: str
    renames: dict[str, str]

    @property
    def kind(self) -> str:
        """The record kind its rows become ("conversation", "preference", "unpaired",
        "prompt")."""
        return FORMAT_KINDS[self.format]

    def rows(self, batch: Mapping[str, list]) -> list[dict[str, Any]]:
        """The file rows of a batch of `dataset` as dicts over `columns`."""
        return row_dicts(batch, self.columns)

    def convert(self, raw: Mapping[str, Any], index: int) -> tuple[dict | None, str | None]:
        """(record, None) for file row `raw` (number `index`), or (None, the drop reason)."""
        convert, consumed = CONVERTERS[self.format]
        row = {name: raw[column] for name, column in self.renames.items()}
        try:
            record = convert(row)
        except RowRejected as reason:
            return None, str(reason)
        record.update({name: value for name, value in row.items() if name not in consumed})
        record[SOURCE_ROW] = self.row_names(index)
        return record, None


# The record kind each format's rows become.
FORMAT_KINDS = {
    "conversation": "conversation", "prompt_response": "conversation",
    "preference": "preference", "hh": "preference", "unpaired": "unpaired", "prompt": "prompt",
    "ranked_pair": "preference",
}  # fmt: skip


def open_source(
    path: str,
    *,
    format: str = "auto",
    columns: Mapping[str, str] | None = None,
    split: str = "train",
) -> OpenedSource:
    """Load `path` (see `load_records`) and decide how its rows map to records, raising the
    errors for a bad file, format or column mapping before any row is converted."""
    if format not in FORMATS:
        raise ConfigError(
            f"data.format={format!r} is not a format{did_you_mean(format, FORMATS)}; "
            f"allowed: {', '.join(FORMATS)}"
        )
    mapping = _check_columns_argument(columns)
    dataset, source, row_names, files = load_dataset(path, split)
    found = columns_of(dataset)

    for name, column in mapping.items():
        if column not in found:
            raise _missing_column_error(name, source, found, format, mapped_from=column)
    mapped_sources = set(mapping.values())
    # canonical name -> file column; a mapped name hides a file column of the same name.
    renames = dict(mapping)
    for column in found:
        if column in mapped_sources:
            continue
        name = column
        if column == "completion" and "response" not in found and "response" not in renames:
            name = "response"
        if name not in renames:
            renames[name] = column
    for column, name in ALIAS_COLUMNS.items():
        if renames.get(column) == column and name not in renames:
            renames[name] = renames.pop(column)
    names = set(renames)

    try:
        first = row_dicts(dataset[:1], found)[0]
    except UnicodeDecodeError as err:
        raise undecodable_text(err, source, row_names(0), files) from None
    first_row = {name: first[column] for name, column in renames.items()}
    fmt = format if format != "auto" else _detect_format(names, first_row, source, found)
    for name in _required_columns(fmt, names, first_row):
        if name not in names:
            # An unpaired file calls its answer column `completion` (mapped to `response`).
            shown = "completion" if fmt == "unpaired" and name == "response" else name
            raise _missing_column_error(shown, source, found, fmt)
    return OpenedSource(dataset, found, path, source, row_names, files, fmt, renames)


def load_records(
    path: str,
    *,
    format: str = "auto",
    columns: Mapping[str, str] | None = None,
    split: str = "train",
) -> tuple[list[dict], DataReport]:
    """Load `path` and return its rows as canonical records plus a report of dropped rows.

    `path` is a local file (.json, .jsonl, .json(l).gz, .parquet, .csv), a local folder of such
    files (split by file name the way `datasets` does: train*, test*/eval*, ...), a built-in
    dataset name, or a hub dataset name. A single file serves as whichever `split` is asked for;
    slices such as ``train[:100]`` work everywhere.

    `format` is one of ``auto``, ``conversation``, ``prompt_response``, ``preference``, ``hh``,
    ``unpaired``. ``auto`` picks, in order: prompt+chosen+rejected -> preference; chosen+rejected
    holding HH transcripts -> hh (holding message lists -> preference with their shared
    beginning as the prompt); messages -> conversation; prompt+completion (or response)+label ->
    unpaired; prompt+response (or completion) -> prompt_response.

    `columns` maps canonical names to the file's names, e.g. ``{"prompt": "question"}``.
    Columns the format does not use pass through unchanged. Raises `DataError` for a file that is
    missing, empty or unreadable and for a missing column; rows that cannot be converted are
    dropped and counted in the report. (Training runs read sources through `data.pipeline`,
    which converts the same way in batches, into Arrow.)
    """
    opened = open_source(path, format=format, columns=columns, split=split)
    dataset = opened.dataset
    report = DataReport(source=opened.source, total=len(dataset), format=opened.format)
    records = []
    index = 0
    batches = dataset.iter(batch_size=LOAD_BATCH)
    while index < len(dataset):
        try:
            rows = opened.rows(next(batches))
        except UnicodeDecodeError as err:  # pyarrow keeps bytes unchecked until they are read
            raise undecodable_text(
                err, opened.source, opened.row_names(index), opened.files
            ) from None
        for raw in rows:
            record, reason = opened.convert(raw, index)
            if record is None:
                report.drop(reason, opened.row_names(index))
            else:
                records.append(record)
            index += 1
    report.kept = len(records)
    return records, report


def split_records(
    records: Sequence[Any], *, eval_fraction: float, seed: int
) -> tuple[list[Any], list[Any]]:
    """Hold out `eval_fraction` of `records` (at least one when the fraction is positive and
    there are two or more records), chosen by `seed`. Returns (train, eval), each in the
    original order; the same records and seed always give the same split."""
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(records)
    n_eval = round(n * eval_fraction)
    if eval_fraction > 0 and n_eval == 0:
        n_eval = 1
    n_eval = min(n_eval, max(n - 1, 0))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held_out = set(order[:n_eval])
    train = [r for i, r in enumerate(records) if i not in held_out]
    evaluation = [r for i, r in enumerate(records) if i in held_out]
    return train, evaluation


def unpair(records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Unpaired records from `records`: each preference record becomes a desirable record
    (its chosen completion) and an undesirable one (its rejected completion), every desirable
    record first, then every undesirable one, each group in the given order (TRL's
    `unpair_preference_dataset` order); other columns and the source row are copied to both.
    Unpaired records pass through unchanged."""
    desirable: list[dict] = []
    undesirable: list[dict] = []
    passed: list[dict] = []
    for record in records:
        if "chosen" not in record:
            passed.append(dict(record))
            continue
        rest = {k: v for k, v in record.items() if k not in ("chosen", "rejected")}
        desirable.append({**rest, "completion": record["chosen"], "label": True})
        undesirable.append({**rest, "completion": record["rejected"], "label": False})
    return passed + desirable + undesirable


# What a task of a record kind also accepts (KTO: preference pairs, each split in two rows).
# Online RL: conversations ending with a user turn (`data.prompts.to_prompt_records`).
_ALSO_ACCEPTED = {"unpaired": ("preference",), "prompt": ("conversation",)}
_WANTED = {
    "conversation": "conversation data",
    "preference": "preference data",
    "unpaired": "unpaired data (prompt, completion, label) or preference pairs",
    "prompt": "prompt data (a prompt column, or conversations ending with a user turn)",
}
_FOUND = {
    "conversation": "conversations",
    "preference": "preference pairs",
    "unpaired": "unpaired rows (prompt, completion, label)",
    "prompt": "prompts only (no completions)",
}


def record_kind(record: Mapping[str, Any]) -> str:
    """Which kind of canonical record `record` is: "preference" (it has `chosen`; such files
    often carry a `messages` copy too), "unpaired" (`completion` and `label`), "prompt" (a
    `prompt` alone) or "conversation"."""
    if "chosen" in record:
        return "preference"
    if "completion" in record and "label" in record:
        return "unpaired"
    if "prompt" in record and "messages" not in record:
        return "prompt"
    return "conversation"


def check_source_kind(found: str, kind: str, *, source: str, task: str) -> None:
    """Fail once, clearly, when a source holds another record kind (`found`) than the task
    needs ("conversation", "preference", "unpaired", which also takes preference pairs, or
    "prompt", which also takes conversations)."""
    if found == kind or found in _ALSO_ACCEPTED.get(kind, ()):
        return
    raise DataError(
        f"task={task} needs {_WANTED[kind]}, but {source} holds {_FOUND[found]}. "
        f"Choose such a dataset with data.path=..."
    )


def check_kind(records: Sequence[Mapping[str, Any]], kind: str, *, source: str, task: str) -> None:
    """`check_source_kind` for the kind of the first of `records` (none: nothing to check)."""
    if records:
        check_source_kind(record_kind(records[0]), kind, source=source, task=task)


# Rows named per kind of bad margin in the error message.
MAX_SHOWN = 5


def _margin_problem(value: Any) -> str | None:
    """What kind of bad margin `value` is, or None for a finite number."""
    if value is None:
        return "missing"
    if isinstance(value, str):  # a CSV file read as text (`sources`): the number's text
        try:
            value = float(value)
        except ValueError:
            return "not a number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "not a number"
    if not math.isfinite(value):
        return "NaN or infinite"
    return None


def check_margins(records: Iterable[Mapping[str, Any]], column: str, source: str) -> None:
    """Raise one DataError naming the rows (by their place in `source`, from 1) whose
    `column` is not a finite number. One pass over `records` (a list, or a view that reads
    them one at a time)."""
    bad: dict[str, list[str]] = {}  # kind of problem -> row labels
    example: dict[str, Any] = {}  # kind of problem -> its first value
    total, with_column, first_keys = 0, False, None
    for index, record in enumerate(records):
        total += 1
        first_keys = first_keys if first_keys is not None else sorted(record)
        with_column = with_column or column in record
        kind = _margin_problem(record.get(column))
        if kind is not None:
            bad.setdefault(kind, []).append(row_label(record, index))
            example.setdefault(kind, record.get(column))
    if not bad:
        return
    if not with_column:
        found = [k for k in first_keys or [] if k != SOURCE_ROW]
        raise DataError(
            f"rm.margin_column={column!r}: {source} has no column {column!r}; columns found: "
            f"{', '.join(found)}. Set rm.margin_column to one of them, or null for no margin"
        )
    count = sum(len(rows) for rows in bad.values())
    parts = [
        f"{kind}{f' (e.g. {example[kind]!r})' if kind == 'not a number' else ''} in "
        f"{describe_rows(rows[:MAX_SHOWN])}"
        + (f", ... ({len(rows)} rows)" if len(rows) > MAX_SHOWN else "")
        for kind, rows in bad.items()
    ]
    raise DataError(
        f"rm.margin_column={column!r}: {count} of {total} rows of {source} have no finite "
        f"number there: {'; '.join(parts)} (line and row numbers of the file, from 1). Margins "
        "must be finite numbers such as 0.5: fix those rows, or set rm.margin_column=null"
    )


def pick_column(names: Sequence[str], canonical: str, tried: Sequence[str],
                columns: Mapping[str, str], where: str) -> str:  # fmt: skip
    """The column of a media table (the pipeline families' images and clips) that stands for
    `canonical`: the one `data.columns` maps it to, else the first of `tried` the table has; a
    DataError naming the columns found otherwise."""
    if canonical in columns:
        if columns[canonical] not in names:
            raise DataError(
                f"{where} has no column '{columns[canonical]}' (set by data.columns."
                f"{canonical}); columns found: {', '.join(names)}"
            )
        return columns[canonical]
    for name in tried:
        if name in names:
            return name
    raise DataError(
        f"{where} has no {canonical} column (tried {', '.join(repr(t) for t in tried)}); "
        f"columns found: {', '.join(names)}. Map one with data.columns.{canonical}=NAME"
    )

"""A run's data in Arrow: sources read and converted to records, mixed, split, capped and
encoded with batched `datasets.map` (`num_proc` worker processes), so no stage holds every row
as Python objects. `data.cache` stores the result on disk, keyed by everything it depends on.

Stages, in order, each the same as the list functions of `formats` / `encode` (the numbers of a
run do not change with this path):

1. every source opened (`formats.open_source`: file, format and columns checked) and its kind
   checked against the task's, all before any row is converted;
2. each source's rows converted to records (JSON text in an Arrow column; media checked and
   their placeholders written in), dropped rows counted with their row numbers;
3. the held-out split: the eval sources, or `formats.split_records`' seeded choice from each
   source's own rows, before any mixing (a mixture that repeats rows cannot put one row on both
   sides);
4. a mixture (several sources) takes each source's training rows, all of them, a row count or a
   weighted share, seeded by `train.seed`; then `data.max_train_samples` / `max_eval_samples`:
   before any tokenisation;
5. KTO's preference pairs split into unpaired rows (`formats.unpair`'s order);
6. the encoding (`encode_batch`: `encode.encode_record`, or `prompts.encode_prompt` for online
   RL's prompts), dropped rows counted with their row numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from align_anything.data.convert import RowRejected
from align_anything.data.formats import (
    SOURCE_ROW,
    DataReport,
    OpenedSource,
    check_margins,
    check_source_kind,
    describe_rows,
    open_source,
    split_records,
)
from align_anything.data.jsonrow import dumps, loads
from align_anything.data.media import MEDIA_KEYS, MediaUnreadable, as_list
from align_anything.data.sources import undecodable_text
from align_anything.errors import DataError, UserError
from align_anything.families.language.encode import (
    CUT_MEDIA,
    ENCODED_COLUMNS,
    Encoding,
    check_encoding_arguments,
    cuts_media,
    encode_record,
)
from align_anything.families.language.prompts import check_prompt_arguments, encode_prompt
from align_anything.families.language.rows import RecordsView

# Rows per worker process below which `datasets.map` runs in this process: starting a worker
# costs about a second, more than tokenising a small file.
MIN_ROWS_PER_PROCESS = 2000
# The most worker processes `data.num_proc: null` starts (tokenising scales about linearly to
# here; beyond it, memory and start-up cost more than they save on a shared node).
AUTO_NUM_PROC_CAP = 8


@dataclass(frozen=True)
class Source:
    """One entry of `data.path` / `data.eval_path`: a path with its format and columns, and
    how much of it the mixture takes (all rows, `rows` rows, or a `weight`ed share)."""

    path: str
    format: str
    columns: dict[str, str]
    weight: float | None = None
    rows: int | None = None

    def describe(self) -> str:
        amount = (
            f", rows={self.rows}" if self.rows is not None
            else f", weight={self.weight:g}" if self.weight is not None else ""
        )  # fmt: skip
        return f"{self.path}{amount}"


@dataclass(frozen=True)
class Spec:
    """Everything the prepared data depends on besides the tokenizer: sources, split, caps."""

    train: tuple[Source, ...]
    eval: tuple[Source, ...]
    eval_fraction: float
    seed: int
    max_train: int | None
    max_eval: int | None
    task: str
    kind: str  # the record kind the task consumes
    encoding: Encoding
    max_length: int
    truncation: str

    @property
    def seeded(self) -> bool:
        """Whether `seed` changes the rows: a seeded held-out split or a sampled mixture."""
        sampled = any(s.weight is not None or s.rows is not None for s in self.train + self.eval)
        return sampled or (not self.eval and self.eval_fraction > 0)


def describe_sources(sources: Sequence[Source]) -> str:
    """`data.path` as messages name it: the path, or the mixture's paths and shares."""
    if len(sources) == 1 and sources[0].weight is None and sources[0].rows is None:
        return sources[0].path
    return " + ".join(s.describe() for s in sources)


def auto_num_proc(setting: int | None) -> int:
    """`data.num_proc`, or for null the CPU count this process may use, at most
    `AUTO_NUM_PROC_CAP`."""
    if setting is not None:
        return setting
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, AUTO_NUM_PROC_CAP))


def _processes(rows: int, num_proc: int) -> int | None:
    procs = min(num_proc, rows // MIN_ROWS_PER_PROCESS)
    return procs if procs > 1 else None


@dataclass
class Built:
    """What `build` made: the encoded splits, the held-out records (for the generation check),
    the reports the start-up summary prints, and the mixture's lines."""

    train: Any  # datasets.Dataset
    eval: Any
    eval_records: Any
    reports: list[DataReport]
    mixture: list[str]
    tokenised: int  # rows put through the tokenizer


def drop_report(source: str, total: int, drops: Any, labels: Any, *, fmt: str = "") -> tuple[
    DataReport, np.ndarray]:  # fmt: skip
    """The report of a stage from its `_drop` column (a reason or null per row) and its row
    labels, and the indices of the kept rows. Only dropped rows become Python objects."""
    import pyarrow.compute as pc

    dropped = pc.is_valid(drops).to_numpy(zero_copy_only=False)
    report = DataReport(source=source, total=total, format=fmt)
    where = np.flatnonzero(dropped)
    if len(where):
        reasons = drops.take(where).to_pylist()
        names = labels.take(where).to_pylist()
        for reason, name in zip(reasons, names, strict=True):
            report.drop(reason, name)
    kept = np.flatnonzero(~dropped)
    report.kept = len(kept)
    return report, kept


# ----------------------------------------------------------------- stage 2: records


def _features(**columns: str) -> Any:
    """`datasets.Features` of plain value columns, e.g. `_features(record="string")`."""
    import datasets

    return datasets.Features({name: datasets.Value(dtype) for name, dtype in columns.items()})


# The columns `_convert_batch` writes: the record as JSON (None: dropped), its row label, the
# drop reason and the media problem (None: none), whether it has media.
RECORD_COLUMNS = {"record": "string", SOURCE_ROW: "string", "_drop": "string",
                  "_problem": "string", "_media": "bool"}  # fmt: skip


def _convert_batch(batch: dict[str, list], indices: list[int], *, opened: OpenedSource,
                   media: Any, base_dir: Path | None) -> dict[str, list]:  # fmt: skip
    out: dict[str, list] = {"record": [], SOURCE_ROW: [], "_drop": [], "_problem": [],
                            "_media": []}  # fmt: skip
    for raw, index in zip(opened.rows(batch), indices, strict=True):
        record, reason = opened.convert(raw, index)
        label = opened.row_names(index)
        problem, has_media = None, False
        if record is not None:
            has_media = any(as_list(record.get(key)) for key in MEDIA_KEYS)
            if media is not None:
                try:
                    record = media.prepare_record(record, base_dir)
                except MediaUnreadable as err:
                    problem = f"{label}: {err}"
        out["record"].append(dumps(record) if record is not None else None)
        out[SOURCE_ROW].append(label)
        out["_drop"].append(reason)
        out["_problem"].append(problem)
        out["_media"].append(has_media)
    return out


def _map(dataset: Any, function: Any, *, features: Any, work: Path, name: str, num_proc: int,
         opened: OpenedSource | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """`dataset.map(function, batched=True)`, its files under `work` (never the `datasets`
    cache: the build folder is removed or published as a whole), no fingerprint hashing of the
    function (the cache key already says what the rows depend on).

    `features` types every column `function` writes. Without it `datasets` takes a column's type
    from the first writer batch (1,000 rows), and a nullable column (a drop reason, a media
    problem) that is None throughout that batch becomes type null: `datasets` 5 then refuses the
    first real value further on, so a file whose first bad row comes after row 1,000 crashed."""
    try:
        return dataset.map(
            function, batched=True, num_proc=_processes(len(dataset), num_proc),
            cache_file_name=str(work / f"{name}.arrow"), load_from_cache_file=False,
            new_fingerprint=name, remove_columns=dataset.column_names, features=features,
            **kwargs,
        )  # fmt: skip
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, UnicodeDecodeError):
            cause = cause.__cause__ or cause.__context__
        if cause is None or opened is None:
            raise
        raise undecodable_text(cause, opened.source, "a row", opened.files) from None


def read_records(opened: OpenedSource, *, media: Any, model_name: str, work: Path, name: str,
                 num_proc: int) -> tuple[Any, DataReport]:  # fmt: skip
    """The source's kept records (columns `record`, `_source_row`) and its report; media
    checked and expanded (`MediaSupport.prepare`'s rules and message), media for a text-only
    model refused."""
    from align_anything.families.language.multimodal import media_base_dir

    base_dir = media_base_dir(opened.path) if media is not None else None
    converted = _map(
        opened.dataset, _convert_batch, features=_features(**RECORD_COLUMNS), work=work,
        name=name, with_indices=True, opened=opened,
        num_proc=1 if media is not None else num_proc,
        fn_kwargs={"opened": dataclasses.replace(opened, dataset=None), "media": media,
                   "base_dir": base_dir},
    )  # fmt: skip
    table = converted.data
    report, kept = drop_report(
        opened.source, len(converted), table.column("_drop"), table.column(SOURCE_ROW),
        fmt=opened.format,
    )  # fmt: skip
    import pyarrow.compute as pc

    problems = table.column("_problem")
    if problems.null_count < len(problems):
        found = [p for p in problems.to_pylist() if p is not None]
        shown = "\n  ".join(found[:5]) + ("\n  ..." if len(found) > 5 else "")
        where = f" (relative paths are read from {base_dir})" if base_dir else ""
        raise DataError(
            f"{len(found)} row(s) of {opened.path} have missing, unreadable or too many media"
            f"{where} (numbered from 1 as in the file):\n  {shown}\nFix or remove those rows."
        )
    if media is None and pc.any(table.column("_media")).as_py():
        with_media = pc.filter(table.column(SOURCE_ROW), table.column("_media")).to_pylist()
        shown = describe_rows(with_media[:5]) + (", ..." if len(with_media) > 5 else "")
        raise UserError(
            f"{opened.path} has images or audio in {len(with_media)} row(s) ({shown}; numbered "
            f"from 1 as in the file), but model {model_name} is a text-only model. Use an "
            "image-text or audio-text model (e.g. model.name_or_path=llava-smollm2-shapes, or "
            "tiny-random-llava), or data without media."
        )
    records = converted.select(kept, keep_in_memory=True).select_columns(["record", SOURCE_ROW])
    return records, report


# ----------------------------------------------------------------- stage 3: mixtures


def mixture_rows(sources: Sequence[Source], sizes: Sequence[int], *, seed: int) -> list[np.ndarray]:
    """Which of each source's kept records the mixture takes (indices, in file order), seeded
    by `seed`: all of them (no `rows` or `weight`); `rows` of them (drawn without repeats, and
    when `rows` exceeds the source, every row as often as it fits whole plus a draw for the
    rest); or, for the sources with a `weight`, shares in proportion to the weights, as many
    rows as the scarcest weighted source allows without repeating a row."""
    weighted = [k for k, s in enumerate(sources) if s.weight is not None]
    total_weight = sum(sources[k].weight for k in weighted)
    scale = min((sizes[k] * total_weight / sources[k].weight for k in weighted), default=0.0)
    chosen = []
    for k, (source, size) in enumerate(zip(sources, sizes, strict=True)):
        rng = np.random.default_rng([seed, k])
        if source.rows is not None:
            wanted = source.rows
        elif source.weight is not None:
            wanted = min(size, math.floor(scale * source.weight / total_weight + 1e-9))
        else:
            chosen.append(np.arange(size))
            continue
        whole, rest = divmod(wanted, size) if size else (0, 0)
        parts = [np.arange(size)] * whole + [np.sort(rng.choice(size, rest, replace=False))]
        chosen.append(np.concatenate(parts).astype(np.int64))
    return chosen


def _mixture_lines(split: str, sources: Sequence[Source], taken: Sequence[int],
                   sizes: Sequence[int]) -> list[str]:  # fmt: skip
    total = max(sum(taken), 1)
    lines = [f"{split} mixture of {len(sources)} sources, {sum(taken)} rows:"]
    for source, n, size in zip(sources, taken, sizes, strict=True):
        repeats = f"; its {size} rows repeated, {n / size:.2f} times each" if n > size else ""
        lines.append(f"  {n:>8} rows ({100 * n / total:5.1f}%)  {source.describe()}{repeats}")
    return lines


def open_sources(sources: Sequence[Source], *, kind: str, task: str,
                 split: str) -> list[OpenedSource]:  # fmt: skip
    """Every source opened and its record kind checked, before any row is converted: a missing
    source, a bad column mapping or a source of another kind fails first."""
    opened = []
    for k, source in enumerate(sources):
        with naming_source(split, k, len(sources)):
            one = open_source(source.path, format=source.format, columns=source.columns)
            check_source_kind(one.kind, kind, source=one.path, task=task)
        opened.append(one)
    return opened


@contextlib.contextmanager
def naming_source(split: str, index: int, count: int) -> Iterator[None]:
    """A UserError raised inside names the source of a mixture it is about (`data.path[1] …`)."""
    try:
        yield
    except UserError as err:
        if count == 1:
            raise
        raise type(err)(f"{split}[{index}] {err}") from None


def _source_key(source: Source) -> tuple:
    """What makes two entries of a mixture the same rows: path, format and columns."""
    return source.path, source.format, tuple(sorted(source.columns.items()))


def _read_sources(sources: Sequence[Source], opened: Sequence[OpenedSource], *, split: str,
                  media: Any, model_name: str, work: Path,
                  num_proc: int) -> tuple[list[Any], list[DataReport]]:  # fmt: skip
    """Each entry's kept records (an entry listed twice is read once and shares the dataset)
    and the report of each distinct source."""
    parts, reports, read = [], [], {}
    for k, (source, one) in enumerate(zip(sources, opened, strict=True)):
        key = _source_key(source)
        if key not in read:
            read[key], report = read_records(
                one, media=media, model_name=model_name, work=work, name=f"{split}-{k}-records",
                num_proc=num_proc,
            )  # fmt: skip
            reports.append(report)
        parts.append(read[key])
    return parts, reports


def _mix(sources: Sequence[Source], parts: Sequence[Any], *, seed: int,
         split: str) -> tuple[Any, list[str]]:  # fmt: skip
    """The mixture of each entry's records `parts` by the entries' shares (one dataset), and
    the summary's lines about it (none for one source taken whole)."""
    import datasets

    if len(parts) == 1 and sources[0].weight is None and sources[0].rows is None:
        return parts[0], []
    sizes = [len(p) for p in parts]
    chosen = mixture_rows(sources, sizes, seed=seed)
    mixed = datasets.concatenate_datasets(
        [part.select(rows, keep_in_memory=True) for part, rows in zip(parts, chosen, strict=True)]
    )
    return mixed, _mixture_lines(split, sources, [len(rows) for rows in chosen], sizes)


def _split_each(sources: Sequence[Source], parts: Sequence[Any], *, eval_fraction: float,
                seed: int) -> tuple[list[Any], Any]:  # fmt: skip
    """Hold out `eval_fraction` of each source's own records (`formats.split_records`' seeded
    choice), before any mixing: a mixture that repeats rows would otherwise put copies of one
    row on both sides. An entry listed twice is split once. Returns each entry's training
    records and the held-out records of every distinct source (each row once)."""
    import datasets

    splits: dict[tuple, tuple[Any, Any]] = {}
    for source, part in zip(sources, parts, strict=True):
        key = _source_key(source)
        if key not in splits:
            train_idx, eval_idx = split_records(
                range(len(part)), eval_fraction=eval_fraction, seed=seed
            )
            splits[key] = (part.select(train_idx, keep_in_memory=True),
                           part.select(eval_idx, keep_in_memory=True))  # fmt: skip
    held_out = [held for _, held in splits.values()]
    held = held_out[0] if len(held_out) == 1 else datasets.concatenate_datasets(held_out)
    return [splits[_source_key(s)][0] for s in sources], held


# ----------------------------------------------------------------- stages 5-6: encoding


def _unpair_batch(batch: dict[str, list]) -> dict[str, list]:
    out: dict[str, list] = {"record": [], SOURCE_ROW: [], "_group": []}
    for text, label in zip(batch["record"], batch[SOURCE_ROW], strict=True):
        record = loads(text)
        if "chosen" not in record:
            rows = [(record, 0)]
        else:
            rest = {k: v for k, v in record.items() if k not in ("chosen", "rejected")}
            rows = [({**rest, "completion": record["chosen"], "label": True}, 1),
                    ({**rest, "completion": record["rejected"], "label": False}, 2)]  # fmt: skip
        for row, group in rows:
            out["record"].append(dumps(row))
            out[SOURCE_ROW].append(label)
            out["_group"].append(group)
    return out


def unpair_records(records: Any, *, work: Path, name: str) -> Any:
    """`formats.unpair` on a records dataset: unpaired records first, then every pair's chosen
    completion as a desirable row, then every rejected one, each group in the given order."""
    expanded = _map(
        records, _unpair_batch, work=work, name=name, num_proc=1,
        features=_features(record="string", **{SOURCE_ROW: "string"}, _group="int8"),
    )  # fmt: skip
    group = expanded.data.column("_group").to_numpy()
    order = np.argsort(group, kind="stable")
    return expanded.select(order, keep_in_memory=True).select_columns(["record", SOURCE_ROW])


def _encode_one(record: dict, encoding: Encoding, tokenizer: Any, max_length: int,
                truncation: str) -> dict:  # fmt: skip
    if encoding.kind == "prompt":
        return encode_prompt(
            record, tokenizer, max_prompt_length=encoding.max_prompt_length,
            truncation=encoding.prompt_truncation,
        )  # fmt: skip
    return encode_record(record, encoding, tokenizer, max_length, truncation)


def encode_batch(
    batch: dict[str, list], *, encoding: Encoding, tokenizer: Any, max_length: int,
    truncation: str, media_token_ids: frozenset[int] = frozenset(),
) -> dict[str, list]:  # fmt: skip
    """`datasets.map` (batched) over records stored as JSON (`record`, `_source_row`): the
    encoded columns, `extras` (the row's other keys as JSON, None when it has none: a prompt
    row's messages, reward fields and source row travel there and come back exactly), and
    `_drop`, the reason a row was dropped (None for a kept row; its other columns are then
    empty), and `_source_row` passed through. With `media_token_ids`, a row whose placeholder
    tokens truncation cut is dropped."""
    names = ENCODED_COLUMNS[encoding.kind]
    out: dict[str, list] = {name: [] for name in (*names, "extras", "_drop")}
    out[SOURCE_ROW] = list(batch[SOURCE_ROW])
    for text in batch["record"]:
        record = loads(text)
        try:
            row = _encode_one(record, encoding, tokenizer, max_length, truncation)
            if media_token_ids and cuts_media(row, media_token_ids):
                raise RowRejected(CUT_MEDIA)
        except RowRejected as reason:
            for name in names:
                out[name].append(None)
            out["extras"].append(None)
            out["_drop"].append(str(reason))
            continue
        for name in names:
            out[name].append(row.pop(name))
        out["extras"].append(dumps(row) if row else None)
        out["_drop"].append(None)
    return out


def _encoded_features(kind: str) -> Any:
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    features = {name: ids for name in ENCODED_COLUMNS[kind]}
    if kind == "unpaired":
        features["label"] = datasets.Value("bool")
    features["extras"] = datasets.Value("string")
    features["_drop"] = datasets.Value("string")
    features[SOURCE_ROW] = datasets.Value("string")
    return datasets.Features(features)


def encode_records(records: Any, *, spec: Spec, tokenizer: Any, media: Any, split: str,
                   work: Path, num_proc: int) -> tuple[Any, DataReport]:  # fmt: skip
    """The encoded rows of a records dataset and the report of what the encoding dropped."""
    import datasets

    encoding = spec.encoding
    source = f"{split} split, {encoding.describe(spec.max_length, spec.truncation)}"
    features = _encoded_features(encoding.kind)
    if not len(records):  # `map` of no rows makes no columns
        empty = datasets.Dataset.from_dict({k: [] for k in features}, features=features)
        return empty.remove_columns(["_drop", SOURCE_ROW]), DataReport(source=source)
    if encoding.unpair:
        records = unpair_records(records, work=work, name=f"{split}-unpaired")
    media_ids = frozenset(media.token_id(m) for m in media.modalities) if media else frozenset()
    encoded = _map(
        records, encode_batch, work=work, name=f"{split}-encoded",
        num_proc=1 if media is not None else num_proc, features=features,
        fn_kwargs={"encoding": encoding, "tokenizer": tokenizer, "max_length": spec.max_length,
                   "truncation": spec.truncation, "media_token_ids": media_ids},
    )  # fmt: skip
    report, kept = drop_report(
        source, len(encoded), encoded.data.column("_drop"), encoded.data.column(SOURCE_ROW),
    )  # fmt: skip
    kept_rows = encoded.select(kept, keep_in_memory=True)
    return kept_rows.remove_columns(["_drop", SOURCE_ROW]), report


# ----------------------------------------------------------------- the whole build


def open_all(spec: Spec) -> tuple[list[OpenedSource], list[OpenedSource]]:
    """Every training and eval source opened and checked (stage 1)."""
    train = open_sources(spec.train, kind=spec.kind, task=spec.task, split="data.path")
    evals = open_sources(spec.eval, kind=spec.kind, task=spec.task, split="data.eval_path")
    return train, evals


def build(spec: Spec, *, tokenizer: Any, media: Any, model_name: str, work: Path,
          num_proc: int, on_start: Any = None) -> Built:  # fmt: skip
    """Stages 1-6 (see the module docstring). `on_start(rows)` is called once, just before the
    tokenizer runs, with the number of records it will encode."""
    check_encoding_arguments(tokenizer, spec.max_length, spec.truncation)
    if spec.encoding.kind == "prompt":
        check_prompt_arguments(
            tokenizer, spec.encoding.max_prompt_length, spec.encoding.prompt_truncation
        )
    opened_train, opened_eval = open_all(spec)
    common = {"media": media, "model_name": model_name, "work": work, "num_proc": num_proc}
    parts, reports = _read_sources(spec.train, opened_train, split="train", **common)
    eval_mixture = []
    if spec.eval:
        eval_parts, _ = _read_sources(spec.eval, opened_eval, split="eval", **common)
        held_out, eval_mixture = _mix(spec.eval, eval_parts, seed=spec.seed, split="eval")
    elif spec.eval_fraction > 0:
        parts, held_out = _split_each(
            spec.train, parts, eval_fraction=spec.eval_fraction, seed=spec.seed
        )
    else:
        held_out = parts[0].select([], keep_in_memory=True)
    train, mixture = _mix(spec.train, parts, seed=spec.seed, split="train")
    if mixture and not spec.eval and spec.eval_fraction > 0:
        share = f"data.eval_fraction={spec.eval_fraction:g} of each source's own rows"
        mixture.append(f"held out before mixing: {len(held_out)} rows ({share})")
    mixture += eval_mixture
    if spec.max_train is not None and len(train) > spec.max_train:
        train = train.select(range(spec.max_train), keep_in_memory=True)
    if spec.max_eval is not None and len(held_out) > spec.max_eval:
        held_out = held_out.select(range(spec.max_eval), keep_in_memory=True)
    column = spec.encoding.margin_column
    if column:  # before any tokenisation, as the list path checks them
        check_margins(RecordsView(train), column, describe_sources(spec.train))
        held_out_source = describe_sources(spec.eval) if spec.eval else describe_sources(spec.train)
        check_margins(RecordsView(held_out), column, held_out_source)
    if on_start is not None:
        on_start(len(train) + len(held_out))
    encode = {"spec": spec, "tokenizer": tokenizer, "media": media, "work": work,
              "num_proc": num_proc}  # fmt: skip
    train_rows, train_report = encode_records(train, split="train", **encode)
    reports.append(train_report)
    eval_rows, eval_report = encode_records(held_out, split="eval", **encode)
    if len(held_out):
        reports.append(eval_report)
    return Built(train_rows, eval_rows, held_out.select_columns(["record"]), reports, mixture,
                 tokenised=len(train) + len(held_out))  # fmt: skip

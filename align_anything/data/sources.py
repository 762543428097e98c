"""Reading a dataset source into rows: local files (.json, .jsonl, .json(l).gz, .parquet,
.csv), folders of them, built-in names and hub datasets, all through `datasets`; naming each
row by its place in the file ("line 12"); and, on the error path only, finding the first bad
line of a file that `datasets` could not read (invalid UTF-8, a cut or truncated line) so the
message names it. `formats` turns these rows into canonical records."""

from __future__ import annotations

import difflib
import gzip
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from align_anything.data.builtin import BUILTIN_DATASETS, builtin_path
from align_anything.errors import DataError, did_you_mean

# File suffix -> `datasets` builder. Compressed JSON is decompressed by `datasets` itself.
DATA_SUFFIXES = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
# How much of a bad line an error message quotes.
EXCERPT_CHARS = 60


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, builder in DATA_SUFFIXES.items():
        if name.endswith(suffix):
            return builder
    return None


def _looks_local(path: str) -> bool:
    """A path the user meant as a file or folder, as opposed to a hub name like `org/name`."""
    return (
        path.startswith(("/", "./", "../", "~", "."))
        or _builder_for(Path(path)) is not None
        or "\\" in path
    )


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _is_no_rows_error(exc: BaseException) -> bool:
    # What `datasets` raises for a file that holds no rows (blank lines, a CSV header only,
    # an empty .gz): StopIteration, or "Instruction 'train' corresponds to no data!".
    root = _root_cause(exc)
    return isinstance(root, StopIteration) or "corresponds to no data" in str(root)


def _read_files(builder: str, data_files: dict[str, list[str]], split: str, what: str):
    files = [Path(f) for names in data_files.values() for f in names]
    if builder == "json" and not any(_is_json_array(f) for f in files):
        dataset = _read_json_lines(files, split)
        if len(dataset) == 0:
            raise DataError(f"{what} is empty: it holds no data rows")
        return dataset
    import datasets

    # datasets logs an ERROR line of its own for an unreadable JSON/parquet file before raising; the
    # DataError below says it once, naming the file.
    builder_logger = logging.getLogger("datasets.packaged_modules")
    level = builder_logger.level
    builder_logger.setLevel(logging.CRITICAL)
    try:
        try:
            dataset = datasets.load_dataset(builder, data_files=data_files, split=split)
        except Exception as exc:
            if builder != "csv" or not _is_type_error(exc):
                raise
            # `datasets` guesses a CSV column's type per 10,000 rows (pandas' guess) and casts
            # later chunks to the first: a column of 0/1 with "maybe" on row 15,000 fails the
            # file. CSV cells are text: read them as text, so that row is one row's drop.
            features = datasets.Features(
                {name: datasets.Value("string") for name in _csv_header(files[0])}
            )
            dataset = datasets.load_dataset(
                builder, data_files=data_files, split=split, features=features
            )
    except Exception as exc:
        if _is_no_rows_error(exc):
            raise DataError(f"{what} is empty: it holds no data rows") from exc
        located = _first_bad_line(files, builder)
        if located is not None:
            raise DataError(_bad_line_message(what, files, located)) from exc
        root = _root_cause(exc)
        detail = str(root) or type(root).__name__
        raise DataError(
            f"{what} cannot be read as {builder.upper()}: {type(root).__name__}: {detail}"
        ) from exc
    finally:
        builder_logger.setLevel(level)
    if len(dataset) == 0:
        raise DataError(f"{what} is empty: it holds no data rows")
    return dataset


def _is_type_error(exc: BaseException) -> bool:
    """Whether `datasets` failed on a value of another type than its column's."""
    import pyarrow as pa
    from datasets.table import CastError

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, (pa.ArrowInvalid, pa.ArrowTypeError, CastError, TypeError)):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _csv_header(path: Path) -> list[str]:
    import csv

    with open(path, newline="", encoding="utf-8-sig") as handle:
        return next(csv.reader(handle), [])


# ----------------------------------------------------------------- JSON lines, one row at a time

# A JSON-lines file is read line by line here, not by `datasets`' JSON builder: the builder
# infers each column's type from the first 10 MB of the file and casts later chunks to it, so a
# row further on whose value has another type (a number where text was) is not one bad row but a
# bad chunk. Measured with datasets 5.2 on 20,000 HH pairs: `"chosen": 5` on line 15,000 made
# the builder JSON-encode the column for the rest of the file, and 5,744 good rows were dropped
# as "transcript without an Assistant turn" (with the `preference` format they would have been
# trained on, quotes and escapes included); a column first seen after 10 MB failed the whole
# load. Here every line is parsed on its own, its text kept in one string column and parsed
# again by whoever reads the row (`row_dicts`), so a row's values are exactly its JSON and a bad
# value is that row's drop reason in the report.
JSON_LINE = "_json_line"  # the line's text (a JSON object)
JSON_KEYS = "_json_keys"  # its keys, in order: the file's columns without parsing it again


def _is_json_array(path: Path) -> bool:
    """Whether a .json file holds one JSON array (read whole by `datasets`, as one chunk)."""
    try:
        with _open_binary(path) as handle:
            head = handle.read(4096)
    except OSError:  # e.g. a damaged .gz: `datasets`' own error says so
        return True
    return head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"[")


def _json_line_rows(names: list[str], stamps: list[tuple[int, int]]) -> Iterator[dict[str, Any]]:
    """The rows of JSON-lines files for `datasets.Dataset.from_generator` (`stamps`, each file's
    size and modification time, are only there to key `datasets`' cache of the result); the
    first bad line is a DataError naming it, as `_first_bad_line_in` would."""
    del stamps
    for name in names:
        path = Path(name)
        with _open_binary(path) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8-sig" if number == 1 else "utf-8")
                    value = json.loads(text)
                except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
                    value = None
                if not isinstance(value, dict):
                    raise DataError(_bad_line_message(f"data {path}", [path], _located(path)))
                yield {JSON_LINE: text, JSON_KEYS: list(value)}


def _located(path: Path) -> str:
    located = _first_bad_line([path], "json")
    return located if located is not None else f"{path} has a line that is not a JSON object"


def _read_json_lines(files: Sequence[Path], split: str) -> Any:
    """The rows of JSON-lines `files` (columns `JSON_LINE`, `JSON_KEYS`), in `datasets`' cache
    like its builder's output; `split` may be sliced ("train[:100]")."""
    import datasets

    features = datasets.Features(
        {JSON_LINE: datasets.Value("string"), JSON_KEYS: datasets.List(datasets.Value("string"))}
    )
    stamps = [(f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    try:
        dataset = datasets.Dataset.from_generator(
            _json_line_rows, features=features,
            gen_kwargs={"names": [str(f.resolve()) for f in files], "stamps": stamps},
        )  # fmt: skip
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        if _is_no_rows_error(exc):
            return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
        raise
    if split != _split_base(split):
        ranges = datasets.ReadInstruction.from_spec(split).to_absolute(
            {_split_base(split): len(dataset)}
        )
        indices = [i for r in ranges for i in range(r.from_, r.to)]
        dataset = dataset.select(indices)
    return dataset


def columns_of(dataset: Any) -> list[str]:
    """The columns of a dataset `load_dataset` returned: for JSON lines, every key any row has,
    in the order they first appear."""
    if JSON_KEYS not in dataset.column_names:
        return list(dataset.column_names)
    import pyarrow.compute as pc

    keys = dataset.data.column(JSON_KEYS)
    return pc.unique(pc.list_flatten(keys)).to_pylist() if len(keys) else []


def row_dicts(batch: Mapping[str, list], columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a batch of a `load_dataset` dataset as dicts over `columns` (`columns_of`),
    a column a row lacks as None (as `datasets` gives it)."""
    if JSON_LINE in batch:
        parsed = [json.loads(text) for text in batch[JSON_LINE]]
        return [{c: row.get(c) for c in columns} for row in parsed]
    size = len(next(iter(batch.values()))) if batch else 0
    return [{c: batch[c][k] for c in columns} for k in range(size)]


# ----------------------------------------------------------------- bad lines (the error path only)


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _excerpt(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…")


def _utf8_problem(line: bytes, column: int, line_start: int) -> str:
    """The message for a byte that is not UTF-8 at offset `column` of a line that starts at byte
    `line_start` of the file."""
    return (
        f"has invalid UTF-8 at byte offset {line_start + column} of the file (byte "
        f"0x{line[column]:02x}, column {column + 1} of the line): data files must be UTF-8 "
        "text; re-encode the file (e.g. iconv -f latin1 -t utf-8) or fix that line"
    )


def _json_line_problem(line: bytes, line_start: int, *, last: bool) -> str | None:
    """What is wrong with one non-blank line of a JSON-lines file, or None. (NaN and Infinity
    pass, as they do in `datasets`.)"""
    body = line.rstrip(b"\r\n")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.reason != "unexpected end of data":
            return _utf8_problem(line, err.start, line_start)
        # An incomplete character at the very end: the line was cut inside it.
        text = body[: err.start].decode("utf-8", errors="replace")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        if err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string"):
            if last:
                return (
                    f"ends before its JSON object does: the file looks truncated, e.g. by an "
                    f"interrupted write or copy: {_excerpt(text)}"
                )
            return (
                f"ends before its JSON object does: the line looks cut in the middle (the rest "
                f"of the row is missing): {_excerpt(text)}"
            )
        return f"is not valid JSON ({err.msg} at column {err.colno}): {_excerpt(text)}"
    if not isinstance(value, dict):
        kind = "an array" if isinstance(value, list) else f"a {type(value).__name__}"
        return f'holds {kind}, not a row object {{"column": value, ...}}: {_excerpt(text)}'
    return None


def _json_document_problem(data: bytes) -> str | None:
    """What is wrong with a whole-document JSON file (an array of rows), as "line N ...", or None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        line_end = data.find(b"\n", err.start)
        line = data[line_start : line_end if line_end >= 0 else len(data)]
        number = data.count(b"\n", 0, err.start) + 1
        problem = _utf8_problem(line, err.start - line_start, line_start)
        return f"line {number} (lines count from 1) {problem}"
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        if err.pos >= len(text.rstrip()):
            return (
                f"line {err.lineno} (the last line; lines count from 1) ends before the JSON "
                "document does: the file looks truncated, e.g. by an interrupted write or copy"
            )
        return (
            f"line {err.lineno} (lines count from 1) is not valid JSON ({err.msg} at column "
            f"{err.colno})"
        )
    return None


def _first_bad_line_in(path: Path, builder: str) -> str | None:
    """The first problem `datasets` tripped over in one file, as "line N ..." (from 1), or None.
    Reads the file once; only called after a load failed."""
    with _open_binary(path) as handle:
        head = handle.read(4096).lstrip()
    if builder == "json" and head.startswith(b"["):
        with _open_binary(path) as handle:
            return _json_document_problem(handle.read())
    with _open_binary(path) as handle:
        lines = handle.readlines()
    last = max((n for n, line in enumerate(lines) if line.strip()), default=-1)
    offset = 0
    for n, line in enumerate(lines):
        start, offset = offset, offset + len(line)
        if builder == "json":
            if not line.strip():
                continue
            problem = _json_line_problem(line, start, last=n == last)
        else:  # CSV: only the text encoding can be checked line by line
            try:
                line.decode("utf-8")
                problem = None
            except UnicodeDecodeError as err:
                problem = _utf8_problem(line, err.start, start)
        if problem is not None:
            note = "the last line; " if n == last else ""
            return f"line {n + 1} ({note}lines count from 1) {problem}"
    return None


def _first_bad_line(files: Sequence[Path], builder: str) -> str | None:
    """The first bad line of the first bad file as "FILE line N <what is wrong>", or None
    (parquet, or no line-level problem found)."""
    if builder not in ("json", "csv"):
        return None
    for path in files:
        try:
            problem = _first_bad_line_in(path, builder)
        except OSError:  # e.g. a damaged .gz: leave the message to `datasets`' error
            return None
        if problem is not None:
            return f"{path} {problem}"
    return None


def _bad_line_message(what: str, files: Sequence[Path], located: str) -> str:
    """`located` ("FILE line N ...") as the whole message for one file, after `what` (the
    folder) for several."""
    return f"data file {located}" if len(files) == 1 else f"{what}: data file {located}"


# ----------------------------------------------------------------- naming rows by their lines


class RowNames:
    """Names the rows of a loaded dataset by where they are in its files, from 1: "line N" of a
    JSON-lines file (blank lines, which `datasets` skips, counted), "FILE line N" when there are
    several files, "row N" when the lines do not map onto the rows (a JSON array, CSV, parquet,
    a hub dataset). Costs one pass over the lines of each JSON file, small next to the parse
    `datasets` does."""

    def __init__(self, files: Sequence[Path], n_rows: int, *, base: Path | None = None) -> None:
        self._files: list[tuple[int, str, list[int] | None]] = []  # (first row, name, lines)
        if not files or any(_builder_for(f) != "json" for f in files):
            return
        first = 0
        for path in files:
            name = "" if len(files) == 1 else f"{path.relative_to(base) if base else path} "
            count, lines = self._count_rows(path)
            self._files.append((first, name, lines))
            first += count
        if first != n_rows:  # e.g. a pretty-printed JSON array
            self._files = []

    @staticmethod
    def _count_rows(path: Path) -> tuple[int, list[int] | None]:
        """(non-blank lines, their line numbers or None when no line is blank)."""
        total, blank = 0, []
        with _open_binary(path) as handle:
            for total, line in enumerate(handle, 1):  # noqa: B007 (total: the last line's number)
                if not line.strip():
                    blank.append(total)
        if not blank:
            return total, None
        skip = set(blank)
        return total - len(blank), [n for n in range(1, total + 1) if n not in skip]

    def __call__(self, index: int) -> str:
        for first, name, lines in reversed(self._files):
            if index >= first:
                local = index - first
                return f"{name}line {lines[local] if lines is not None else local + 1}"
        return f"row {index + 1}"


def _split_base(split: str) -> str:
    # "train[:1000]" -> "train": a single file serves whichever split is asked for.
    return re.split(r"[\[+]", split, maxsplit=1)[0] or "train"


def _load_file(path: Path, split: str):
    builder = _builder_for(path)
    if builder is None:
        raise DataError(
            f"data file {path} has an unsupported type; use one of {', '.join(DATA_SUFFIXES)}"
        )
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty (0 bytes)")
    dataset = _read_files(builder, {_split_base(split): [str(path)]}, split, f"data file {path}")
    return dataset, [path]


def _directory_files(path: Path, split: str) -> tuple[str, list[str]]:
    """(builder, files) of split `split` of a data folder, or the DataError that says why none."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    # `datasets`' own convention assigns files to splits by name (train*, test*, eval*, ...);
    # everything else is "train". Only files of the supported types are considered.
    try:
        resolved = DataFilesDict.from_patterns(
            get_data_patterns(str(path)),
            base_path=str(path),
            allowed_extensions=list(DATA_SUFFIXES),
        )
        files_by_split = {
            str(name): sorted(str(f) for f in files) for name, files in resolved.items()
        }
    except Exception:  # `datasets` raises when no file matches at all
        files_by_split = {}
    files_by_split = {
        name: [f for f in files if _builder_for(Path(f)) and "/." not in f[len(str(path)) :]]
        for name, files in files_by_split.items()
    }
    files_by_split = {name: files for name, files in files_by_split.items() if files}
    if not files_by_split:
        found = sorted(p.name for p in path.iterdir())[:10]
        raise DataError(
            f"data directory {path} holds no data files ({', '.join(DATA_SUFFIXES)}); "
            f"found: {', '.join(found) or 'nothing'}"
        )
    base = _split_base(split)
    if base not in files_by_split:
        raise DataError(
            f"data directory {path} has no files for split '{base}'"
            f"{did_you_mean(base, files_by_split)}; splits found: {', '.join(files_by_split)}"
        )
    files = files_by_split[base]
    builders = {_builder_for(Path(f)) for f in files}
    if len(builders) > 1:
        raise DataError(
            f"data directory {path} mixes file types in split '{base}' ({', '.join(files)}); "
            "keep one type per directory or point data.path at one file"
        )
    return builders.pop(), files


def _load_directory(path: Path, split: str):
    builder, files = _directory_files(path, split)
    for f in files:
        if Path(f).stat().st_size == 0:
            raise DataError(f"data file {f} is empty (0 bytes)")
    base = _split_base(split)
    dataset = _read_files(builder, {base: files}, split, f"data directory {path}")
    return dataset, [Path(f) for f in files]


def _load_hub(name: str, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as exc:
        root = _root_cause(exc)
        raise DataError(
            f"data path '{name}' does not exist locally and is not reachable as a hub dataset "
            f"({type(root).__name__}: {root}). Give a local .jsonl/.json/.parquet/.csv file or "
            "folder, a built-in dataset name, or a hub name with network access."
        ) from exc


def _missing_local(path: str, local: Path) -> DataError:
    parent = local.parent if local.parent.is_dir() else None
    hint = did_you_mean(local.name, [p.name for p in parent.iterdir()]) if parent else ""
    where = "" if parent else f" (directory {local.parent} does not exist either)"
    return DataError(f"data file {local} does not exist{hint}{where}")


# How close a name without a folder or an org must be to a built-in one to be taken for a typo
# of it (difflib's ratio: "arith-sftt" / "arith-sft" is 0.95, "arith_sft" 0.89).
NEAR_BUILTIN = 0.8


def _near_builtin(path: str) -> DataError | None:
    """The error for a name that is no file and close to a built-in name, or None. Asked before
    any hub lookup, which retries for about 30 s before it fails."""
    if "/" in path or "\\" in path:
        return None
    match = difflib.get_close_matches(path, BUILTIN_DATASETS, n=1, cutoff=NEAR_BUILTIN)
    if not match:
        return None
    return DataError(
        f"data path '{path}' is not a built-in dataset (did you mean '{match[0]}'?) nor a local "
        f"file or folder; built-in: {', '.join(BUILTIN_DATASETS)} (a hub dataset is named "
        "org/name)"
    )


def _builtin_file(path: str) -> Path | None:
    builtin = builtin_path(path)
    if builtin is not None and not builtin.is_file():
        raise DataError(
            f"built-in dataset '{path}' should be at {builtin} but the file is missing; "
            "reinstall align_anything"
        )
    return builtin


def load_dataset(path: str, split: str):
    """Return (datasets.Dataset, a description of where it came from, `RowNames` for its rows,
    the local files it was read from)."""
    builtin = _builtin_file(path)
    if builtin is not None:
        dataset, files = _load_file(builtin, split)
        return dataset, f"{path} (built-in)", _row_names(files, dataset, split), files
    local = Path(path).expanduser()
    if local.is_dir():
        dataset, files = _load_directory(local, split)
        return dataset, str(local), _row_names(files, dataset, split, base=local), files
    if local.is_file():
        dataset, files = _load_file(local, split)
        return dataset, str(local), _row_names(files, dataset, split), files
    if _looks_local(path):
        raise _missing_local(path, local)
    if (near := _near_builtin(path)) is not None:
        raise near
    dataset = _load_hub(path, split)
    return dataset, path, RowNames([], len(dataset)), []


def source_files(path: str, split: str) -> list[Path] | None:
    """The local files `load_dataset(path, split)` reads, without reading them (None for a hub
    dataset); the same DataError as `load_dataset` for a path that does not exist."""
    builtin = _builtin_file(path)
    if builtin is not None:
        return [builtin]
    local = Path(path).expanduser()
    if local.is_dir():
        return [Path(f) for f in _directory_files(local, split)[1]]
    if local.is_file():
        return [local]
    if _looks_local(path):
        raise _missing_local(path, local)
    if (near := _near_builtin(path)) is not None:
        raise near
    return None


def _row_names(files: list[Path], dataset: Any, split: str, base: Path | None = None) -> RowNames:
    # A sliced split ("train[10:]") starts somewhere inside the files: number its rows instead.
    sliced = split != _split_base(split)
    return RowNames([] if sliced else files, len(dataset), base=base)


def undecodable_text(
    err: UnicodeDecodeError, source: str, label: str, files: Sequence[Path]
) -> DataError:
    located = _first_bad_line(files, _builder_for(files[0]) or "") if files else None
    if located is not None:
        return DataError(_bad_line_message(f"data {source}", files, located))
    return DataError(
        f"data {source} {label} holds text that is not valid UTF-8 ({err.reason} at byte "
        f"{err.start} of a value): data files must be UTF-8 text; re-encode the file"
    )

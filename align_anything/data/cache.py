"""The on-disk cache of a run's prepared data: tokenised once, read by every rank and every
later start or resume with the same inputs.

- **Key.** A hash of everything the encoded rows depend on (`key_parts`): each source's path,
  format, columns and share with the size and xxh3-128 digest of each of its files (a hub
  dataset: `datasets`' fingerprint of it), the held-out split and the caps, the seed where it
  chooses rows, the task's `Encoding`, `max_length`, `truncation`, the tokenizer (vocabulary,
  special tokens, chat template) and `ENCODER_VERSION`, raised whenever the encoding of the
  same inputs changes. The folder is `<cache root>/<task>-<key>`.
- **Written atomically.** Built in a temporary sibling, its manifest (every file with its size
  and xxh3-64 digest, each split's row count, the reports) written last, then published by
  `atomic.publish`. A folder whose manifest is missing, or whose files do not match it (half
  written, truncated, changed), is not opened but rebuilt (`verify`).
- **Every rank reads the same files.** `datasets.load_from_disk` memory-maps them: the pages
  are the page cache's, shared by the ranks of a node.

Runs whose model takes images or audio rebuild at every start: the key does not cover the media
files themselves, and their checks (`MediaSupport`) must see the files as they are now.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from align_anything import atomic
from align_anything.data import pipeline
from align_anything.data.formats import DataReport
from align_anything.data.rows import EncodedRows, RecordsView
from align_anything.data.sources import source_files
from align_anything.data.workers import children_die_with_this_process
from align_anything.errors import DataError, UserError

# Raise when the same inputs would encode to other rows (it is part of every key). 2: JSON-lines
# rows are their exact JSON (`sources.row_dicts`), no longer Arrow's unified columns; a mixture
# is split per source before mixing.
ENCODER_VERSION = 2
CACHE_FORMAT = 1
MANIFEST = atomic.MANIFEST
SPLITS = ("train", "eval", "eval_records")


def cache_root(setting: str | None) -> Path:
    """`data.cache_dir`, or `data/` under the project cache (`ALIGN_ANYTHING_CACHE`, else
    ~/.cache/align_anything)."""
    if setting:
        return Path(setting).expanduser()
    root = os.environ.get("ALIGN_ANYTHING_CACHE") or Path.home() / ".cache" / "align_anything"
    return Path(root) / "data"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what turns text into ids: vocabulary, special tokens and chat template."""
    vocab = hashlib.sha256()
    vocab.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    vocab.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True).encode())
    vocab.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return vocab.hexdigest()[:16]


def _source_part(source: pipeline.Source) -> dict[str, Any]:
    files = source_files(source.path, "train")
    if files is None:  # a hub dataset: `datasets` fingerprints its own download
        from align_anything.data.sources import load_dataset

        content: Any = f"hub:{load_dataset(source.path, 'train')[0]._fingerprint}"
    else:
        content = [
            [str(f.resolve()), f.stat().st_size, atomic.file_digest(f, xxhash.xxh3_128)]
            for f in files
        ]
    return {**dataclasses.asdict(source), "content": content}


def _source_parts(sources: tuple[pipeline.Source, ...], split: str) -> list[dict[str, Any]]:
    parts = []
    for k, source in enumerate(sources):
        with pipeline.naming_source(split, k, len(sources)):
            parts.append(_source_part(source))
    return parts


def key_parts(spec: pipeline.Spec, *, tokenizer: Any, media: Any) -> dict[str, Any]:
    """Everything the prepared data depends on (see the module docstring)."""
    parts = {
        "encoder_version": ENCODER_VERSION,
        "task": spec.task,
        "train": _source_parts(spec.train, "data.path"),
        "eval": _source_parts(spec.eval, "data.eval_path"),
        "eval_fraction": 0.0 if spec.eval else spec.eval_fraction,
        "seed": spec.seed if spec.seeded else None,
        "max_train": spec.max_train,
        "max_eval": spec.max_eval,
        "encoding": dataclasses.asdict(spec.encoding),
        "max_length": spec.max_length,
        "truncation": spec.truncation,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    if media is not None:
        parts["processor"] = type(media.processor).__name__
    return parts


def _hash(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def data_fingerprint(parts: dict[str, Any]) -> str:
    """The training rows' fingerprint that resume checks compare: the key without what only
    the held-out rows depend on."""
    return _hash({k: v for k, v in parts.items() if k != "max_eval"})[:16]


@dataclass
class Prepared:
    """A run's data, opened from the cache: views on the mapped files and what the start-up
    summary says about them."""

    folder: Path
    train: EncodedRows
    eval: EncodedRows
    eval_records: RecordsView
    reports: list[DataReport]
    mixture: list[str]
    note: str  # "tokenised N rows in S s (cached at ...)" or "cache hit ..."


def verify(folder: Path) -> str | None:
    """Why `folder` is not a complete cache entry (None when it is): the manifest must parse
    and every file it lists must exist with its size and digest."""
    if not (folder / MANIFEST).is_file():
        return "no manifest (never finished)" if folder.exists() else "not built yet"
    try:
        manifest = atomic.read_manifest(folder, format=CACHE_FORMAT)
    except ValueError as err:
        return str(err)
    return atomic.manifest_mismatch(folder, manifest)


def _write_manifest(folder: Path, **fields: Any) -> None:
    atomic.write_manifest(folder, format=CACHE_FORMAT, **fields)


EMPTY = "features.json"  # the schema of a split without rows


def _save(dataset: Any, folder: Path) -> None:
    if not len(dataset):  # `datasets` 5 saves no rows in a form `load_from_disk` can read back
        folder.mkdir()
        (folder / EMPTY).write_text(json.dumps(dataset.features.to_dict()))
        return
    dataset.save_to_disk(str(folder))


def _load(folder: Path) -> Any:
    import datasets

    if (folder / EMPTY).is_file():
        features = datasets.Features.from_dict(json.loads((folder / EMPTY).read_text()))
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    return datasets.load_from_disk(str(folder))


def _remove_abandoned(root: Path, prefix: str) -> None:
    """Remove temporary folders that a killed build on this host left (its process is gone)."""
    for path in root.glob(f"{prefix}*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def folder_for(root: Path, spec: pipeline.Spec, parts: dict[str, Any]) -> Path:
    return root / f"{spec.task}-{_hash(parts)}"


def build_entry(
    folder: Path, build: Callable[[Path, Path], dict[str, Any]], *, always: bool = False
) -> tuple[dict[str, Any], str | None]:
    """Make sure the cache entry `folder` exists and is complete, building it when it is
    missing or damaged (or `always`); returns (its manifest, None for a cache hit or the reason
    it was built). `build(tmp, work)` writes the entry's files into `tmp` (scratch space in
    `work`, removed afterwards) and returns the manifest's own fields; the manifest (every
    file's size and digest) is written last, then the folder is published atomically. Called
    by one process per node while the others wait; two builders of one entry (two runs at once)
    each build into their own temporary folder, and the second keeps the first's."""
    problem = verify(folder)
    if problem is None and not always:
        return json.loads((folder / MANIFEST).read_text()), None
    try:
        _build_entry(folder, build, always=always)
    except UserError:
        raise
    except Exception as err:  # the worker pool may re-raise a worker's OSError inside another
        failure = cache_write_error(err, folder.parent)
        if failure is None:
            raise
        raise failure from None
    return json.loads((folder / MANIFEST).read_text()), problem


def _build_entry(
    folder: Path, build: Callable[[Path, Path], dict[str, Any]], *, always: bool
) -> None:
    """Build `folder` in a temporary sibling and publish it (see `build_entry`)."""
    root = folder.parent
    root.mkdir(parents=True, exist_ok=True)
    host = os.uname().nodename
    _remove_abandoned(root, f".tmp-{folder.name}-{host}-")
    tmp = root / f".tmp-{folder.name}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work = tmp / "work"
    work.mkdir(parents=True)
    try:
        fields = build(tmp, work)
        shutil.rmtree(work, ignore_errors=True)
        _write_manifest(
            tmp, key=folder.name, **fields,
            built_by={"pid": os.getpid(), "host": host, "rank": os.environ.get("RANK", "0")},
        )  # fmt: skip
        if not always and verify(folder) is None:  # another run published it meanwhile
            shutil.rmtree(tmp)
        else:
            atomic.publish(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure(
    spec: pipeline.Spec, parts: dict[str, Any], *, root: Path, tokenizer: Any, media: Any,
    model_name: str, num_proc: int, on_start: Any = None,
) -> str:  # fmt: skip
    """Make sure the cache entry of `spec` exists and is complete, building it when it is
    missing or damaged (or always, for media: `build_entry`); returns the start-up summary's
    note."""
    folder = folder_for(root, spec, parts)

    def build(tmp: Path, work: Path) -> dict[str, Any]:
        start = time.perf_counter()
        with children_die_with_this_process():  # a kill -9 leaves no `datasets` worker
            built = pipeline.build(
                spec, tokenizer=tokenizer, media=media, model_name=model_name, work=work,
                num_proc=num_proc, on_start=on_start,
            )  # fmt: skip
        for name in SPLITS:
            _save(getattr(built, name), tmp / name)
        return dict(
            parts=parts, rows={n: len(getattr(built, n)) for n in SPLITS},
            reports=[dataclasses.asdict(r) for r in built.reports], mixture=built.mixture,
            tokenised=built.tokenised, seconds=time.perf_counter() - start, num_proc=num_proc,
        )  # fmt: skip

    manifest, problem = build_entry(folder, build, always=media is not None)
    if problem is None and media is None:
        return (
            f"cache hit {folder} (tokenised {manifest['tokenised']} rows in "
            f"{manifest['seconds']:.1f} s when built; no tokenisation now)"
        )
    rebuilt = "" if problem in ("not built yet",) or media is not None else f"; rebuilt: {problem}"
    why = "; rebuilt at every start: the data holds media" if media is not None else rebuilt
    return (
        f"tokenised {manifest['tokenised']} rows in {manifest['seconds']:.1f} s "
        f"(cached at {folder}{why})"
    )


# Errors of a folder that cannot take the cache: no room, no permission, not a folder.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
NOT_A_FOLDER = (errno.EEXIST, errno.ENOTDIR)


def cache_write_error(err: BaseException, root: Path) -> DataError | None:
    """The one-line error for a failure to write the data cache under `root` (the folder full,
    read-only, or a file), naming the folder and the fix; None for an error of another kind
    (e.g. a data file that cannot be read). A full disk is recognised by its errno alone: the
    `datasets` worker pool re-raises it without a path."""
    found = None
    cause: BaseException | None = err
    while cause is not None and found is None:
        if isinstance(cause, OSError) and cause.errno is not None:
            found = cause
        cause = cause.__cause__ or cause.__context__
    if found is None:
        return None
    fix = f"or set data.cache_dir to another folder (now: {root})"
    if found.errno in NO_ROOM:
        return DataError(
            f"no space left on the device of the data cache {root} while preparing the data: "
            f"free space there ({_free(root)} free now), {fix}"
        )
    path = Path(found.filename) if found.filename else None
    if path is None or not (path == root or root in path.parents or path in root.parents):
        return None
    if found.errno in NOT_WRITABLE:
        return DataError(
            f"the data cache {root} cannot be written ({found.strerror}: {path}): make it "
            f"writable, {fix}"
        )
    if found.errno in NOT_A_FOLDER:
        file = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), path)
        return DataError(
            f"the data cache {root} cannot be created: {file} is a file, not a folder. Move "
            f"the file away, {fix}"
        )
    return None


def _free(root: Path) -> str:
    existing = next((p for p in (root, *root.parents) if p.is_dir()), Path("/"))
    return f"{shutil.disk_usage(existing).free / 2**20:.0f} MiB"


def open_prepared(folder: Path, *, note: str) -> Prepared:
    """The cache entry in `folder` (complete: `ensure` ran), memory-mapped."""
    manifest = json.loads((folder / MANIFEST).read_text())
    splits = {}
    for name in SPLITS:
        dataset = _load(folder / name)
        if len(dataset) != manifest["rows"][name]:
            raise RuntimeError(
                f"{folder / name} holds {len(dataset)} rows, its manifest says "
                f"{manifest['rows'][name]}: delete {folder} and start again"
            )
        splits[name] = dataset
    return Prepared(
        folder=folder, train=EncodedRows(splits["train"]), eval=EncodedRows(splits["eval"]),
        eval_records=RecordsView(splits["eval_records"]),
        reports=[DataReport(**r) for r in manifest["reports"]], mixture=manifest["mixture"],
        note=note,
    )  # fmt: skip

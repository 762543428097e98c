"""The on-disk cache of a run's tokenised data: tokenised once, read by every rank and every
later start or resume with the same inputs (an entry of `data.cache`).

- **Key.** A hash of everything the encoded rows depend on (`key_parts`): each source's path,
  format, columns and share with the size and xxh3-128 digest of each of its files (a hub
  dataset: `datasets`' fingerprint of it), the held-out split and the caps, the seed where it
  chooses rows, the task's `Encoding`, `max_length`, `truncation`, the tokenizer (vocabulary,
  special tokens, chat template) and `ENCODER_VERSION`, raised whenever the encoding of the
  same inputs changes. The folder is `<cache root>/<task>-<key>`.
- **Written atomically** (`data.cache.build_entry`), checked by its manifest, rebuilt when it
  does not match.
- **Every rank reads the same files.** `datasets.load_from_disk` memory-maps them: the pages
  are the page cache's, shared by the ranks of a node.

Runs whose model takes images or audio rebuild at every start: the key does not cover the media
files themselves, and their checks (`MediaSupport`) must see the files as they are now.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from align_anything import atomic
from align_anything.data.cache import MANIFEST, build_entry, key_hash
from align_anything.data.formats import DataReport
from align_anything.data.sources import source_files
from align_anything.data.workers import children_die_with_this_process
from align_anything.families.language import pipeline
from align_anything.families.language.rows import EncodedRows, RecordsView

# Raise when the same inputs would encode to other rows (it is part of every key). 2: JSON-lines
# rows are their exact JSON (`sources.row_dicts`), no longer Arrow's unified columns; a mixture
# is split per source before mixing.
ENCODER_VERSION = 2
SPLITS = ("train", "eval", "eval_records")


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


def data_fingerprint(parts: dict[str, Any]) -> str:
    """The training rows' fingerprint that resume checks compare: the key without what only
    the held-out rows depend on."""
    return key_hash({k: v for k, v in parts.items() if k != "max_eval"})[:16]


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


def folder_for(root: Path, spec: pipeline.Spec, parts: dict[str, Any]) -> Path:
    return root / f"{spec.task}-{key_hash(parts)}"


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

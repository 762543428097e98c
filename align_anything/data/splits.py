"""A run's records: every source loaded and checked for the task, then the train and eval
records (a held-out file, or a seeded share of the training file)."""

from __future__ import annotations

from typing import Any

from align_anything.data.formats import DataReport, check_kind, load_records, split_records
from align_anything.data.multimodal import MediaSupport, has_media
from align_anything.errors import UserError


def load_checked(
    source: str, *, fmt: str, columns: dict[str, str], kind: str, task: str,
    media: MediaSupport | None, model_name: str,
) -> tuple[list[dict], DataReport]:  # fmt: skip
    """Records of one source, checked for the task's kind ("conversation" or "preference");
    media checked and their placeholders written in before any split, so problems carry the
    file's row numbers. Media for a text-only model is an error, not silently dropped."""
    records, report = load_records(source, format=fmt, columns=columns)
    check_kind(records, kind, source=source, task=task)
    if media is not None:
        records = media.prepare(records, data_path=source)
    elif has_media(records):
        raise UserError(
            f"{source} has images or audio, but model {model_name} is a text-only model. Use an "
            "image-text or audio-text model (e.g. model.name_or_path=tiny-random-llava), or "
            "data without media."
        )
    return records, report


def train_and_eval(
    path: str, eval_path: str | None, *, eval_fraction: float, seed: int,
    max_train: int | None, max_eval: int | None, **load: Any,
) -> tuple[list[dict], list[dict], DataReport]:  # fmt: skip
    """(train records, eval records, the training source's load report): `eval_path`'s records
    when given, else a seeded `eval_fraction` of `path` (none when 0), each capped (`max_*`)
    before any encoding. `load`: `load_checked`'s keyword arguments."""
    records, report = load_checked(path, **load)
    if eval_path:
        train, held_out = records, load_checked(eval_path, **load)[0]
    elif eval_fraction > 0:
        train, held_out = split_records(records, eval_fraction=eval_fraction, seed=seed)
    else:
        train, held_out = records, []
    return train[: max_train or None], held_out[: max_eval or None], report

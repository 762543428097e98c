"""Folders that appear complete or not at all (checkpoints, exports, converted models).

Everything is written into a temporary sibling (`.tmp-NAME`), its files are flushed to disk,
and only then is it renamed to its final name; the parent folder is flushed after the rename.
A crash or kill at any moment leaves either the previous folder or the new, complete one (plus,
at worst, a stale `.tmp-NAME` that the next write removes); with the flushes that holds after a
power loss too, where a rename can otherwise reach the disk before the data it names.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def temporary_sibling(final: Path) -> Path:
    return final.with_name(f".tmp-{final.name}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flush_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder (deepest first), then `folder`."""
    folders = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                _fsync(path)
        folders.append(Path(root))
    for path in reversed(folders):
        _fsync(path)


def publish(tmp: Path, final: Path) -> Path:
    """Make the complete folder `tmp` visible as `final`, replacing an older `final`."""
    flush_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    return final


@contextlib.contextmanager
def folder(final: Path) -> Iterator[Path]:
    """Yield an empty temporary folder to write into; publish it as `final` when the block
    ends normally, remove it when the block raises."""
    final = Path(final)
    tmp = temporary_sibling(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, final)

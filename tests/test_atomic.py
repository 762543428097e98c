"""Folders written through align_anything.atomic appear complete or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from align_anything import atomic


def test_folder_replaces_the_old_one_only_when_complete(tmp_path: Path) -> None:
    final = tmp_path / "final"
    with atomic.folder(final) as tmp:
        assert tmp.name == ".tmp-final" and not final.exists()
        (tmp / "weights.bin").write_bytes(b"old")
    assert (final / "weights.bin").read_bytes() == b"old"

    with pytest.raises(RuntimeError), atomic.folder(final) as tmp:
        (tmp / "weights.bin").write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    # The failed write left the previous folder as it was, and no temporary folder behind.
    assert (final / "weights.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]

    with atomic.folder(final) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"new")
    assert (final / "sub" / "weights.bin").read_bytes() == b"new"
    assert not (final / "weights.bin").exists()  # replaced, not merged


def test_a_stale_temporary_folder_is_cleared(tmp_path: Path) -> None:
    """A kill between writing and renaming leaves `.tmp-NAME`; the next write starts afresh."""
    stale = tmp_path / ".tmp-final"
    stale.mkdir()
    (stale / "leftover").write_text("from a killed run")
    with atomic.folder(tmp_path / "final") as tmp:
        assert list(tmp.iterdir()) == []
        (tmp / "a").write_text("a")
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["a"]

"""The on-disk cache's entries, whatever they hold (a language model's token rows:
`families.language.token_cache`; a pipeline's latents: `families.diffusion.latents`).

- **Keyed.** An entry's folder is named by a hash of everything its contents depend on
  (`key_hash`), which its owner collects.
- **Written atomically.** Built in a temporary sibling, its manifest (every file with its size
  and xxh3-64 digest, and the owner's fields) written last, then published by `atomic.publish`
  (`build_entry`). A folder whose manifest is missing, or whose files do not match it (half
  written, truncated, changed), is not opened but rebuilt (`verify`); temporary folders of a
  killed build are removed by the next one.
- **One message for a folder that cannot take it** (`cache_write_error`): full, read-only, or a
  file where the folder should be, naming the folder and `data.cache_dir`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align_anything import atomic
from align_anything.errors import DataError, UserError

CACHE_FORMAT = 1
MANIFEST = atomic.MANIFEST


def cache_root(setting: str | None) -> Path:
    """`data.cache_dir`, or `data/` under the project cache (`ALIGN_ANYTHING_CACHE`, else
    ~/.cache/align_anything)."""
    if setting:
        return Path(setting).expanduser()
    root = os.environ.get("ALIGN_ANYTHING_CACHE") or Path.home() / ".cache" / "align_anything"
    return Path(root) / "data"


def key_hash(parts: dict[str, Any]) -> str:
    """The hex digest that names an entry made from `parts` (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


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

"""Folders that appear complete or not at all (checkpoints, exports, converted models).

Everything is written into a temporary sibling (`.tmp-NAME`), its files are flushed to disk,
and only then is it renamed to its final name; the parent folder is flushed after the rename.
An older folder of that name is swapped out in one step (Linux `renameat2(RENAME_EXCHANGE)`;
elsewhere: renamed aside, the new one renamed in, the old one deleted), so there is no moment
at which neither exists. A crash or kill at any moment leaves either the previous folder or the
new, complete one (plus, at worst, a stale `.tmp-NAME` that the next write removes); with the
flushes that holds after a power loss too, where a rename can otherwise reach the disk before
the data it names.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2); False where that is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc): setting it
    to read it back would, for that moment, give other threads' new files another mode."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def respect_umask(folder: Path) -> None:
    """Give every file under `folder` the mode a plain `open()` gives under the umask (0644
    under 022; execute bits kept): some writers create their files 0600 whatever the umask
    (safetensors' `save_file`, which writes every weight file here: model, adapter, EMA), so
    another user, or a serving container running as one, could not read the weights beside
    configs it can read."""
    mask = umask()
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode & 0o777
            wanted = (0o666 | (mode & 0o111)) & ~mask
            if mode != wanted:
                path.chmod(wanted)


def publish(tmp: Path, final: Path) -> Path:
    """Make the complete folder `tmp` visible as `final`; an older `final` is swapped out
    atomically and then deleted. Its files first get the umask's mode (`respect_umask`)."""
    tmp, final = Path(tmp), Path(final)
    respect_umask(tmp)
    flush_tree(tmp)
    if final.is_dir() and not final.is_symlink():
        if _exchange(tmp, final):  # `final` is the new folder now, `tmp` the old one
            _fsync(final.parent)
            shutil.rmtree(tmp)
            return final
        aside = final.with_name(f".old-{final.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        _fsync(final.parent)
        shutil.rmtree(aside)
        return final
    os.replace(tmp, final)
    _fsync(final.parent)
    return final


def write_text(path: Path, text: str) -> None:
    """Replace a small file in one step: a reader sees the old content or the new, never part."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave the old file, and nothing else
        raise
    _fsync(path.parent)


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


def to_json(data: Any) -> str:
    """The project's JSON files (configs, states, summaries): indented, one trailing newline."""
    return json.dumps(data, indent=2) + "\n"


# ---------------------------------------------------------------------------- manifests
#
# A folder is complete when its manifest, written last, lists every file it holds with its size
# and xxh3-64 checksum and the files on disk still match (checkpoints, data cache entries).
# Hand-written: neither DeepSpeed nor `datasets` records what a complete folder holds.

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def file_digest(path: Path, algorithm: Any = None) -> str:
    """A hash of a file's bytes, read in chunks: xxh3-64 (the manifests'), or `algorithm` (an
    `xxhash` constructor, e.g. `xxhash.xxh3_128`)."""
    import xxhash

    digest = (algorithm or xxhash.xxh3_64)()
    with Path(path).open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, *, format: int, **fields: Any) -> None:
    """List every file of a finished folder (its last write, before it is published): the
    `format`, the caller's `fields`, and each file's size and checksum."""
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "xxh3_64": file_digest(p)}
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != MANIFEST
    }
    manifest = {"format": format, **fields, "files": files}
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(folder: Path, *, format: int) -> dict[str, Any]:
    """A folder's manifest; ValueError with a short reason when it is missing, unreadable or
    of another format."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{MANIFEST} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{MANIFEST} cannot be read ({err})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != format
        or not isinstance(manifest.get("files"), dict)
    ):
        raise ValueError(f"{MANIFEST} is not a format-{format} manifest")
    return manifest


def manifest_mismatch(folder: Path, manifest: dict[str, Any]) -> str | None:
    """Why the files under `folder` do not match `manifest` (None when they all do): a missing
    file, a size or a checksum that differs. Sizes first: a missing or truncated file is found
    without reading anything."""
    files = manifest["files"]
    for name, expected in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} is {size} bytes, the manifest says {expected['size']} (truncated?)"
    for name, expected in files.items():
        if file_digest(Path(folder) / name) != expected["xxh3_64"]:
            return f"{name} does not match its checksum (the file changed after it was written)"
    return None

"""User-facing errors: one message that names the problem and the fix, raised before any compute."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable
from pathlib import Path


class UserError(Exception):
    """A mistake in the user's input (config, data, model, paths). The entry point prints the
    message without a traceback and exits with status 2."""


class ConfigError(UserError):
    """A wrong key, value or combination in the resolved config or DeepSpeed preset."""


class DataError(UserError):
    """A dataset that cannot be read or does not have the expected shape."""


class ModelError(UserError):
    """A model or tokenizer that cannot be found or used."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ` (did you mean 'x'?)` for the closest candidate, or an empty string."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def check_output_file(flag: str, path: str | Path) -> Path:
    """A command's output file, checked before any work: its folder must exist (a typo would
    otherwise surface only after everything was computed) and the path must not be a folder."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file path")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise UserError(
            f"{flag} {path}: the folder {folder} {what}; create it first (mkdir -p {folder}) "
            "or choose another path. Nothing was computed."
        )
    return target


class CheckpointError(UserError):
    """A checkpoint that is incomplete, damaged or cannot be loaded."""


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, unwritable folder). The previous complete
    checkpoint is untouched."""


class Preempted(BaseException):  # noqa: N818 (not an error: a requested stop)
    """The run stopped on SIGTERM/SIGINT: after finishing a step and writing a checkpoint, or
    at once (a second signal; a hung reward function). The entry point prints the message and
    exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT), as a process killed
    by that signal would. A BaseException, as KeyboardInterrupt is: raised from a signal handler
    anywhere, it must not be swallowed by an `except Exception` on its way out."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class AlreadyFinished(Exception):  # noqa: N818 (not an error: nothing left to do)
    """`resume` on a run that finished (run.json `complete`, `final/` written) at a step this
    run's schedule does not go past: nothing is trained, evaluated or written. The entry point
    prints the message and exits 0, as a job re-submitted after it had finished should."""


def report(err: UserError) -> int:
    """Print a user error the way every command-line tool here does; returns the exit status."""
    print(f"error: {err}", file=sys.stderr)
    return 2

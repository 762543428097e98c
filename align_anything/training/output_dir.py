"""Who owns an `output_dir`: one run at a time (a lock file), and no run silently replaces
another's results (`run.json`).

- `.lock` holds the pid, host and start time of the run writing there, created with O_EXCL so
  that of two runs started at once exactly one gets it. A lock whose process is gone (same
  host, no such pid) is stale: it is reported and taken over.
- `run.json` records the run id, its status (`running`, `stopped`, `failed`, `complete`) and
  the step of `final/`. A folder whose run.json does not say `complete` holds an unfinished
  run: its `final/` and `summary.json`, if any, may be older than its metrics.
- A fresh run into a folder that already holds a run refuses, naming `resume=auto` and
  `overwrite_output_dir=true`; with the latter, the old run's outputs (and only those) are
  removed before anything new is written, so old and new never mix.
- Resuming a run that finished (run.json `complete`, with the step of `final/`) does nothing
  and changes nothing unless the schedule now goes past that step (`train.max_steps` raised):
  `claim` reports the finished step, and set-up decides once the schedule is known
  (`check_finished`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from align_anything import atomic
from align_anything.errors import AlreadyFinished, CheckpointError, ConfigError
from align_anything.training import checkpoints

LOCK = ".lock"
RUN_FILE = "run.json"
# What a run writes into its output_dir, and so what overwrite_output_dir=true removes.
RUN_OUTPUTS = (
    RUN_FILE, "metrics.jsonl", "summary.json", "run_config.json", "ds_config.json",
    "checkpoints", "final", "final-merged", "final-ema", "tensorboard", "wandb",
)  # fmt: skip


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class Lock:
    """`output_dir/.lock` while a run writes there (rank 0 holds it)."""

    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / LOCK
        self.note = ""  # set when a stale lock was taken over
        self._held = False

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._refuse_or_clear()
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(me) + "\n")
            self._held = True
            return
        raise ConfigError(f"could not take the lock {self.path}: another run keeps creating it")

    def _refuse_or_clear(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            pid, host = int(holder["pid"]), str(holder["host"])
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["started"])))
        except (OSError, ValueError, KeyError, TypeError):
            # Unreadable: being written this very moment, or damaged. Treat it as held.
            raise ConfigError(
                f"{self.path.parent} is locked by another run ({self.path} exists but cannot be "
                f"read). If no run is using this folder, delete {self.path} and run again."
            ) from None
        if host == socket.gethostname() and not _process_alive(pid):
            self.path.unlink(missing_ok=True)
            self.note = (
                f"took over a stale lock: {self.path} was left by pid {pid} on {host} "
                f"(started {since}), which is no longer running"
            )
            return
        where = "this host" if host == socket.gethostname() else f"host {host}"
        raise ConfigError(
            f"another run is writing to {self.path.parent}: pid {pid} on {where}, started "
            f"{since} (lock {self.path}). Wait for it to finish, or use another output_dir=…; "
            f"if that run is surely gone (e.g. its machine died), delete {self.path}."
        )

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if holder.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)


def read_run(output_dir: Path) -> dict[str, Any] | None:
    path = Path(output_dir) / RUN_FILE
    if not path.exists():
        return None
    try:
        return checkpoints.read_json(path)
    except ValueError:
        return {}


def write_run(output_dir: Path, **fields: Any) -> dict[str, Any]:
    """Update `run.json` (written to a temporary file, flushed, renamed)."""
    path = Path(output_dir) / RUN_FILE
    data = {**(read_run(output_dir) or {}), **fields, "updated": time.time()}
    atomic.write_text(path, json.dumps(data, indent=2) + "\n")
    return data


def previous_outputs(output_dir: Path) -> list[str]:
    """The names of earlier runs' outputs present in `output_dir`."""
    root = Path(output_dir)
    found = []
    for name in RUN_OUTPUTS:
        path = root / name
        if name == "checkpoints":
            if checkpoints.listed(path):
                found.append(name)
        elif path.exists():
            found.append(name)
    return found


def describe_previous(output_dir: Path) -> str:
    run = read_run(output_dir) or {}
    parts = []
    if run.get("status"):
        parts.append(f"status {run['status']}")
    if run.get("step") is not None:
        parts.append(f"step {run['step']}")
    steps = [checkpoints.step_of(p) for p in checkpoints.listed(Path(output_dir) / "checkpoints")]
    if steps:
        parts.append("checkpoints " + ", ".join(f"step-{s}" for s in steps))
    if (Path(output_dir) / "final").is_dir():
        parts.append("final/")
    return ", ".join(parts) or ", ".join(previous_outputs(output_dir))


def refuse_existing(output_dir: Path, *, reason: str = "") -> ConfigError:
    return ConfigError(
        f"output_dir={str(output_dir)!r} already holds a run ({describe_previous(output_dir)})"
        f"{reason}. Continue it with resume=auto, start over with overwrite_output_dir=true "
        "(removes that run's checkpoints, final/ and metrics), or choose another output_dir=…"
    )


def remove_previous(output_dir: Path) -> list[str]:
    """overwrite_output_dir=true: remove what an earlier run wrote (nothing else)."""
    removed = previous_outputs(output_dir)
    for name in removed:
        path = Path(output_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


def claim(
    output_dir: Path, lock: Lock, *, resume: str | None, overwrite: bool
) -> tuple[str, str | None, int | None]:
    """Take `output_dir` for a run: check it is a writable folder, take the lock, and decide
    the run id, the checkpoint to resume from (None: start fresh) and, when this resumes a run
    that finished, the step it finished at (`check_finished` decides once the schedule is
    known). Refuses to replace an earlier run's results unless `overwrite` (which removes them
    first). Prints what it did or skipped, also when it refuses. Run on one rank (rank 0)."""
    notes: list[str] = []
    try:
        run_id, path = _claim(output_dir, lock, resume=resume, overwrite=overwrite, notes=notes)
        finished = _finished_step(output_dir, path) if resume is not None else None
    finally:
        for note in notes:
            print(f"note: {note}", flush=True)
    return run_id, str(path) if path else None, finished


def _finished_step(output_dir: Path, resume_dir: Path | None) -> int | None:
    """The step at which the run in `output_dir` finished (run.json `complete` with the step of
    `final/`), when `resume_dir` (None: no checkpoint left) is a checkpoint of that run; else
    None."""
    run = read_run(output_dir) or {}
    step = run.get("final_step")
    if run.get("status") != "complete" or not isinstance(step, int):
        return None
    if resume_dir is not None and checkpoints.run_id_of(resume_dir) != run.get("run_id"):
        return None
    return step


def check_finished(output_dir: Path, *, finished_step: int, resume_dir: Path | None,
                   total_steps: int) -> None:  # fmt: skip
    """A resumed run whose schedule (`total_steps`) does not go past the step at which it
    finished raises `AlreadyFinished` (nothing to do, exit 0); one that does continues from
    `resume_dir`, and without a checkpoint to continue from it is a `ConfigError`."""
    where = f"output_dir={str(output_dir)!r}"
    if total_steps <= finished_step:
        more = (
            f"continues from {resume_dir.name}"
            if resume_dir is not None
            else "needs a checkpoint to continue from, and it has none (checkpoint.every_steps)"
        )
        raise AlreadyFinished(
            f"{where} holds a run that finished at step {finished_step} (final/ and "
            f"summary.json written): nothing to do, nothing changed. To train further, raise "
            f"train.max_steps (or train.epochs) past {finished_step} steps (this run has "
            f"{total_steps}): it {more}; to start over, overwrite_output_dir=true."
        )
    if resume_dir is None:
        raise ConfigError(
            f"{where} holds a run that finished at step {finished_step}, and this run would go "
            f"on to step {total_steps}, but no checkpoint of it is left to continue from (it "
            "ran with checkpoint.every_steps=0, or its checkpoints were removed). Start over "
            "with overwrite_output_dir=true, or use another output_dir=…"
        )


def _claim(
    output_dir: Path, lock: Lock, *, resume: str | None, overwrite: bool, notes: list[str]
) -> tuple[str, Path | None]:
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir={str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir={str(out)!r} is not writable: {err}") from None
    lock.acquire()
    notes += [lock.note] if lock.note else []
    if overwrite and resume is not None:
        raise ConfigError(
            f"overwrite_output_dir=true starts over, resume={resume!r} continues: choose one"
        )
    previous = previous_outputs(out)
    run = read_run(out) or {}
    root = out / "checkpoints"
    if resume is None:
        if previous and not overwrite:
            raise refuse_existing(out)
        if previous:
            removed = remove_previous(out)
            notes.append(f"overwrite_output_dir=true: removed {', '.join(removed)} from {out}")
        return new_run_id(), None
    if resume == "auto":
        found, skipped = checkpoints.newest_complete(root, run.get("run_id"))
        notes += [f"resume=auto skipped {s.describe()}" for s in skipped]
        if found is not None:
            return checkpoints.run_id_of(found) or new_run_id(), found
        if _finished_step(out, None) is not None and run.get("run_id"):
            return run["run_id"], None  # finished without a checkpoint: `check_finished`
        if previous:
            why = "; ".join(s.describe() for s in skipped)
            raise refuse_existing(
                out, reason=" but no complete checkpoint of it to resume"
                + (f" (skipped {why})" if why else "")
            )  # fmt: skip
        return new_run_id(), None
    path = Path(resume)
    problem = checkpoints.verify(path)
    if problem is not None:
        raise CheckpointError(
            f"resume={resume!r} is not a complete align_anything checkpoint: {problem} "
            f"(checkpoints live under {root}/{checkpoints.PREFIX}N; resume=auto picks the "
            "newest complete one)"
        )
    run_id = checkpoints.run_id_of(path) or new_run_id()
    if previous and run.get("run_id") != run_id:
        raise refuse_existing(out, reason=f", not the run of {path}")
    return run_id, path


def finish_run(output_dir: Path, *, status: str, step: int) -> None:
    """Record how the run ended in run.json (`complete` also records that final/ holds this
    step, when it was written)."""
    done = status == "complete" and (Path(output_dir) / "final").is_dir()
    try:
        write_run(output_dir, status=status, step=step, **({"final_step": step} if done else {}))
    except OSError as err:
        # A full disk must not also keep the run from releasing its lock (cleanup goes on).
        print(f"warning: could not record status {status!r} in {Path(output_dir) / RUN_FILE}: "
              f"{err.strerror or err}", flush=True)  # fmt: skip


def start_run(
    output_dir: Path, run_id: str, *, task: str, step: int, resumed_from: Path | None
) -> None:
    """run.json at the start of a run (or of a resumed one): its id, status `running`."""
    write_run(
        output_dir, run_id=run_id, task=task, status="running", step=step, started=time.time(),
        resumed_from=str(resumed_from) if resumed_from else None,
    )  # fmt: skip

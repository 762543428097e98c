"""The checkpoint store of one run (`output_dir/checkpoints/step-N/`): writing and loading
checkpoints, RNG state, the checks a resumed run passes, and the final Hugging Face folder.

A checkpoint belongs to a run (the run id in its `trainer_state.json`) and is complete only
when its `manifest.json`, written last, lists every file it holds with its size and xxh3-64
checksum and the files on disk still match. `resume=auto` takes the newest checkpoint of the
run that passes that check and reports every newer one it skipped, with the reason; nothing is
ever deleted on the way. Pruning (`checkpoint.keep_last`) removes only complete checkpoints of
the same run, so a checkpoint of another run, or one that no longer checks out, is left for
the user to look at.

Hand-written, not a library's: DeepSpeed writes its files with no record of what a complete
checkpoint holds (a deleted or truncated `*.pt` surfaces as a bare assertion or a zip-reader
error deep inside its loader), and a manifest is what makes "complete" checkable before any
weights load.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from align_anything import atomic
from align_anything.backend import distributed as comm
from align_anything.errors import CheckpointError, CheckpointWriteError, ConfigError, UserError

PREFIX = "step-"
MANIFEST = atomic.MANIFEST
STATE = "trainer_state.json"
MANIFEST_FORMAT = 1


def folder_name(step: int) -> str:
    return f"{PREFIX}{step}"


def step_of(path: Path) -> int | None:
    """N for a folder named `step-N`, else None (temporary `.tmp-step-N` folders included)."""
    digits = path.name.removeprefix(PREFIX)
    return int(digits) if path.name.startswith(PREFIX) and digits.isdigit() else None


def write_manifest(folder: Path, *, run_id: str, step: int) -> None:
    """List every file of a finished checkpoint folder (written last, before it is published)."""
    atomic.write_manifest(folder, format=MANIFEST_FORMAT, run_id=run_id, step=step)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; ValueError with a short reason otherwise."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path.name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path.name} cannot be read ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data


def verify(folder: Path) -> str | None:
    """Why `folder` is not a complete checkpoint (None when it is): its manifest and trainer
    state must parse, and every listed file must exist with its size and checksum."""
    try:
        manifest = atomic.read_manifest(folder, format=MANIFEST_FORMAT)
        state = read_json(folder / STATE)
    except ValueError as err:
        return str(err)
    if state.get("run_id") != manifest.get("run_id") or state.get("step") != manifest.get("step"):
        return f"{STATE} and {MANIFEST} disagree on the run or step"
    return atomic.manifest_mismatch(folder, manifest)


@dataclass(frozen=True)
class Skipped:
    path: Path
    reason: str

    def describe(self) -> str:
        return f"{self.path}: {self.reason}"


def listed(root: Path) -> list[Path]:
    """Every `step-N` folder under `root`, oldest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)


def run_id_of(folder: Path) -> str | None:
    try:
        value = read_json(folder / STATE).get("run_id")
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def newest_complete(root: Path, run_id: str | None) -> tuple[Path | None, list[Skipped]]:
    """The newest complete checkpoint of run `run_id` (any run's when None) under `root`, and
    the newer folders skipped on the way, each with its reason. Reads, never deletes."""
    skipped: list[Skipped] = []
    for path in reversed(listed(root)):
        owner = run_id_of(path)
        if run_id is not None and owner is not None and owner != run_id:
            skipped.append(Skipped(path, f"belongs to another run (run id {owner})"))
            continue
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(Skipped(path, problem))
    return None, skipped


def prune(root: Path, *, run_id: str, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints of run `run_id`; returns the
    removed folders. Checkpoints of other runs, and folders that do not check out, stay."""
    ours = [p for p in listed(root) if run_id_of(p) == run_id and (p / MANIFEST).is_file()]
    removed = ours[:-keep_last] if keep_last > 0 else []
    for path in removed:
        # Renamed out of the `step-N` namespace first: a kill mid-delete leaves a temporary
        # folder that nothing mistakes for a checkpoint.
        doomed = path.with_name(f".deleting-{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed


# ---------------------------------------------------------------------------- RNG state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _jsonable(value: Any) -> Any:
    """An RNG state as JSON data (tuples and arrays become lists)."""
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def write_rng_state(folder: Path, rank: int) -> None:
    """This process's Python, NumPy and torch RNG states as JSON (read back unpickling nothing)."""
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
    }
    (folder / f"rng_state_rank{rank}.json").write_text(json.dumps(state))


def restore_rng_state(folder: Path, rank: int) -> bool:
    """Restore what `write_rng_state` wrote for `rank`; False when the checkpoint has no file
    for it (one written with fewer ranks)."""
    path = folder / f"rng_state_rank{rank}.json"
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    return True


# ---------------------------------------------------------------------------- resume checks


def fingerprints(data_path: str, *, tokenizer: str, data: str) -> dict[str, str]:
    """What `trainer_state.json` records so a resumed run can tell whether it trains on what
    the checkpoint saw: the data path, the tokenizer's fingerprint (vocabulary, special tokens,
    chat template) and the training data's (the cache key of its inputs and encoding)."""
    return {"data_path": data_path, "tokenizer_fingerprint": tokenizer, "data_fingerprint": data}


def check_resume(
    folder: Path, state: dict[str, Any], *, now: dict[str, Any], global_batch: int,
    allow_mismatch: bool, warn: bool = True,
) -> None:  # fmt: skip
    """Refuse a resume that would silently train something else than the checkpoint did
    (another global batch: another data order; another model, tokenizer or training data,
    unless `allow_mismatch`, when a warning is printed where `warn`)."""
    if state.get("global_batch") != global_batch:
        raise ConfigError(
            f"checkpoint {folder} was trained with global batch {state.get('global_batch')}, "
            f"this run has {global_batch}: the data order would differ"
        )
    what = {
        "model": "model.name_or_path",
        "tokenizer_fingerprint": "tokenizer (vocabulary, special tokens or chat template)",
        "data_fingerprint": f"training data (encoded rows of data.path; checkpoint: "
        f"{state.get('data_path')!r}, this run: {now['data_path']!r})",
    }
    changed = [
        f"  - {label}: checkpoint {state.get(key)!r}, this run {now[key]!r}"
        for key, label in what.items()
        if state.get(key) != now[key]
    ]
    if not changed:
        return
    if state.get(key := "encoder_version") != now.get(key) and any(
        "training data" in c for c in changed
    ):
        changed.append(
            f"    (the encoding itself changed: align_anything's encoder version "
            f"{state.get(key, 1)} → {now.get(key)}; with the same files and settings the rows "
            "differ only in how this version encodes them, and allow_mismatch=true continues)"
        )
    if allow_mismatch:
        if warn:
            print(f"warning: resuming from {folder} although:\n" + "\n".join(changed), flush=True)
        return
    raise ConfigError(
        f"resume from {folder} refused: this run differs from the checkpoint's\n"
        + "\n".join(changed)
        + "\nSet checkpoint.allow_mismatch=true to resume anyway, or start fresh "
        "(another output_dir, or overwrite_output_dir=true)."
    )


SCHEDULE_KEYS = {
    "total_steps": "total steps (train.max_steps / train.epochs)",
    "learning_rate": "train.learning_rate",
    "lr_scheduler": "train.lr_scheduler",
    "warmup_steps": "warmup steps (train.warmup_ratio)",
}


def schedule_note(name: str, state: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How this run's schedule (`now`, with SCHEDULE_KEYS) differs from the one checkpoint
    `name` was written under, and what happens: the schedule is rebuilt for the new length
    and continues at the checkpoint's step. None when nothing changed."""
    changed = [
        f"{label} {state.get(key)!r} -> {now[key]!r}"
        for key, label in SCHEDULE_KEYS.items()
        if state.get(key) != now[key]
    ]
    if not changed:
        return None
    return (
        f"changed since {name}: {'; '.join(changed)}. The learning-rate schedule is rebuilt "
        f"for {now['total_steps']} steps and continues at step {state.get('step')} of it"
    )


# ---------------------------------------------------------------------------- write, load


def last_complete(root: Path, run_id: str) -> Path | None:
    """Run `run_id`'s newest checkpoint with a manifest (not re-verified: for messages)."""
    ours = [p for p in listed(root) if run_id_of(p) == run_id and (p / MANIFEST).is_file()]
    return ours[-1] if ours else None


def engine_tag(name: str) -> str:
    """The folder of a trained engine's DeepSpeed state in a checkpoint: `deepspeed/` for the
    policy, `deepspeed-<name>/` for an engine trained beside it (PPO's critic)."""
    return "deepspeed" if name == "policy" else f"deepspeed-{name}"


def save(
    folder: Path, *, engines: dict[str, Any], ema: Any, rank: int, is_main: bool,
    state: dict[str, Any], configs: dict[str, Any], keep_last: int,
    extra: Callable[[Path], None] | None = None,
) -> Path:  # fmt: skip
    """Write checkpoint `folder` (…/step-N) under a temporary name: the DeepSpeed state of every
    trained engine on every rank, each rank's RNG state, the weight average, what `extra`
    writes into the folder (called on every rank: the step source's state), then (rank 0)
    `configs` (file name →
    JSON data), the trainer `state` and, last, the manifest; rename it when complete, then
    prune the run's older checkpoints. A crash mid-save never damages the last good
    checkpoint. A failed write (disk full, unwritable folder) removes the partial folder and
    raises CheckpointWriteError naming the file, or, when the disk filled up (torch.save says
    so only as a RuntimeError), the folder; on several ranks the failing rank exits and the
    launcher ends the others. Anything else (a stop signal mid-save) also removes the partial
    folder before it propagates. Collective: call on every rank."""
    tmp = atomic.temporary_sibling(folder)
    run_id = state["run_id"]
    try:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        comm.barrier()
        for name, engine in engines.items():
            engine.save_checkpoint(tmp, client_state={"step": state["step"]}, tag=engine_tag(name))
        write_rng_state(tmp, rank)
        if ema is not None:
            ema.save(tmp)
        if extra is not None:
            extra(tmp)
        comm.barrier()
        if is_main:
            for name, data in {**configs, STATE: state}.items():
                (tmp / name).write_text(atomic.to_json(data))
            write_manifest(tmp, run_id=run_id, step=state["step"])  # last
            atomic.publish(tmp, folder)
    except BaseException as err:
        full = _disk_full(err, folder.parent)
        if not (full or isinstance(err, OSError)):
            shutil.rmtree(tmp, ignore_errors=True)
            raise  # not a write that failed (a bug, or a stop signal): as it is, without the folder
        detail = (
            f"{err.strerror or err}{f' ({err.filename})' if err.filename else ''}"
            if isinstance(err, OSError)
            else str(err)
        )
    else:
        detail = None
    if detail is not None:
        # Out of the except block: the failed writer's frames (which hold its open file, whose
        # space is freed only once closed) are gone with the exception.
        gc.collect()
        shutil.rmtree(tmp, ignore_errors=True)  # give back whatever space it took
        good = last_complete(folder.parent, run_id)
        kept = f"the previous checkpoint {good} is intact" if good else "no earlier checkpoint"
        if full:
            need = f"; {good.name} takes {_megabytes(good)} MB" if good else ""
            free = shutil.disk_usage(folder.parent).free >> 20
            detail = f"no space left on device under {folder.parent} ({free} MB free{need})"
        raise CheckpointWriteError(
            f"could not write checkpoint {folder.name} (step {state['step']}): {detail}; {kept}. "
            f"Free space or make {folder.parent} writable, then run again with resume=auto."
        )
    if is_main:  # only once the new one is complete
        prune(folder.parent, run_id=run_id, keep_last=keep_last)
    comm.barrier()
    return folder


# Free space below this after a failed write means the disk filled up. torch.save reports a
# full disk as a RuntimeError of its zip writer ("unexpected pos ..."), without ENOSPC, and a
# failed write leaves at most the last block unused.
_FULL_BELOW_BYTES = 1 << 20


def _disk_full(err: BaseException, folder: Path) -> bool:
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    if not isinstance(err, (OSError, RuntimeError)):
        return False
    try:
        return shutil.disk_usage(folder).free < _FULL_BELOW_BYTES
    except OSError:
        return False


def _megabytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) >> 20


def load(folder: Path, *, engines: dict[str, Any], rank: int) -> int:
    """Load checkpoint `folder` into every trained engine and this rank's RNG state; returns
    its step. A checkpoint of another world size may hold no RNG file for this rank: fresh RNG
    then."""
    state = read_json(folder / STATE)
    try:
        for name, engine in engines.items():
            engine.load_checkpoint(folder, tag=engine_tag(name))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - DeepSpeed's loader raises anything
        raise CheckpointError(
            f"could not load checkpoint {folder}: {type(err).__name__}: {err}. Resume from an "
            "earlier checkpoint (resume=PATH), or start over."
        ) from None
    restore_rng_state(folder, rank)
    return int(state["step"])

"""Data-side cases of issue #24, each through the real entry point: the data cache folder full,
read-only or a file (one error naming the folder and the fix, also on 2 ranks); `datasets`
workers that outlive a killed run; an empty source list; a misspelt built-in dataset name; a
cut image and a folder named like an image."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY_MODEL, finish, launch, spawn

from align_anything.data.synthetic import make_dataset
from align_anything.train import main

TINY = f"model.name_or_path={TINY_MODEL}"


def _pairs(path: Path, rows: int) -> Path:
    path.write_text("".join(
        json.dumps({"prompt": f"(request {i}) What is {i} + 1?", "chosen": f"{i + 1}",
                    "rejected": f"{i + 2}"}) + "\n"
        for i in range(rows)
    ))  # fmt: skip
    return path


def _run(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    """`main` in-process; the run must end with exit 2 and one `error:` line, no traceback."""
    status = main([*args, f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    return err


# ---------------------------------------------------------------------------- the cache folder


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize("where", ["the-folder", "a-parent"])
def test_a_cache_dir_that_is_a_file_is_one_error(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    file = tmp_path / "cache"
    file.write_text("not a folder\n")
    cache_dir = file if where == "the-folder" else file / "data"
    err = _run(["task=sft", TINY, f"data.cache_dir={cache_dir}"], tmp_path, capsys)
    assert (
        f"error: the data cache {cache_dir} cannot be created: {file} is a file, not a folder. "
        f"Move the file away, or set data.cache_dir to another folder (now: {cache_dir})"
    ) in err, err
    assert file.read_text() == "not a folder\n"


@contextlib.contextmanager
def _tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `folder` (root only; skips the test where mounting is refused)."""
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"mount refused here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[Path]:
    """A folder this process cannot write: chmod 555, or for root (whom modes do not stop) a
    read-only tmpfs."""
    if os.geteuid() != 0:
        folder.mkdir()
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    with _tmpfs(folder, "ro,size=1m") as mounted:
        yield mounted


@pytest.mark.usefixtures("in_process_offline")
def test_a_read_only_cache_dir_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with _read_only(tmp_path / "ro") as folder:
        cache_dir = folder / "cache"
        err = _run(["task=sft", TINY, f"data.cache_dir={cache_dir}"], tmp_path, capsys)
    assert f"error: the data cache {cache_dir} cannot be written (" in err, err
    assert f"make it writable, or set data.cache_dir to another folder (now: {cache_dir})" in err, (
        err
    )


@pytest.mark.slow
def test_a_full_cache_dir_is_one_error(tmp_path: Path) -> None:
    """A real full filesystem: a 256 KiB tmpfs (as root; skipped elsewhere, where the next test
    injects the error instead), filled by 2 `datasets` worker processes (of a launched run:
    workers are never forked from this test process)."""
    data = _pairs(tmp_path / "pairs.jsonl", 4400)
    with _tmpfs(tmp_path / "small", "size=256k") as folder:
        cache_dir = folder / "cache"
        run = launch(["task=dpo", TINY, f"data.path={data}", "data.num_proc=2",
                      "data.max_length=64", f"data.cache_dir={cache_dir}"], tmp_path / "out")  # fmt: skip
        assert list(cache_dir.iterdir()) == []  # the half-built entry was removed
    assert run.returncode == 2, run.output[-4000:]
    assert "Traceback" not in run.output and not run.metrics, run.output[-4000:]
    err = run.output
    assert f"error: no space left on the device of the data cache {cache_dir} while " in err
    assert f"or set data.cache_dir to another folder (now: {cache_dir})" in err, err


# ENOSPC as the `datasets` worker pool raises it: in a worker process, with no path. Injected
# (a test wrapper of the entry point), so that the case runs without root and a small disk.
WORKER_ENOSPC = '''"""Entry point whose `datasets` worker processes hit a full disk while writing."""
import errno
import os
import sys

from datasets import arrow_writer

from align_anything.train import main

MAIN = os.getpid()
original = arrow_writer.ArrowWriter.write_batch


def write_batch(self, *args, **kwargs):
    if os.getpid() != MAIN:  # only in a worker of the pool
        raise OSError(errno.ENOSPC, "No space left on device")
    return original(self, *args, **kwargs)


arrow_writer.ArrowWriter.write_batch = write_batch
sys.exit(main())
'''


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_no_space_from_the_worker_pool_is_one_error_on_every_rank(
    nproc: int, tmp_path: Path
) -> None:
    """One rank (python -m) and two ranks (the deepspeed launcher), each through the wrapper."""
    data = _pairs(tmp_path / "pairs.jsonl", 4400)  # 2 workers: 2,200 rows each
    cache_dir = tmp_path / "cache"
    args = ["task=dpo", TINY, f"data.path={data}", "data.num_proc=2", "data.max_length=64",
            f"data.cache_dir={cache_dir}", "train.per_device_batch_size=2"]  # fmt: skip
    (tmp_path / "worker_enospc.py").write_text(WORKER_ENOSPC)
    run = launch(
        args, tmp_path / "run", module="worker_enospc", extra_env={"PYTHONPATH": str(tmp_path)},
        launcher="python" if nproc == 1 else "deepspeed", nproc=nproc,
    )  # fmt: skip
    assert run.returncode == 2, run.output[-4000:]
    assert "Traceback" not in run.output, run.output[-4000:]
    message = f"no space left on the device of the data cache {cache_dir} while preparing"
    assert f"error: {message}" in run.output, run.output[-4000:]
    if nproc == 2:
        assert f"error (rank 1): {message}" in run.output
    assert [p.name for p in cache_dir.iterdir()] == []  # the half-built entry was removed


@pytest.mark.slow
def test_a_cache_dir_that_is_a_file_on_two_ranks(tmp_path: Path) -> None:
    file = tmp_path / "cache"
    file.write_text("not a folder\n")
    run = launch(["task=sft", TINY, f"data.cache_dir={file}"], tmp_path / "run",
                 launcher="deepspeed", nproc=2)  # fmt: skip
    assert run.returncode == 2, run.output[-4000:]
    assert "Traceback" not in run.output, run.output[-4000:]
    assert f"error: the data cache {file} cannot be created: {file} is a file" in run.output
    assert f"error (rank 1): the data cache {file} cannot be created" in run.output


# ---------------------------------------------------------------------------- workers and kill -9


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    """The pids of `pid`'s descendants (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_kill_9_during_tokenising_leaves_no_worker(tmp_path: Path) -> None:
    """Issue #24 case 9: a SIGKILL of the main process while 2 `datasets` workers tokenise left
    them (and the pool's manager process) running until their shards were done."""
    data = _pairs(tmp_path / "pairs.jsonl", 20000)
    proc = spawn(
        ["task=dpo", TINY, f"data.path={data}", "data.num_proc=2", "data.max_length=64",
         "data.eval_fraction=0", "data.eval_path=null", f"data.cache_dir={tmp_path / 'cache'}"],
        tmp_path / "run",
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if "tokenising 20000 rows (data.num_proc=2)" in line:
                break
        workers: list[int] = []
        deadline = time.monotonic() + 60
        while len(workers) < 3 and time.monotonic() < deadline:  # 2 workers and the manager
            time.sleep(0.2)
            workers = _children(proc.pid)
        assert len(workers) >= 3, f"no worker processes seen under {proc.pid}: {workers}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in workers if _alive(p)] == [], "workers outlived the killed run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        finish(proc, tmp_path / "run", timeout_s=30)


# ---------------------------------------------------------------------------- names and lists


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
def test_an_empty_source_list_is_one_error(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    err = _run(["task=sft", TINY, f"{key}=[]"], tmp_path, capsys)
    assert f"{key}: an empty list names no data: give a file, folder, built-in or hub name" in err


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize("name", ["arith-sftt", "arith_sft", "arith-sfts"])
def test_a_name_close_to_a_builtin_gets_did_you_mean_before_any_hub_lookup(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt built-in name used to try the hub (five retries, ~30 s online) and suggest
    nothing. The hub loader is replaced by one that fails the test: it must not be reached."""
    from align_anything.data import sources

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked for a name close to a built-in one")

    monkeypatch.setattr(sources, "_load_hub", no_hub)
    err = _run(["task=sft", TINY, f"data.path={name}"], tmp_path, capsys)
    assert f"data path '{name}' is not a built-in dataset (did you mean 'arith-sft'?)" in err


# ---------------------------------------------------------------------------- media files


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize("damage", ["cut-png", "cut-jpeg", "folder"])
def test_a_cut_image_or_a_folder_is_named_for_what_it_is_at_start(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Issue #24 case 19: a cut image passed the start-up check (its header only) and failed
    in a batch, saying "(it was readable when the run started)"; a folder named like an image
    was reported as "does not exist"."""
    from PIL import Image

    folder = make_dataset("shapes", tmp_path / "shapes", rows=8, seed=1)
    rows = [json.loads(line) for line in (folder / "sft.jsonl").read_text().splitlines()]
    image = folder / "images" / "0003.png"
    if damage == "cut-png":
        data = image.read_bytes()
        image.write_bytes(data[: len(data) // 2])
    elif damage == "cut-jpeg":
        with Image.open(image) as png:
            png.convert("RGB").resize((64, 64)).save(folder / "images" / "0003.jpg", quality=95)
        data = (folder / "images" / "0003.jpg").read_bytes()
        (folder / "images" / "0003.jpg").write_bytes(data[: len(data) // 2])
        image = folder / "images" / "0003.jpg"
        rows[3]["images"] = ["images/0003.jpg"]
    else:
        image = folder / "images" / "folder.png"
        image.mkdir()
        rows[3]["images"] = ["images/folder.png"]
    (folder / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _run(["task=sft", "model.name_or_path=tiny-random-llava", "train.precision=fp32",
                f"data.path={folder / 'bad.jsonl'}"], tmp_path, capsys)  # fmt: skip
    expected = (
        f"line 4: image path {image} is a folder, not a file"
        if damage == "folder"
        else f"line 4: image images/{image.name} cannot be read: "
    )
    assert expected in err, err
    assert "does not exist" not in err and "readable when the run started" not in err


def test_an_image_that_fails_to_decode_later_is_not_called_readable_at_start(
    tmp_path: Path,
) -> None:
    """The check at start-up reads a header and whether the file is whole; an image that fails
    to decode in a batch afterwards (changed since) is reported with what was checked."""
    import torch

    from align_anything.errors import DataError
    from align_anything.families import zoo
    from align_anything.families.language import loading
    from align_anything.families.language.multimodal import MediaSupport

    processor = loading.load_text_side(
        zoo.resolve_model_path("tiny-random-llava"), trust_remote_code=False
    )[2]
    support = MediaSupport(processor, ("image",))
    folder = make_dataset("shapes", tmp_path / "shapes", rows=2, seed=1)
    image = folder / "images" / "0000.png"
    record = support.prepare_record(
        {"messages": [{"role": "user", "content": "What colour?"},
                      {"role": "assistant", "content": "red"}],
         "images": ["images/0000.png"]}, folder,
    )  # fmt: skip
    image.write_bytes(image.read_bytes()[:100])  # cut after the start-up check
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long),
             "attention_mask": torch.ones(1, 4, dtype=torch.long),
             "labels": torch.ones(1, 4, dtype=torch.long)}  # fmt: skip
    with pytest.raises(DataError) as raised:
        support.attach(batch, [record], copies=1)
    message = str(raised.value)
    assert f"image {image} cannot be decoded" in message, message
    assert "the check at start-up reads its header and, for PNG and JPEG, whether the file is " in (
        message
    )
    assert "readable when the run started" not in message

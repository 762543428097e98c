"""Logging backends, the progress display and the plot command, read back from one real run.

One tiny SFT run logs to every backend at once (console, jsonl, tensorboard, wandb). wandb runs
with no API key anywhere (variable unset, no netrc, empty wandb settings folders) and with every
HTTP(S) request pointed at a closed local port, so it must choose offline mode by itself.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_MODEL, RunResult, launch

from align_anything.training.tracking import Progress

STEPS = 4


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    home = tmp_path_factory.mktemp("tracking")
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens, every request fails fast
    env = {
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
        "NETRC": str(home / "no-netrc"),
        "HTTP_PROXY": closed,
        "HTTPS_PROXY": closed,
        "NO_PROXY": "",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
            patch.delenv(name, raising=False)
        run = launch(
            [
                "task=sft", f"model.name_or_path={TINY_MODEL}", "train.precision=fp32",
                f"train.max_steps={STEPS}", "data.max_eval_samples=8", "checkpoint.save_final=false",
                "logging.backends=[console,jsonl,tensorboard,wandb]", "logging.run_name=tiny-sft",
            ],
            home / "run",
            extra_env=env,
        )  # fmt: skip
    return run.check()


def _train_value(run: RunResult, step: int, key: str) -> float:
    (record,) = [m for m in run.train_steps() if m["step"] == step]
    return float(record[key])


@pytest.mark.slow
def test_tensorboard_events_hold_the_jsonl_numbers(tracked_run: RunResult) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked_run.output_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "learning_rate", "grad_norm", "tokens_per_second", "eval/loss"} <= tags, tags
    for key in ("loss", "learning_rate", "grad_norm", "perplexity"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert sorted(logged) == list(range(1, STEPS + 1)), (key, logged)
        for step, value in logged.items():  # event files store float32
            assert value == pytest.approx(_train_value(tracked_run, step, key), rel=1e-6)
    eval_loss = {e.step: e.value for e in events.Scalars("eval/loss")}
    assert eval_loss[0] == pytest.approx(tracked_run.eval("before")["eval/loss"], rel=1e-6)
    assert eval_loss[STEPS] == pytest.approx(tracked_run.eval("after")["eval/loss"], rel=1e-6)


def _wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of a `.wandb` file. wandb 0.2x+ reads these files only in its Go
    core, with no Python reader left, so this follows the format (a 7-byte file header, then
    LevelDB's log format: 32 KiB blocks of records with a 7-byte header each, large records
    split into FIRST/MIDDLE/LAST pieces)."""
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a wandb transaction log"
    block, pos, pending, records = 32768, 7, b"", []
    full, first, middle, last = 1, 2, 3, 4
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == full:
            records.append(chunk)
        elif kind == first:
            pending = chunk
        elif kind == middle:
            pending += chunk
        elif kind == last:
            records.append(pending + chunk)
    return records


def _wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2

    (log_file,) = run_dir.glob("run-*.wandb")
    history: dict[int, dict[str, Any]] = {}
    for raw in _wandb_records(log_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            history.setdefault(record.history.step.num, {}).update(items)
    return history


@pytest.mark.slow
def test_wandb_runs_offline_without_an_api_key(tracked_run: RunResult) -> None:
    assert "wandb: no API key configured, logging offline" in tracked_run.output
    run_dirs = sorted((tracked_run.output_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, run_dirs
    history = _wandb_history(run_dirs[0])
    assert sorted(history) == list(range(STEPS + 1)), sorted(history)
    for step in range(1, STEPS + 1):
        for key in ("loss", "learning_rate", "grad_norm"):
            assert history[step][key] == pytest.approx(_train_value(tracked_run, step, key))
    assert history[0]["eval/loss"] == pytest.approx(tracked_run.eval("before")["eval/loss"])
    assert history[STEPS]["eval/loss"] == pytest.approx(tracked_run.eval("after")["eval/loss"])


@pytest.mark.slow
def test_progress_lines_without_a_terminal(tracked_run: RunResult) -> None:
    """Output captured by a pipe (as in CI): one plain line per step with loss, tokens/s, ETA."""
    lines = [line for line in tracked_run.output.splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS, lines
    for step, line in enumerate(lines, start=1):
        assert line.startswith(f"step {step}/{STEPS} loss "), line
        assert " tok/s " in line and " eta " in line, line
        loss = float(line.split(" loss ")[1].split()[0])
        assert loss == pytest.approx(_train_value(tracked_run, step, "loss"), abs=1e-4)
    assert "\r" not in tracked_run.output  # no carriage-return bar redraws in a CI log


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal the display is a tqdm bar: step n/total, loss, tokens/s and ETA."""
    screen = _Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    progress = Progress(10, enabled=True)
    for step in range(1, 4):
        progress.update(step, {"loss": 2.5 / step, "tokens_per_second": 1234.0})
    progress.close()
    text = screen.getvalue()
    last = text.split("\r")[-1]
    assert "3/10" in last and "loss=0.8333" in last and "tok/s=1234" in last, last
    assert "<" in last  # tqdm's [elapsed<remaining]: the ETA


@pytest.mark.slow
def test_plot_draws_loss_and_task_metrics(tracked_run: RunResult, tmp_path: Path) -> None:
    from PIL import Image

    from align_anything.tools.plot import build_figure, main, read_metrics

    figure = build_figure(read_metrics(tracked_run.output_dir))
    titles = [axis.get_title() for axis in figure.axes]
    assert titles == ["loss", "perplexity"], titles
    loss_axis = figure.axes[0]
    train_line, eval_line = loss_axis.get_lines()
    assert list(train_line.get_xdata()) == list(range(1, STEPS + 1))
    assert list(train_line.get_ydata()) == pytest.approx(tracked_run.losses())
    assert list(eval_line.get_xdata()) == [0, STEPS]

    out = tmp_path / "curves.png"
    assert main([str(tracked_run.output_dir), "--out", str(out)]) == 0
    with Image.open(out) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 200


def test_plot_names_a_missing_metrics_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from align_anything.tools.plot import main

    assert main([str(tmp_path)]) == 2
    assert f"{tmp_path / 'metrics.jsonl'}: no such file" in capsys.readouterr().err

"""Metrics sinks (JSONL always; console, TensorBoard, wandb when asked) and the progress display.

Only rank 0 constructs these. The progress display is a tqdm bar on a terminal and plain lines
otherwise, so CI logs stay readable.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_backends(backends: Sequence[str]) -> None:
    """Fail before any compute when a selected logging backend's package is missing."""
    import importlib.util

    from align_anything.errors import ConfigError

    missing = [
        name for name in backends
        if name in BACKEND_PACKAGES and importlib.util.find_spec(BACKEND_PACKAGES[name]) is None
    ]  # fmt: skip
    if missing:
        packages = " ".join(BACKEND_PACKAGES[name] for name in missing)
        raise ConfigError(
            f"logging.backends includes {', '.join(missing)} but the package is not installed: "
            f"pip install {packages} (or pip install -e '.[tracking]'), or drop it from logging.backends"
        )


def keep_records_until(path: Path, step: int, *, final_eval: bool) -> int:
    """Rewrite `path` (metrics.jsonl) atomically without the records a resumed run logs again:
    those of steps after `step` (the checkpoint it resumes from: a killed run logged them, and
    its successor trains them again), and at `step` the closing evaluation ("after"), unless
    `final_eval` (the run had finished at `step` and now goes on: that evaluation happened and
    is not repeated). A line cut short by a kill is dropped too. Returns how many lines went."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            logged = int(record["step"])
        except (ValueError, KeyError, TypeError):
            dropped += bool(line.strip())
            continue
        if logged > step or (logged == step and record.get("phase") == "after" and not final_eval):
            dropped += 1
            continue
        kept.append(line + "\n")
    if dropped:
        from align_anything import atomic

        atomic.write_text(path, "".join(kept))
    return dropped


class MetricsLogger:
    """Writes one JSON object per logged step to `output_dir/metrics.jsonl` and forwards the same
    numbers to TensorBoard / wandb when those backends are selected. A resumed run
    (`resume_step`: the step of its checkpoint) first removes what it will log again
    (`keep_records_until`), so that each step has one record however often the run was cut."""

    def __init__(
        self,
        output_dir: Path,
        *,
        backends: Sequence[str],
        project: str,
        run_name: str | None,
        config: dict[str, Any],
        resume_step: int | None,
        finished: bool = False,
    ) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.notes: list[str] = []
        if resume_step is not None:
            dropped = keep_records_until(self.path, resume_step, final_eval=finished)
            if dropped:
                self.notes.append(
                    f"metrics.jsonl: removed {dropped} record(s) past step {resume_step} "
                    "(logged before the interruption; this run logs those steps again)"
                )
        # A fresh run never truncates: its folder was checked to hold no earlier run's metrics.
        self._file = self.path.open("x" if resume_step is None else "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            # Resumed: events of the steps logged again are purged (TensorBoard's own way).
            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=purge)
            self.notes.append(f"tensorboard: {output_dir / 'tensorboard'}")
        if "wandb" in backends:
            import wandb

            mode = None
            # wandb.login(prompt=False, verify=False) looks for a key where wandb does (the
            # WANDB_API_KEY variable, wandb's settings file, ~/.netrc) without prompting or
            # touching the network; without one, an online init would prompt or fail.
            if os.environ.get("WANDB_MODE") is None and not wandb.login(prompt=False, verify=False):
                mode = "offline"
                self.notes.append(
                    "wandb: no API key configured, logging offline "
                    f"(upload later with `wandb sync {output_dir / 'wandb'}`)"
                )
            self._wandb = wandb.init(
                project=project, name=run_name, config=config, dir=str(output_dir), mode=mode
            )
            run_dir = Path(self._wandb.dir).parent  # wandb.dir is the run's files/ folder
            self.notes.append(f"wandb: {self._wandb.settings.mode} run in {run_dir}")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def log_image(self, step: int, name: str, image: Any, *, caption: str = "") -> None:
        """An image (a PIL image: text-to-image runs' sample grid) to TensorBoard and wandb
        when they are on; metrics.jsonl holds numbers only (the grid is a PNG file)."""
        if self._tb is not None:
            import numpy as np

            self._tb.add_image(name, np.asarray(image), step, dataformats="HWC")
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Image(image, caption=caption)}, step=step)

    def log_audio(self, step: int, name: str, clips: Sequence[Path]) -> None:
        """Audio files (WAV: text-to-audio runs' samples, each labelled by its file name) to
        TensorBoard and wandb when they are on, so they play there; metrics.jsonl holds
        numbers only (the files are in the run's folder)."""
        if self._tb is not None and clips:
            import soundfile

            for clip in clips:
                wave, rate = soundfile.read(str(clip), dtype="float32", always_2d=True)
                self._tb.add_audio(f"{name}/{clip.stem}", wave.mean(axis=1), step,
                                   sample_rate=rate)  # fmt: skip
            self._tb.flush()
        if self._wandb is not None and clips:
            import wandb

            audio = [wandb.Audio(str(clip), caption=clip.stem) for clip in clips]
            self._wandb.log({f"{name}_audio": audio}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Progress:
    """Step progress with loss, tokens/s and ETA: a tqdm bar on a terminal, plain lines
    otherwise (one per logged step)."""

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self.start = time.perf_counter()
        self.initial = initial
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        parts = {"loss": f"{metrics['loss']:.4f}"} if "loss" in metrics else {}
        if "tokens_per_second" in metrics:
            parts["tok/s"] = f"{metrics['tokens_per_second']:.0f}"
        if self._bar is not None:
            self._bar.set_postfix(parts, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        done = step - self.initial
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - step) if done else 0.0
        fields = " ".join(f"{k} {v}" for k, v in parts.items())
        print(
            f"step {step}/{self.total} {fields} elapsed {_format_duration(elapsed)} "
            f"eta {_format_duration(eta)}",
            flush=True,
        )

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class StepResult:
    """One optimizer step, summed over every rank: metric sums (over the step's items), items,
    tokens, rate, norm; and `figures`, global per-step values that are not sums over items (an
    online round's mean reward, lengths, generation speed): averaged over the steps logged
    together, never scaled by the item count (a step whose items are all masked still reports
    its round)."""

    sums: dict[str, float]
    items: float
    tokens: float
    learning_rate: float
    grad_norm: float | None
    figures: dict[str, float] = field(default_factory=dict)


class MetricWindow:
    """Training metrics between two logged steps: per-item sums, items, tokens, time."""

    def __init__(self) -> None:
        self.start = self._window_start = time.perf_counter()
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.figures: dict[str, list[float]] = {}
        self.items = self.tokens = 0.0
        self.learning_rate = 0.0
        self.grad_norm: float | None = None
        self._window_start = time.perf_counter()

    def add(self, step: StepResult) -> None:
        for key, value in step.sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        for key, value in step.figures.items():
            self.figures.setdefault(key, []).append(value)
        self.items += step.items
        self.tokens += step.tokens
        self.learning_rate, self.grad_norm = step.learning_rate, step.grad_norm

    def averages(self) -> dict[str, float]:
        """Each metric per item (token for SFT, pair for DPO/RM) over the window; each
        per-step figure as its mean over the window's steps."""
        per_item = {k: v / max(self.items, 1.0) for k, v in self.sums.items()}
        return per_item | {k: sum(v) / len(v) for k, v in self.figures.items()}

    def rates(self, *, samples: bool) -> dict[str, float | None]:
        """The last step's rate and norm, throughput over the window, time since the start."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        return {
            "learning_rate": self.learning_rate,
            "grad_norm": self.grad_norm,
            # None where a task puts no tokens through its model (text-to-image: images)
            "tokens_per_second": self.tokens / elapsed if self.tokens else None,
            "samples_per_second": self.items / elapsed if samples else None,
            "elapsed_seconds": now - self.start,
        }

    def metrics(
        self, averages: dict[str, float], *, epoch: float, samples: bool, **extra: Any
    ) -> dict[str, Any]:
        """One logged line: the window's averages, the rates, `epoch` and `extra` (None
        values left out)."""
        line = {**averages, "epoch": epoch, **self.rates(samples=samples), **extra}
        return {k: v for k, v in line.items() if v is not None}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def quiet_library_progress_bars() -> None:
    """Our progress display is the only one: transformers' per-load bars and datasets' split
    bars would otherwise print once per rank."""
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()


def completions_table(
    rows: list[dict[str, Any]], *, step: int, logger: MetricsLogger | None, console: bool
) -> None:
    """Online RL's sample of a step's prompts, completions (or images: PIL images, shown by
    their size on the console, as images in wandb), rewards and advantages: a rich table on the
    console, a wandb Table when wandb is on (rank 0)."""
    if not rows:
        return

    def is_image(value: Any) -> bool:
        return hasattr(value, "mode") and hasattr(value, "size")

    columns = list(rows[0])
    if console:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"step {step}: completions", show_lines=True)
        for name in columns:
            table.add_column(name, overflow="fold")
        for row in rows:
            table.add_row(*(
                f"{v:.4g}" if isinstance(v, float)
                else f"image {v.size[0]}x{v.size[1]}" if is_image(v) else str(v)
                for v in row.values()
            ))  # fmt: skip
        Console(soft_wrap=False).print(table)
    run = getattr(logger, "_wandb", None)
    if run is not None:
        import wandb

        data = [[wandb.Image(row[c]) if is_image(row[c]) else row[c] for c in columns]
                for row in rows]  # fmt: skip
        run.log({"completions": wandb.Table(columns=columns, data=data)}, step=step)

"""Draw a run's loss and task metrics from its `metrics.jsonl` to a PNG.

    python -m align_anything plot outputs/dpo                 # writes outputs/dpo/metrics.png
    python -m align_anything plot outputs/dpo --out dpo.png

One panel for the loss and one per task metric (e.g. `rewards/accuracies` for DPO, `accuracy`
for RM, `perplexity` for SFT): training values as a line over optimizer steps, held-out values
(`eval/<name>` lines of metrics.jsonl) as labelled markers on the same panel. Needs matplotlib
(`pip install matplotlib`, or the `plot` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from align_anything.errors import DataError, UserError, check_output_file, report

# Logged figures that describe the run's mechanics rather than what the model learns.
NOT_TASK_METRICS = frozenset(
    {
        "step", "epoch", "phase", "learning_rate", "grad_norm", "tokens_per_second",
        "samples_per_second", "elapsed_seconds", "skipped_steps",
    }
)  # fmt: skip
INSTALL_HINT = "pip install matplotlib (or pip install -e '.[plot]')"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (or of `path/metrics.jsonl` for a run folder)."""
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"{file}: no such file. Pass a run's output_dir (which holds metrics.jsonl) or the "
            "metrics.jsonl file itself."
        )
    records = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{file} line {number}: invalid JSON ({err})") from None
    if not records:
        raise DataError(f"{file} is empty: the run logged no step yet")
    return records


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def panel_names(records: list[dict[str, Any]]) -> list[str]:
    """Panels to draw, in order: `loss`, then each task metric (train and eval names merged,
    `eval/` stripped), in the order they first appear."""
    names: list[str] = []
    for record in records:
        for key, value in record.items():
            name = key.removeprefix("eval/")
            if name in NOT_TASK_METRICS or not _is_number(value) or name in names:
                continue
            names.append(name)
    return sorted(names, key=lambda name: name != "loss")


def build_figure(records: list[dict[str, Any]], *, title: str = "") -> Any:
    """A matplotlib Figure with one axis per panel (`panel_names`), each titled by its metric."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(f"plotting needs matplotlib: {INSTALL_HINT}") from None
    names = panel_names(records)
    if not names:
        raise DataError("no numeric loss or task metric in the records: nothing to plot")
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    # Figure without pyplot: no global state and no GUI backend; savefig renders with Agg.
    figure = Figure(figsize=(5 * columns, 3.2 * rows), layout="constrained")
    if title:
        figure.suptitle(title)
    train = [r for r in records if "phase" not in r]
    evals = [r for r in records if "phase" in r]
    for index, name in enumerate(names):
        axis = figure.add_subplot(rows, columns, index + 1)
        axis.set_title(name)
        axis.set_xlabel("step")
        points = [(r["step"], r[name]) for r in train if _is_number(r.get(name))]
        if points:
            axis.plot(*zip(*points, strict=True), label="train", linewidth=1.2)
        held_out = [(r["step"], r[f"eval/{name}"], r["phase"]) for r in evals
                    if _is_number(r.get(f"eval/{name}"))]  # fmt: skip
        if held_out:
            steps, values, phases = zip(*held_out, strict=True)
            axis.plot(steps, values, "o--", label="eval", markersize=5)
            for step, value, phase in held_out:
                axis.annotate(phase, (step, value), textcoords="offset points", xytext=(4, 4),
                              fontsize=7)  # fmt: skip
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return figure


def plot_run(path: Path, out: Path | None = None) -> Path:
    """Draw `path` (a run folder or a metrics.jsonl file) to `out` (default: metrics.png beside
    the metrics file); returns the PNG's path."""
    if out is not None:
        check_output_file("--out", out)
    records = read_metrics(path)
    folder = path if path.is_dir() else path.parent
    out = out or folder / "metrics.png"
    figure = build_figure(records, title=str(folder))
    figure.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m align_anything plot", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run", help="a run's output_dir (holding metrics.jsonl), or the file")
    parser.add_argument("--out", help="the PNG to write (default: metrics.png in the run folder)")
    args = parser.parse_args(argv)
    try:
        written = plot_run(Path(args.run), Path(args.out) if args.out else None)
    except UserError as err:
        return report(err)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

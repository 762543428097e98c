"""Where one training step's time goes: align_anything's SFT or KTO step on the long rows.

    python benchmarks/profile_step.py --task sft                  # 8 conversations, max_length 512
    python benchmarks/profile_step.py --task kto --batch 4 --ops 20

The job of `sft_vs_trl.py` / `kto_vs_trl.py --rows hh` (the same rows, `common.long_pairs`, in
the same order, the same overrides: smollm2-135m-instruct, fp32, ZeRO-0, one process), run in
this process through the real set-up (`training.setup.setup`, the task's `build`) and the real
step (`training.loop.train_step`), two steps: step 1 warms up (allocator, kernels), step 2 is
measured. Nothing in the step is re-implemented: the step source, the task's `before_losses`
and `loss`, and the engine's `backward` and `step` are wrapped by timers on their instances, and
the decoder's forward (the transformer layers, without the LM head) by module hooks, so:

- data path: the step source's `step` (rows read, KL completions paired, collated layouts);
- KL pass (KTO): `before_losses`, the no-grad forward over the KL sequences (decoder, then LM
  head + log-probs + the KL point);
- forward: the decoder's forward inside `loss`; logits + loss: the rest of `loss` (LM head where
  a scored token is predicted, log-softmax, gather, the loss);
- backward: `engine.backward`; optimizer: `engine.step` (gradient norm, clipping, AdamW);
- other: the rest of `train_step` (metric sums, bookkeeping).

Padding: each layout's positions (rows × width) against its real tokens, and what one padded
row per sequence (TRL's layout) would hold for the same sequences. With `--ops N`, the step is
also run under torch.profiler and its N largest operators by self CPU time are printed (the
profiler adds its own overhead to that step: the regions are timed on the step before it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import kto_vs_trl
import sft_vs_trl
from common import ROW_SETS, Setup, child_inputs, step_tokens

BUILDERS: dict[str, Callable[..., Setup]] = {
    "sft": sft_vs_trl.build_setup,
    "kto": kto_vs_trl.build_setup,
}


def clocks() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads)."""
    return time.perf_counter(), time.process_time()


def faults() -> tuple[int, float]:
    """(minor page faults, system CPU seconds) of this process so far: memory the kernel
    maps in (and zeroes) on first touch."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_stime


class Regions:
    """Wall and CPU seconds per named region; the decoder's forward attributed to the region
    it ran in. CPU seconds (all threads) move far less than wall seconds when other work
    shares the cores."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.decoder: dict[str, float] = defaultdict(float)
        self.decoder_cpu: dict[str, float] = defaultdict(float)
        self.faults: dict[str, int] = defaultdict(int)
        self.system: dict[str, float] = defaultdict(float)
        self.current = "other"
        self._decoder_start = (0.0, 0.0)

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        outer, self.current = self.current, name
        wall, cpu = clocks()
        minflt, stime = faults()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - wall
            self.cpu[name] += time.process_time() - cpu
            after = faults()
            self.faults[name] += after[0] - minflt
            self.system[name] += after[1] - stime
            self.current = outer

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        """Time every call of `owner.attribute` (an instance attribute shadows the method)."""
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.region(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)

    def hook_decoder(self, decoder: Any) -> None:
        def before(*_: Any) -> None:
            self._decoder_start = clocks()

        def after(*_: Any) -> None:
            wall, cpu = clocks()
            self.decoder[self.current] += wall - self._decoder_start[0]
            self.decoder_cpu[self.current] += cpu - self._decoder_start[1]

        decoder.register_forward_pre_hook(before)
        decoder.register_forward_hook(after)

    def reset(self) -> None:
        for figures in (self.seconds, self.cpu, self.decoder, self.decoder_cpu, self.faults,
                        self.system):  # fmt: skip
            figures.clear()


class RssSampler:
    """The process's resident set size, read from /proc/self/statm every `interval` seconds
    on a daemon thread, its peak kept per region (`regions.current` when sampled; the phase
    name given to `phase` outside the step): where the run's peak RSS is reached."""

    def __init__(self, regions: Regions, interval: float = 0.002) -> None:
        import threading

        self.regions, self.interval = regions, interval
        self.phase: str | None = "set-up"
        self.peak: dict[str, int] = defaultdict(int)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        with open("/proc/self/statm", "rb") as statm:
            while not self._stop.wait(self.interval):
                statm.seek(0)
                rss = int(statm.read().split()[1]) * self._page
                name = self.phase or self.regions.current
                self.peak[name] = max(self.peak[name], rss)

    def table(self) -> str:
        self._stop.set()
        self._thread.join()
        import resource

        lines = ["| phase or region of the step | peak RSS MiB |", "|---|---|"]
        lines += [f"| {name} | {rss / 2**20:,.0f} |" for name, rss in self.peak.items()]
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        lines.append(f"| **process peak (ru_maxrss)** | **{maxrss:,.0f}** |")
        return "\n".join(lines)


def layouts(batch: Any) -> list[tuple[str, Any]]:
    """The layouts a step's micro-batch puts through the model (KTO: its own and its KL
    sequences)."""
    if hasattr(batch, "own"):
        return [("trained sequences", batch.own), ("KL sequences (no grad)", batch.kl)]
    return [("trained sequences", batch)]


def padding_rows(sequence_lengths: list[int]) -> tuple[int, int]:
    """(positions, real tokens) of one right-padded row per sequence."""
    return len(sequence_lengths) * max(sequence_lengths), sum(sequence_lengths)


def step_table(regions: Regions, total: tuple[float, float]) -> str:
    """The step's regions as a markdown table: wall seconds, CPU seconds (all threads) and the
    CPU share of the step. `total`: the step's (wall, CPU) seconds."""
    both = (regions.seconds, regions.cpu)
    decoder = (regions.decoder, regions.decoder_cpu)
    rows: list[tuple[str, list[float]]] = [
        ("data path (step source: rows → layouts)", [f["data"] for f in both])
    ]
    if regions.decoder.get("kl"):
        rows += [
            ("KL pass: decoder forward (no grad)", [d["kl"] for d in decoder]),
            ("KL pass: LM head, log-probs, KL point",
             [f["kl"] - d["kl"] for f, d in zip(both, decoder, strict=True)]),
        ]  # fmt: skip
    rows += [
        ("forward: decoder (30 layers)", [d["loss"] for d in decoder]),
        ("logits + loss (LM head, log-softmax, gather, loss)",
         [f["loss"] - d["loss"] for f, d in zip(both, decoder, strict=True)]),
        ("backward", [f["backward"] for f in both]),
        ("optimizer (grad norm, clipping, AdamW)", [f["optimizer"] for f in both]),
    ]  # fmt: skip
    rows.append(("other (metrics, bookkeeping)",
                 [t - sum(r[1][k] for r in rows) for k, t in enumerate(total)]))  # fmt: skip
    lines = ["| region | wall s | CPU s | CPU share |", "|---|---|---|---|"]
    lines += [f"| {name} | {w:.2f} | {c:.2f} | {c / total[1]:.0%} |" for name, (w, c) in rows]
    lines.append(f"| **step** | **{total[0]:.2f}** | **{total[1]:.2f}** | 100% |")
    return "\n".join(lines)


def padding_table(batches: list[Any], setup: Setup, step: int) -> str:
    """Positions against real tokens, in align_anything's layouts and in one padded row per
    sequence, for the measured step."""
    lines = [
        "| sequences | layout rows × width | positions | real tokens | padding share "
        "| one padded row per sequence: positions, padding share |",
        "|---|---|---|---|---|---|",
    ]
    rows = setup.token_lengths[step * setup.batch : (step + 1) * setup.batch]
    for index, (name, layout) in enumerate(layouts(batches[0])):
        shape = tuple(layout.input_ids.shape)
        positions, real = shape[0] * shape[1], layout.tokens
        if setup.task == "sft":  # token_lengths: [tokens, answer tokens] per row
            plain = padding_rows([row[0] for row in rows])
        else:  # KTO: [own, KL] per row
            plain = padding_rows([row[index] for row in rows])
        lines.append(
            f"| {name} | {shape[0]} × {shape[1]} | {positions:,} | {real:,} | "
            f"{1 - real / positions:.0%} | {plain[0]:,}, {1 - plain[1] / plain[0]:.0%} |"
        )
    return "\n".join(lines)


def profile(
    task: str, *, batch: int, max_length: int, ops: int, threads: int | None, extra: list[str]
) -> None:
    import torch

    from align_anything.config import load_config
    from align_anything.tasks import TASKS
    from align_anything.training import loop, setup

    if threads:
        torch.set_num_threads(threads)
    job = BUILDERS[task](steps=3 if ops else 2, batch=batch, max_length=max_length,
                         learning_rate=1e-5, row_set="hh")  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix=f"aa-profile-{task}-"))
    overrides, _ = child_inputs(job, workdir)
    cfg = load_config([*overrides, *extra, f"output_dir={workdir / 'run'}"])
    spec = TASKS[cfg.task]
    regions = Regions()
    rss = RssSampler(regions)
    with ExitStack() as stack:
        start = time.perf_counter()
        run = setup.setup(cfg, spec, stack)
        built = time.perf_counter()
        rss.phase = "build (KTO: the reference pass)"
        task_, source = spec.build(run)  # KTO: its reference pass over every row, once
        rss.phase = None
        print(f"set-up {built - start:.1f} s; build (KTO: the reference pass) "
              f"{time.perf_counter() - built:.1f} s", flush=True)  # fmt: skip
        engine = run.engines["policy"]
        regions.wrap(source, "step", "data")
        regions.wrap(task_, "before_losses", "kl")
        regions.wrap(task_, "loss", "loss")
        regions.wrap(engine, "backward", "backward")
        regions.wrap(engine, "step", "optimizer")
        regions.hook_decoder(engine.module.get_decoder())
        collated: list[Any] = []
        original_step = source.step

        def keep_batches(step: int) -> Any:
            produced = original_step(step)
            collated[:] = list(produced.batches)
            return produced

        source.step = keep_batches
        for engine_ in run.engines.values():
            engine_.train()
        timings = []
        for _ in range(2):
            regions.reset()
            wall, cpu = clocks()
            loop.train_step(run, task_, source)
            timings.append((time.perf_counter() - wall, time.process_time() - cpu))
        per_step = step_tokens(job.row_tokens, batch=batch)
        print(f"\n## {task.upper()} step 2 of {batch} long rows (max_length {max_length}), "
              f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; "
              f"step 1 (warm-up) {timings[0][0]:.2f} s; overrides {extra or 'none'}\n")  # fmt: skip
        print(step_table(regions, timings[1]))
        print("\npage faults (system CPU s) per region: " + ", ".join(
            f"{name} {regions.faults[name]:,} ({regions.system[name]:.2f} s)"
            for name in regions.faults))  # fmt: skip
        print(f"\n{per_step[1]:,} non-padding tokens in the step's sequences "
              f"({per_step[1] / timings[1][0]:.0f} tokens/s wall, "
              f"{per_step[1] / timings[1][1]:.0f} per CPU second)\n", flush=True)  # fmt: skip
        print(padding_table(collated, job, step=1))
        print(f"\nPeak resident memory (sampled every {rss.interval * 1e3:g} ms), steps 1-2:\n")
        print(rss.table())
        if ops:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                loop.train_step(run, task_, source)
            print(f"\nstep 3 under torch.profiler, the {ops} largest operators by self CPU time:\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ops))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(BUILDERS), required=True)
    parser.add_argument("--batch", type=int, default=8, help="rows per optimizer step")
    parser.add_argument("--max-length", type=int, default=ROW_SETS["hh"])
    parser.add_argument("--ops", type=int, default=0, help="also a torch.profiler op table")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="extra align_anything overrides (e.g. speed.share_prefix=false)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    profile(args.task, batch=args.batch, max_length=args.max_length, ops=args.ops,
            threads=args.threads, extra=args.overrides)  # fmt: skip


if __name__ == "__main__":
    main()

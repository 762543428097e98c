"""Data preparation at scale: align_anything's tokenise-once Arrow cache against TRL 1.16's
`DPOTrainer` preprocessing, on the same preference rows with the same number of processes.

    python benchmarks/data_scale.py                       # 1k and 10k pairs, 2 processes
    python benchmarks/data_scale.py --sizes 1000 10000 100000 --num-proc 2

Rows: the HH-RLHF harmless-base test pairs (../shared/data, 2,312 pairs; else the sample in
tests/data) as message lists (prompt, chosen, rejected), repeated to the size asked for with
the row number written into the first user turn, so no two rows are equal (and no cache of
either side can reuse one row for another). One JSON-lines file per size, read by both sides.

Each measurement is its own process (so its peak RSS is its own, from `os.wait4`), with an
empty `datasets` cache:

- **ours, first run**: `data.pipeline` + `data.cache` as a run's set-up calls them
  (`Trainer._build_data` without the process group): key, convert, encode with
  `data.num_proc` processes, write the cache entry, open it, row lengths; task dpo,
  `max_length` 512, `truncation=drop`, no held-out split.
- **ours, cached**: the same again: a cache hit (the files hashed, the entry verified and
  memory-mapped, the row lengths read).
- **TRL**: `datasets.load_dataset("json")` of the same file, then `DPOTrainer._prepare_dataset`
  (TRL's own preprocessing: three chat-template tokenisations per pair, `dataset.map` with
  `dataset_num_proc`), `max_length` 512. TRL drops no row for its length (its collator cuts).

Printed: seconds and peak RSS of each, RSS above the process's own baseline (interpreter,
libraries and tokenizer, read before the data work starts), and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import HH_FULL, HH_SAMPLE, REPO_ROOT, child_env, hh_pairs, run_child

sys.path.insert(0, str(REPO_ROOT))


MODEL = "smollm2-135m-instruct"
MAX_LENGTH = 512


def numbered(pair: dict[str, Any], number: int) -> dict[str, Any]:
    """`pair` with "(row N) " before its first user turn's text."""
    prompt = [dict(m) for m in pair["prompt"]]
    first = next(m for m in prompt if m["role"] == "user")
    first["content"] = f"(row {number}) {first['content']}"
    return {**pair, "prompt": prompt}


def write_rows(pairs: list[dict[str, Any]], count: int, path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for n in range(count):
            handle.write(json.dumps(numbered(pairs[n % len(pairs)], n)) + "\n")
    return path


# ----------------------------------------------------------------- children (one measurement each)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_split_mib() -> dict[str, float]:
    """This process's resident memory now, split as Linux reports it: anonymous (heap: what a
    process really holds) and file-backed (mapped files, e.g. Arrow tables; the page cache's,
    shared between processes mapping the same file)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) / 1024
    return {"rss_anon_mib": found.get("RssAnon", 0.0), "rss_file_mib": found.get("RssFile", 0.0)}


def child_ours(rows: Path, cache_dir: Path, num_proc: int) -> dict[str, Any]:
    import datasets

    from align_anything.families import zoo
    from align_anything.families.language import loading, pipeline
    from align_anything.families.language import token_cache as cache
    from align_anything.families.language.encode import Encoding

    tokenizer = loading.load_text_side(zoo.resolve_model_path(MODEL), trust_remote_code=False)[1]
    datasets.disable_progress_bars()  # as a run does; `datasets` imported before the baseline
    baseline = _rss_mib()
    start = time.perf_counter()
    spec = pipeline.Spec(
        train=(pipeline.Source(str(rows), "auto", {}),), eval=(), eval_fraction=0.0, seed=42,
        max_train=None, max_eval=None, task="dpo", kind="preference",
        encoding=Encoding("preference"), max_length=MAX_LENGTH, truncation="drop",
    )  # fmt: skip
    parts = cache.key_parts(spec, tokenizer=tokenizer, media=None)
    note = cache.ensure(spec, parts, root=cache_dir, tokenizer=tokenizer, media=None,
                        model_name=MODEL, num_proc=num_proc)  # fmt: skip
    prepared = cache.open_prepared(cache.folder_for(cache_dir, spec, parts), note=note)
    lengths = prepared.train.lengths()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "baseline_rss_mib": baseline, "rows": len(prepared.train),
            "tokens": int(lengths.sum()), "note": note, **_rss_split_mib()}  # fmt: skip


def child_trl(rows: Path, num_proc: int, workdir: Path) -> dict[str, Any]:
    from types import SimpleNamespace

    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from align_anything.families import zoo

    tokenizer = AutoTokenizer.from_pretrained(zoo.resolve_model_path(MODEL))
    datasets.disable_progress_bars()
    baseline = _rss_mib()
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(rows), split="train")
    args = DPOConfig(output_dir=str(workdir / "trl"), dataset_num_proc=num_proc,
                     max_length=MAX_LENGTH, report_to=[], bf16=False, use_cpu=True)  # fmt: skip
    # TRL's own preprocessing, without building a trainer (no model): `self` is read only for
    # its tokenizer (EOS for non-conversational rows).
    prepared = DPOTrainer._prepare_dataset(
        SimpleNamespace(_tokenizer=tokenizer), dataset, tokenizer, args, "train"
    )
    tokens = 0
    for batch in prepared.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).iter(1000):
        for column in batch.values():
            tokens += sum(len(ids) for ids in column)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "baseline_rss_mib": baseline, "rows": len(prepared),
            "tokens": tokens, **_rss_split_mib()}  # fmt: skip


# ----------------------------------------------------------------- the comparison


def measure(kind: str, rows: Path, *, cache_dir: Path, num_proc: int, workdir: Path) -> dict:
    out = workdir / f"{kind}-{rows.stem}-{time.monotonic_ns()}.json"
    env = child_env(None)
    # An empty `datasets` cache per measurement: no side reuses an earlier load or map.
    env["HF_DATASETS_CACHE"] = tempfile.mkdtemp(dir=workdir, prefix="hf-")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--rows", str(rows),
               "--cache-dir", str(cache_dir), "--num-proc", str(num_proc), "--out", str(out),
               "--workdir", str(workdir)]  # fmt: skip
    load = os.getloadavg()[0]
    peak = run_child(command, env=env, log=out.with_suffix(".log"))
    return {**json.loads(out.read_text()), "peak_rss_mib": peak, "load": load}


def table(results: dict[int, dict[str, dict]]) -> str:
    lines = [
        "| pairs | ours first (s) | ours cached (s) | TRL (s) | first / TRL | cached / TRL | "
        "peak RSS ours first / cached / TRL (MiB) | RSS above baseline ours / TRL (MiB) | "
        "anon + file RSS at the end, ours first / cached / TRL (MiB) | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size, r in sorted(results.items()):
        ours, hit, trl = r["ours"], r["cached"], r["trl"]
        above = [x["peak_rss_mib"] - x["baseline_rss_mib"] for x in (ours, trl)]
        loads = "/".join(f"{x['load']:.1f}" for x in (ours, hit, trl))
        split = " / ".join(
            f"{x.get('rss_anon_mib', 0):.0f}+{x.get('rss_file_mib', 0):.0f}"
            for x in (ours, hit, trl)
        )
        lines.append(
            f"| {size:,} | {ours['seconds']:.1f} | {hit['seconds']:.2f} | {trl['seconds']:.1f} | "
            f"{ours['seconds'] / trl['seconds']:.2f}x | {hit['seconds'] / trl['seconds']:.3f}x | "
            f"{ours['peak_rss_mib']:.0f} / {hit['peak_rss_mib']:.0f} / {trl['peak_rss_mib']:.0f} | "
            f"{above[0]:.0f} / {above[1]:.0f} | {split} | {loads} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--num-proc", type=int, default=2, help="data.num_proc = dataset_num_proc")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "ours":
            result = child_ours(args.rows, args.cache_dir, args.num_proc)
        else:
            result = child_trl(args.rows, args.num_proc, args.workdir)
        args.out.write_text(json.dumps(result))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="data_scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    pairs = hh_pairs(HH_FULL if HH_FULL.is_file() else HH_SAMPLE)
    print(f"{len(pairs)} HH-RLHF pairs, repeated with row numbers; num_proc {args.num_proc}, "
          f"max_length {MAX_LENGTH}, {os.cpu_count()} CPUs; work in {workdir}", flush=True)  # fmt: skip
    results: dict[int, dict[str, dict]] = {}
    for size in args.sizes:
        rows = write_rows(pairs, size, workdir / f"pairs-{size}.jsonl")
        cache_dir = workdir / f"cache-{size}"
        common = {"cache_dir": cache_dir, "num_proc": args.num_proc, "workdir": workdir}
        results[size] = {
            "trl": measure("trl", rows, **common),
            "ours": measure("ours", rows, **common),
            "cached": measure("ours", rows, **common),
        }
        r = results[size]
        assert r["cached"]["note"].startswith("cache hit"), r["cached"]["note"]
        print(f"{size:,} pairs: ours {r['ours']['seconds']:.1f} s ({r['ours']['rows']:,} rows "
              f"kept), cached {r['cached']['seconds']:.2f} s, TRL {r['trl']['seconds']:.1f} s "
              f"({r['trl']['rows']:,} rows)", flush=True)  # fmt: skip
    print(table(results))
    (workdir / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

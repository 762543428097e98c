"""A rank entry point for end-to-end tests: start `align_anything.train` in a fresh interpreter
whose PYTHONHASHSEED is this rank's entry of $ALIGN_ANYTHING_RANK_HASH_SEEDS (comma-separated,
indexed by LOCAL_RANK), then hand it the launcher's arguments unchanged.

Python randomises string hashing per process, so each rank of a real run iterates a set of
strings in its own order, and any code that issues collectives in a set's order runs them in
different orders on different ranks: a hang under ZeRO-3, but only in the runs where the random
seeds happen to disagree (issue #23: PPO's policy and critic stepped in opposite orders, about
one 2-rank run in two). Fixed, disagreeing seeds make such a bug show in every run.

Used as `launch(..., module="rank_hash_seeds", extra_env=rank_hash_seed_env())` (see
`test_ppo_runs.py`); the same process id continues (exec), so the launcher still tracks it.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "ALIGN_ANYTHING_RANK_HASH_SEEDS"


def main() -> None:
    seeds = os.environ[VARIABLE].split(",")
    seed = seeds[int(os.environ.get("LOCAL_RANK", "0")) % len(seeds)]
    env = {**os.environ, "PYTHONHASHSEED": seed}
    module = [sys.executable, "-u", "-m", "align_anything.train"]
    os.execve(sys.executable, [*module, *sys.argv[1:]], env)


if __name__ == "__main__":
    main()

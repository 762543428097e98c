"""Rewards, one room for every task that scores what a model makes:

- `functions`: reward functions named `module:function`, loaded by name
  (`load_reward_functions`), and scoring a batch with them (`score_completions`: weights,
  None, timeouts, one message naming the function, the row and the completion);
- `builtin`: the built-in functions, exported here (`align_anything.rewards:arith_exact`; for
  images `align_anything.rewards:shape_colour`);
- `remote`: a reward server over HTTP used as a reward function (`reward.remote`);
- `model`: a reward model trained by `task=rm`, frozen beside the policy (`reward.model`);
- `scoring`: scoring rows with a reward model folder (`python -m align_anything score`);
- `server`: a reward model behind the `reward.remote` protocol (`serve-reward`).
"""

from align_anything.rewards.builtin import (
    arith_exact,
    arith_format,
    length_penalty,
    shape_colour,
    shapes_answer,
    shapes_picture,
    tones_answer,
    tones_audio,
)

__all__ = [
    "arith_exact",
    "arith_format",
    "length_penalty",
    "shape_colour",
    "shapes_answer",
    "shapes_picture",
    "tones_answer",
    "tones_audio",
]

"""A reward model trained by `task=rm` as an online-RL reward: frozen, without gradients or
optimizer state, partitioned under ZeRO-3 like the DPO reference (`InferenceEngine`).

It scores text, re-tokenised with its own tokenizer and chat template: the prompt's messages
plus the decoded completion as the assistant turn, rendered as `task=rm` encoded its pairs (the
full conversation through the template, so the end-of-turn tokens are those it was trained on),
and read at the last real token as `forward.sequence_scores` reads it. When its tokenizer is the
policy's, this gives the ids the reward model saw in training for that text; when it differs (a
reward model of another family) it is the only correct way. The policy's own ids would miss the
template's closing tokens after EOS either way, which is why the text is always re-rendered.
"""

from __future__ import annotations

from typing import Any

import torch

from align_anything.backend import ds_config as dsc
from align_anything.backend.engine import InferenceEngine
from align_anything.backend.zero_init import model_init_context
from align_anything.errors import ConfigError
from align_anything.families import zoo
from align_anything.families.language import loading as model_loading
from align_anything.families.language.collate import pad_rows
from align_anything.families.language.encode import _template_ids
from align_anything.families.language.forward import sequence_scores
from align_anything.training.batching import to_device

# Sequences scored per forward pass.
CHUNK = 32


class RewardModel:
    """A `task=rm` model scoring (prompt, completion) text in a frozen inference engine."""

    def __init__(
        self, path: str, *, policy_tokenizer: Any, precision: str, model_init_config: dict[str, Any],
        ds_config: dict[str, Any], device: torch.device,
    ) -> None:  # fmt: skip
        """`path`: the reward model's folder (`reward.model`); `model_init_config`: the
        policy's DeepSpeed config (under ZeRO-3 the model loads partitioned); `ds_config`: the
        frozen engine's (`DeepSpeedPlan.reference_config`)."""
        self.path = zoo.resolve_model_path(path, key="reward.model")
        config = model_loading.load_config(self.path, key="reward.model")
        architectures = getattr(config, "architectures", None) or []
        if not any("SequenceClassification" in a or "Reward" in a for a in architectures):
            raise ConfigError(
                f"reward.model={path!r} is not a reward model (its config names "
                f"{', '.join(architectures) or 'no architecture'}): train one with task=rm and "
                "give its final/ folder, e.g. reward.model=outputs/rm/final"
            )
        self.tokenizer = model_loading.load_tokenizer(self.path)
        self.same_tokenizer = self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        with model_init_context(model_init_config):
            model = model_loading.load_model(
                self.path, reward=True, dtype=dsc.torch_dtype(precision)
            )
        self.engine = InferenceEngine(model, ds_config)
        self.device = device
        self._min_calls = 0

    def describe(self) -> str:
        where = "partitioned ZeRO-3 inference engine" if self.engine.stage == 3 else "frozen copy"
        vocab = "the policy's tokenizer" if self.same_tokenizer else "its own tokenizer"
        return (
            f"  reward model    {self.path}: {where}, prompt + completion re-rendered with "
            f"{vocab} and chat template"
        )

    def pad_calls_to(self, sequences: int) -> None:
        """The next `score` runs as many forward passes as `sequences` would need, even with
        fewer (under ZeRO-3 a forward is collective: every rank must run the same number)."""
        self._min_calls = -(-sequences // CHUNK)

    @torch.no_grad()
    def score(self, prompts: list[list[dict]], completions: list[str]) -> list[float]:
        """The reward model's score of each (prompt messages, completion text)."""
        sequences = [
            _template_ids(self.tokenizer, [*p, {"role": "assistant", "content": c}])
            for p, c in zip(prompts, completions, strict=True)
        ]
        calls = max(-(-len(sequences) // CHUNK), self._min_calls)
        self._min_calls = 0
        scores: list[float] = []
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else 0
        for call in range(calls):
            part = sequences[call * CHUNK : (call + 1) * CHUNK]
            real = bool(part)
            part = part or [[pad]]
            batch = to_device(pad_rows(part, part, pad), self.device)
            out = sequence_scores(self.engine, batch)
            if real:
                scores += out.tolist()
        return scores

"""Reward models of multimodal families: the family's base model (no LM head) plus a
one-output score read at the last real token.

A class is made per config class (`reward_model_class`) and registered with
`AutoModelForSequenceClassification`, so an exported reward model loads with `from_pretrained`
once `register_builtin_reward_classes()` (or `reward_model_class`) has run for its family.
"""

from __future__ import annotations

from typing import Any

import torch


def last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last attended position, for left or right padding ([B]); the
    highest attended position, not `mask.sum() - 1`, is what makes left padding work."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)


class RewardHeadMixin:
    """A multimodal base model (no LM head) and a one-output score at the last real token.

    Combined with a model family's PreTrainedModel class by `reward_model_class`, so weight
    init, attention implementations and checkpoint layout follow the family: a generation
    checkpoint's `model.*` weights load into `self.model`, its `lm_head` is unused and `score` is
    new. Registered with `AutoModelForSequenceClassification` (see `reward_model_class`).
    """

    def __init__(self, config: Any) -> None:
        from transformers import AutoModel

        super().__init__(config)
        self.model = AutoModel.from_config(config)
        self.score = torch.nn.Linear(config.get_text_config().hidden_size, 1, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **media: Any) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **media)[0]
        last = last_real_index(attention_mask)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return SequenceClassifierOutputWithPast(logits=self.score(picked))


_REWARD_CLASSES: dict[type, type] = {}


def reward_model_class(config_class: type) -> type:
    """The reward-model class for a multimodal config class (built once, registered with
    `AutoModelForSequenceClassification`)."""
    if config_class in _REWARD_CLASSES:
        return _REWARD_CLASSES[config_class]
    from transformers import AutoModel, AutoModelForSequenceClassification, PreTrainedModel

    base_model = AutoModel._model_mapping[config_class]
    family = next(c for c in base_model.__mro__[1:] if issubclass(c, PreTrainedModel))
    name = base_model.__name__.removesuffix("Model") + "ForRewardModel"
    cls = type(name, (RewardHeadMixin, family), {"config_class": config_class})
    AutoModelForSequenceClassification.register(config_class, cls, exist_ok=True)
    _REWARD_CLASSES[config_class] = cls
    return cls


def register_builtin_reward_classes() -> None:
    """Register the reward classes of the built-in multimodal families (LLaVA, Qwen2-Audio)."""
    from transformers import LlavaConfig, Qwen2AudioConfig

    for config_class in (LlavaConfig, Qwen2AudioConfig):
        reward_model_class(config_class)

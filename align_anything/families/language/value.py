"""The critic of PPO: a value at every token.

A reward model (`AutoModelForSequenceClassification` with one output, or for a multimodal
family `reward_head`'s class) already has what a critic needs: a backbone (`base_model`) and a
one-output linear `score` head. Its own forward applies the head at every position and keeps
only the last; `ValueModel` runs the same two parts and keeps every position, so V(prefix up to
t) = score(hidden_t), with no copy of transformers' code and no forward hook.

- `init="reward_model"` (the default in PKU's align-anything and OpenRLHF): the critic starts as
  the trained reward model, backbone and head.
- `init="policy"`: the backbone of the policy (a causal LM folder) with a new head; transformers'
  loader initialises a missing head like any new linear layer (normal, std =
  `initializer_range`, e.g. 0.02: small values at first), under ZeRO-3 too (it gathers the new
  parameters for their init). verl's critic starts the same way (`AutoModelForTokenClassification`
  from the actor's weights); OpenRLHF draws the head with std 1/(hidden + 1).

Either way the loaded model is a reward model, so the usual set-up applies to it unchanged
before it is wrapped: `models.prepare.prepare_for_training(scorer, ..., reward=True)` (activation
checkpointing, frozen parts, LoRA with the head trained fully), built under
`backend.zero_init.model_init_context` for ZeRO-3. The wrapper is a plain `nn.Module` that a
DeepSpeed engine trains like any model. Its export is the reward-model folder it wraps
(`scorer_state` strips the wrapper's prefix from a gathered state dict), which loads back with
`load_critic(folder, init="reward_model")` and also scores sequences as a reward model does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from align_anything.errors import ConfigError
from align_anything.families.language import lora
from align_anything.families.language.loading import load_config, load_model

CRITIC_INITS: tuple[str, ...] = ("reward_model", "policy")
# The attribute under which ValueModel holds the reward model (and so the prefix of its keys).
SCORER = "scorer"


def is_reward_config(config: Any) -> bool:
    """Whether a model config describes a reward model (a sequence-classification class, or one
    of `reward_head`'s classes)."""
    architectures = getattr(config, "architectures", None) or []
    return any("SequenceClassification" in a or "Reward" in a for a in architectures)


class ValueModel(torch.nn.Module):
    """Per-token values of a reward model's backbone and score head: `forward` returns [B, T],
    entry t the value of the sequence up to and including token t."""

    def __init__(self, scorer: torch.nn.Module) -> None:
        """`scorer`: a reward model (see the module docstring), possibly a PEFT model of one."""
        super().__init__()
        self.scorer = scorer
        backbone, head = self._parts()
        if not isinstance(head, torch.nn.Module) or backbone is None:
            raise ValueError(f"{type(scorer).__name__} has no backbone and `score` head")

    def _parts(self) -> tuple[Any, Any]:
        # PEFT injects its adapters into the wrapped model's modules (and wraps `score` in a
        # ModulesToSaveWrapper that calls the trained copy), so the same two parts carry them.
        model = self.scorer.get_base_model() if lora.is_peft_model(self.scorer) else self.scorer
        return getattr(model, "base_model", None), getattr(model, "score", None)

    @property
    def config(self) -> Any:
        return self.scorer.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        **inputs: Any,
    ) -> Tensor:
        """[B, T] values in the model's dtype. `attention_mask` may be the 2D padding mask or a
        4D one (the shared-prefix layouts, with `position_ids`); `inputs`: media inputs."""
        backbone, head = self._parts()
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **inputs
        )[0]
        return head(hidden).squeeze(-1)

    def exported(
        self, state: Mapping[str, Tensor] | None
    ) -> tuple[torch.nn.Module, dict[str, Tensor] | None]:
        """What an export writes for this critic, from an engine's gathered state dict: the
        wrapped reward model (a PEFT model: its adapter) and its own state dict."""
        return self.scorer, self.scorer_state(state)

    @staticmethod
    def scorer_state(state: Mapping[str, Tensor] | None) -> dict[str, Tensor] | None:
        """A gathered state dict of the ValueModel (an engine's `full_state_dict()`; None on
        ranks other than 0) as the wrapped reward model's own, for `save_pretrained` or
        `lora.save_adapter` on `value_model.scorer`."""
        if state is None:
            return None
        prefix = SCORER + "."
        return {k.removeprefix(prefix): v for k, v in state.items()}


def load_critic(
    path: str, *, init: str, dtype: Any, key: str = "ppo.critic_model",
    attn_implementation: str | None = None, trust_remote_code: bool = False,
) -> Any:  # fmt: skip
    """The critic's reward model, weights loaded (call inside `model_init_context` for ZeRO-3):
    a `task=rm` folder for `init="reward_model"`, the policy's causal LM for `init="policy"`
    (a new head). Prepare it for training, then wrap it: `ValueModel(prepared)`.

    Raises ConfigError (naming `key`) when the folder is not of the kind `init` says: a causal
    LM given as the reward model would get an untrained head silently, and a reward model given
    as the policy would keep its trained head."""
    check_critic_folder(path, init=init, key=key, trust_remote_code=trust_remote_code)
    return load_model(
        path, reward=True, dtype=dtype, trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )  # fmt: skip


def check_critic_folder(
    path: str, *, init: str, key: str = "ppo.critic_model", trust_remote_code: bool = False
) -> None:
    """ConfigError (naming `key`) unless `path` is of the kind `init` says (a reward model for
    "reward_model", a causal LM for "policy"); reads only the config, so a run can check it
    before any data or weights."""
    if init not in CRITIC_INITS:
        raise ConfigError(f"critic init must be one of {', '.join(CRITIC_INITS)}, got {init!r}")
    config = load_config(path, trust_remote_code=trust_remote_code, key=key)
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architecture"
    if init == "reward_model" and not is_reward_config(config):
        raise ConfigError(
            f"{key}={path!r} is not a reward model ({architectures}), and the critic is "
            "initialised from one: give the final/ folder of a task=rm run, or initialise the "
            "critic from the policy with a new value head (ppo.critic_init=policy)"
        )
    if init == "policy" and is_reward_config(config):
        raise ConfigError(
            f"{key}={path!r} is a reward model ({architectures}), but ppo.critic_init=policy "
            "starts a new value head on a language model: set ppo.critic_init=reward_model to "
            "start from this reward model, or name the policy's folder"
        )

"""The config sections PPO and remote rewards need (align_anything/config_sections.py): `PPOSection`
(validated on its own until `task=ppo` is wired) and `reward.remote` (in grpo / rloo today)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from align_anything import losses
from align_anything.config import load_config
from align_anything.config import sections as config_module
from align_anything.config.sections import PPOSection
from align_anything.errors import ConfigError
from align_anything.families.language import value

# The `ppo:` block proposed for configs/task/ppo.yaml (the values the lead's file would give).
PPO_DEFAULTS = {
    "advantage_estimator": "gae",
    "num_generations": 4,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_completion_length": 12,
    "mask_truncated_completions": False,
    "num_ppo_epochs": 1,
    "num_mini_batches": 1,
    "epsilon": 0.2,
    "epsilon_high": None,
    "dual_clip": None,
    "value_clip": 0.2,
    "kl_coef": 0.05,
    "reward_clip": 10.0,
    "gamma": 1.0,
    "lam": 0.95,
    "critic_init": "reward_model",
    "critic_model": None,
    "critic_learning_rate": 9.0e-6,
    "critic_lr_scheduler": "constant",
    "critic_warmup_ratio": 0.0,
    "critic_warmup_steps": 0,
    "ptx_coef": 0.0,
    "ptx_data": None,
    "eval_samples": 64,
    "generation_batch_size": 64,
}


def ppo(**changes) -> PPOSection:
    return PPOSection.model_validate({**PPO_DEFAULTS, **changes})


def test_the_names_match_the_layers_that_use_them() -> None:
    # config sits below losses and models, so it keeps its own copies of these names.
    assert config_module.ADVANTAGE_ESTIMATORS == losses.ADVANTAGE_ESTIMATORS
    assert config_module.CRITIC_INITS == value.CRITIC_INITS
    fields = PPOSection.model_fields
    assert fields["advantage_estimator"].annotation.__args__ == losses.ADVANTAGE_ESTIMATORS
    assert fields["critic_init"].annotation.__args__ == value.CRITIC_INITS


def test_the_proposed_defaults_validate() -> None:
    section = ppo()
    assert section.clip_range() == (0.2, 0.2) and section.trains_critic()
    assert ppo(epsilon_high=0.28).clip_range() == (0.2, 0.28)
    assert not ppo(advantage_estimator="reinforce_plus_plus").trains_critic()


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"advantage_estimator": "reinforce_plus_plus_baseline", "num_generations": 1},
         "needs ppo.num_generations >= 2 (got 1)"),
        ({"advantage_estimator": "reinforce_plus_plus", "critic_model": "outputs/rm/final"},
         "ppo.critic_model is set but ppo.advantage_estimator=reinforce_plus_plus trains no critic"),
        ({"advantage_estimator": "reinforce_plus_plus_baseline", "critic_warmup_steps": 3},
         "ppo.critic_warmup_steps=3 but"),
        ({"ptx_coef": 0.5}, "ppo.ptx_coef > 0 needs ppo.ptx_data"),
        ({"ptx_data": "arith-sft"}, "ppo.ptx_data needs ppo.ptx_coef > 0"),
        ({"dual_clip": 1.0}, "greater than 1"),
        ({"advantage_estimator": "reinforce"}, "advantage_estimator"),
        ({"lam": 1.5}, "less than or equal to 1"),
        ({"num_ppo_epochs": 0}, "greater than or equal to 1"),
        ({"value_clip": 0.0}, "greater than 0"),
        ({"critic_init": "sft"}, "critic_init"),
    ],
)  # fmt: skip
def test_bad_ppo_settings_are_refused(changes: dict, fragment: str) -> None:
    with pytest.raises(ValidationError) as err:
        ppo(**changes)
    assert fragment in str(err.value)


def test_where_the_critic_starts() -> None:
    section = ppo()
    assert section.critic_path(policy="pol", reward_model="rm") == "rm"
    assert ppo(critic_model="crit").critic_path(policy="pol", reward_model="rm") == "crit"
    assert ppo(critic_init="policy").critic_path(policy="pol", reward_model="rm") == "pol"
    with pytest.raises(ConfigError, match="reward.model is null"):
        section.critic_path(policy="pol", reward_model=None)


# --------------------------------------------------------------------------- reward.remote


def test_remote_urls_are_rewards_with_weights() -> None:
    cfg = load_config(["task=grpo", "reward.remote.urls=[http://127.0.0.1:8000/score,http://h/s]",
                       "reward.weights=[1.0,0.5,0.25]"])  # fmt: skip
    assert cfg.reward.count() == 3 and cfg.reward.weight_list() == [1.0, 0.5, 0.25]
    assert load_config(["task=rloo"]).reward.remote.urls == []
    # One URL without brackets; a remote reward alone is a reward.
    only = load_config(["task=grpo", "reward.functions=[]", "reward.remote.urls=http://h:1/s"])
    assert only.reward.remote.urls == ["http://h:1/s"] and only.reward.weight_list() == [1.0]
    with pytest.raises(ConfigError, match=r"1 function\(s\) and 1 remote URL\(s\) and a reward "
                                          r"model\): give one weight per reward"):  # fmt: skip
        load_config(["task=grpo", "reward.remote.urls=[http://h/s]", "reward.model=x",
                     "reward.weights=[1.0]"])  # fmt: skip


def test_remote_settings_errors_never_repeat_a_secret() -> None:
    with pytest.raises(ConfigError) as err:
        load_config([
            "task=grpo", "reward.remote.urls=[http://h/s,http://me:pa55@h/s,ftp://h/s]",
            "reward.remote.headers_env=sk-live-123", "reward.remote.timeout_s=0",
            "reward.remote.retries=-1",
        ])  # fmt: skip
    message = str(err.value)
    assert "reward.remote.urls: entry 1 carries credentials" in message
    assert "reward.remote.headers_env: not an environment variable name" in message
    assert "reward.remote.timeout_s: Input should be greater than 0 (given: 0)" in message
    assert "reward.remote.retries" in message
    assert "pa55" not in message and "sk-live-123" not in message
    with pytest.raises(ConfigError, match="entry 0 is not an http"):
        load_config(["task=grpo", "reward.remote.urls=[ftp://h/s]"])

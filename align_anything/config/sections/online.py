"""The sections of the tasks that generate: the rollout backend and its vLLM engine
(`rollout`), and the online RL tasks `grpo`, `rloo` and `ppo` (generation, the clipped ratio,
PPO's critic and its consistency checks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from align_anything.config.sections.base import _Section
from align_anything.errors import ConfigError


class VLLMSection(_Section):
    """The vLLM engine of `rollout.backend=vllm` (`align_anything.generation.vllm`)."""

    mode: Literal["colocate", "server"] = Field(
        description="colocate: the engine lives in each training process and gets the new weights in memory after every optimizer step (the environment needs vLLM: `make vllm`); server: a separate `python -m align_anything serve-rollout MODEL --port N` (any environment, e.g. .venv-vllm) gets the weights and prompts over HTTP.",
    )
    server_url: str = Field(
        description="mode=server: the serve-rollout server, http://HOST:PORT (the same model architecture as model.name_or_path).",
    )
    server_timeout_s: float = Field(
        gt=0,
        description="mode=server: seconds to wait for one answer (a weight upload or a generation round; on a CPU a round takes minutes).",
    )
    kv_cache_gib: float | None = Field(
        gt=0,
        description="Memory of the engine's KV cache in GiB (on a CPU always set: vLLM reserves it up front); null: gpu_memory_utilization decides (GPU).",
    )
    gpu_memory_utilization: float = Field(
        gt=0.0,
        le=1.0,
        description="mode=colocate on a GPU with kv_cache_gib null: the share of device memory the engine may take (TRL's vllm_gpu_memory_utilization).",
    )
    enforce_eager: bool = Field(
        description="No CUDA graphs / torch.compile in the engine (starts faster; on a CPU vLLM runs eagerly anyway)."
    )

    @field_validator("server_url")
    @classmethod
    def _host_and_port(cls, url: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "the URL carries credentials (user:password@), which the saved config would "
                "keep: remove them"
            )
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(
                "not http://HOST:PORT (the port serve-rollout listens on), e.g. "
                "http://127.0.0.1:8000"
            )
        return url

    sleep: bool = Field(
        description="mode=colocate: put the engine to sleep (its KV cache freed) while the trainer computes, and wake it for each round, where the platform supports it (GPUs; not CPUs, where this is a no-op the start-up summary names).",
    )


class RolloutSection(_Section):
    """Online RL: which engine generates the completions. The loss always uses log-probs the
    trainer recomputes; the engine's own are compared with them every step."""

    backend: Literal["hf", "vllm"] = Field(
        description="hf: `generate` on the policy itself (needs nothing extra); vllm: a vLLM engine (rollout.vllm), colocated or a server.",
    )
    vllm: VLLMSection = Field(description="The vLLM engine (rollout.backend=vllm).")
    importance_sampling: bool = Field(
        description="rollout.backend=vllm: weigh each token's loss (GRPO, PPO; each completion's for RLOO) by min(pi_trainer / pi_engine, importance_sampling_cap), the truncated importance-sampling correction of the engine/trainer mismatch (TRL's vllm_importance_sampling_correction with token_truncate, verl's rollout_is).",
    )
    importance_sampling_cap: float = Field(
        ge=1.0,
        description="Upper bound C of the importance weight (TRL's vllm_importance_sampling_clip_max).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutSection:
        if self.importance_sampling and self.backend != "vllm":
            raise ValueError(
                "rollout.importance_sampling=true corrects the mismatch between an inference "
                "engine's log-probs and the trainer's, but rollout.backend=hf samples from the "
                "trained weights themselves: set rollout.backend=vllm, or importance_sampling=false"
            )
        return self


class _OnlineRL(_Section):
    """What GRPO and RLOO share: generation and the clipped ratio (TRL's names)."""

    num_generations: int = Field(
        ge=2,
        description="G: completions sampled per prompt (a group). The global batch counts completions, so it holds global_batch / G prompts; each rank's micro x grad_accum must be a multiple of G (a group stays on one rank). TRL's num_generations.",
    )
    temperature: float = Field(gt=0.0, description="Sampling temperature.")
    top_p: float = Field(
        gt=0.0,
        le=1.0,
        description="Nucleus sampling: the smallest token set with this probability mass.",
    )
    top_k: int = Field(
        ge=0,
        description="Sample among the k most likely tokens only (applied before top_p, as both backends do); 0: no cut (TRL's top_k).",
    )
    max_completion_length: int = Field(
        ge=1,
        description="Token limit of a completion (generation stops there or at EOS); TRL's max_completion_length (the issue's max_new_tokens).",
    )
    mask_truncated_completions: bool = Field(
        description="Leave completions that hit max_completion_length without EOS out of the loss (they are still counted and logged).",
    )
    num_iterations: int = Field(
        ge=1,
        description="mu: optimizer steps per generation batch; > 1 reuses it, with the log-probs at generation time as the old policy's.",
    )
    beta: float = Field(ge=0.0, description="KL coefficient; 0 loads no reference model.")
    epsilon: float = Field(
        ge=0.0, lt=1.0, description="Lower clip of the probability ratio: 1 - epsilon."
    )
    epsilon_high: float | None = Field(
        ge=0.0, description="Upper clip: 1 + epsilon_high (DAPO recommends 0.28); null: = epsilon."
    )
    eval_samples: int = Field(
        ge=0,
        description="Held-out prompts answered greedily before and after training: mean reward (eval/reward) and, for built-in data, the generation check. 0: none.",
    )
    generation_batch_size: int = Field(
        ge=1, description="Sequences generated at once (a generation round runs in chunks of this)."
    )

    def clip_range(self) -> tuple[float, float]:
        return self.epsilon, self.epsilon if self.epsilon_high is None else self.epsilon_high

    def round_steps(self) -> tuple[int, int]:
        """(passes over each generation round, mini-batches a round splits into): μ passes
        over one global batch."""
        return self.num_iterations, 1

    def uses_reference(self) -> bool:
        """Whether the run holds a frozen reference model (its KL term)."""
        return self.beta > 0


class GRPOSection(_OnlineRL):
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        description="grpo: token mean per completion, then mean over completions; dr_grpo: token sum / max_completion_length, mean over completions; dapo: token mean over the whole global batch (TRL's default).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        description="Advantage = reward - group mean, divided by the group's std (group), the whole batch's (batch) or nothing (none; Dr. GRPO).",
    )


class RLOOSection(_OnlineRL):
    normalize_advantages: bool = Field(
        description="Standardise the leave-one-out advantages over the global batch (TRL's normalize_advantages)."
    )


# `ppo.advantage_estimator` values (config sits below losses in the layers, so it keeps its own
# copy of `losses.ADVANTAGE_ESTIMATORS`; tests/test_ppo_config.py keeps the two equal).
ADVANTAGE_ESTIMATORS: tuple[str, ...] = (
    "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
)  # fmt: skip
CRITIC_INITS: tuple[str, ...] = ("reward_model", "policy")


class PPOSection(_Section):
    """PPO with a critic (and, by `advantage_estimator`, the critic-free REINFORCE++): each
    rollout samples completions, scores them, and trains on them for several epochs in
    mini-batches. The actor's optimizer and schedule are `train.*`'s; the critic has its own."""

    advantage_estimator: Literal["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        Field(
            description="gae: PPO with a critic (values per token, GAE); reinforce_plus_plus: no critic, the discounted return normalised over the global batch (OpenRLHF's reinforce); reinforce_plus_plus_baseline: the same after subtracting each prompt's mean score (OpenRLHF's reinforce_baseline; needs num_generations >= 2).",
        )
    )
    num_generations: int = Field(
        ge=1,
        description="Completions sampled per prompt (OpenRLHF's n_samples_per_prompt; 1 is usual with a critic). The global batch counts completions; a prompt's completions stay on one rank.",
    )
    temperature: float = Field(gt=0.0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(
        gt=0.0, le=1.0, description="Nucleus sampling of the rollouts (1: no cut)."
    )
    top_k: int = Field(
        default=0,
        ge=0,
        description="Sample among the k most likely tokens only (applied before top_p, as both backends do); 0: no cut.",
    )
    max_completion_length: int = Field(
        ge=1, description="Token limit of a completion (generation stops there or at EOS)."
    )
    mask_truncated_completions: bool = Field(
        description="Leave completions that hit max_completion_length without EOS out of the actor's and critic's losses (they are still counted and logged).",
    )
    num_ppo_epochs: int = Field(
        ge=1, description="Passes over each rollout (TRL's num_ppo_epochs, OpenRLHF's max_epochs)."
    )
    num_mini_batches: int = Field(
        ge=1,
        description="A rollout is num_mini_batches global batches; each optimizer step takes one, so a rollout gives num_ppo_epochs x num_mini_batches steps and all but the first are off-policy (TRL's num_mini_batches).",
    )
    epsilon: float = Field(
        ge=0.0,
        lt=1.0,
        description="Clip of the probability ratio: 1 - epsilon (TRL's cliprange, OpenRLHF's eps_clip).",
    )
    epsilon_high: float | None = Field(
        ge=0.0, description="Upper clip: 1 + epsilon_high; null: = epsilon."
    )
    dual_clip: float | None = Field(
        gt=1.0,
        description="Dual-clip PPO's bound c (> 1) on the loss of negative advantages, -c·A (OpenRLHF's dual_clip, verl's clip_ratio_c); null: none.",
    )
    value_clip: float | None = Field(
        gt=0.0,
        description="Clip of the critic's update around its rollout values, in the clipped value loss (TRL's cliprange_value, OpenRLHF's value_clip); null: plain squared error.",
    )
    kl_coef: float = Field(
        ge=0.0,
        description="Weight of the per-token KL penalty log pi_old - log pi_ref in the reward (TRL's kl_coef, OpenRLHF's init_kl_coef); 0 loads no reference model.",
    )
    reward_clip: float | None = Field(
        gt=0.0,
        description="Clip each completion's score to [-reward_clip, reward_clip] before it enters the reward (OpenRLHF's reward_clip_range); null: none.",
    )
    gamma: float = Field(
        ge=0.0, le=1.0, description="Discount per token (GAE and REINFORCE++ returns)."
    )
    lam: float = Field(ge=0.0, le=1.0, description="GAE's lambda (TRL's lam, OpenRLHF's lambd).")
    critic_init: Literal["reward_model", "policy"] = Field(
        description="reward_model: the critic starts as the reward model (backbone and score head); policy: the policy's backbone with a new value head.",
    )
    critic_model: str | None = Field(
        description="The folder the critic starts from; null: reward.model for critic_init=reward_model, model.name_or_path for critic_init=policy.",
    )
    critic_learning_rate: float = Field(
        gt=0, description="The critic's peak learning rate (AdamW)."
    )
    critic_lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        description="The critic's learning-rate schedule after warm-up."
    )
    critic_warmup_ratio: float = Field(
        ge=0.0, lt=1.0, description="Share of the steps spent warming the critic's rate up from 0."
    )
    critic_warmup_steps: int = Field(
        ge=0,
        description="The first N optimizer steps train the critic only (the actor's update is skipped; OpenRLHF's freezing_actor_steps).",
    )
    ptx_coef: float = Field(
        ge=0.0,
        description="Weight of an SFT loss on ptx_data added to the actor's loss (InstructGPT's PPO-ptx); 0: none.",
    )
    ptx_data: str | None = Field(
        description="Conversations for the ptx loss (a file, folder, built-in or hub name, as data.path takes); null: none.",
    )
    eval_samples: int = Field(
        ge=0,
        description="Held-out prompts answered greedily before and after training: mean reward (eval/reward) and, for built-in data, the generation check. 0: none.",
    )
    generation_batch_size: int = Field(
        ge=1, description="Sequences generated at once (a rollout runs in chunks of this)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> PPOSection:
        problems = []
        critic = self.advantage_estimator == "gae"
        if self.advantage_estimator == "reinforce_plus_plus_baseline" and self.num_generations < 2:
            problems.append(
                "ppo.advantage_estimator=reinforce_plus_plus_baseline subtracts each prompt's mean "
                f"score, which needs ppo.num_generations >= 2 (got {self.num_generations})"
            )
        if not critic and self.critic_model is not None:
            problems.append(
                f"ppo.critic_model is set but ppo.advantage_estimator={self.advantage_estimator} "
                "trains no critic: remove it, or use advantage_estimator=gae"
            )
        if not critic and self.critic_warmup_steps:
            problems.append(
                f"ppo.critic_warmup_steps={self.critic_warmup_steps} but "
                f"ppo.advantage_estimator={self.advantage_estimator} trains no critic: set it to 0"
            )
        if (self.ptx_coef > 0) != (self.ptx_data is not None):
            problems.append(
                "ppo.ptx_coef > 0 needs ppo.ptx_data (conversations for the SFT term), and "
                f"ppo.ptx_data needs ppo.ptx_coef > 0 (got ptx_coef={self.ptx_coef}, "
                f"ptx_data={self.ptx_data!r})"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def clip_range(self) -> tuple[float, float]:
        return self.epsilon, self.epsilon if self.epsilon_high is None else self.epsilon_high

    def round_steps(self) -> tuple[int, int]:
        """(passes over each rollout, mini-batches, i.e. optimizer steps, per pass)."""
        return self.num_ppo_epochs, self.num_mini_batches

    def uses_reference(self) -> bool:
        """Whether the run holds a frozen reference model (the KL penalty in the reward)."""
        return self.kl_coef > 0

    def trains_critic(self) -> bool:
        """Whether the run has a critic (advantage_estimator=gae)."""
        return self.advantage_estimator == "gae"

    def critic_path(self, *, policy: str, reward_model: str | None) -> str:
        """The folder the critic starts from (`critic_model`, else by `critic_init`); a
        ConfigError when critic_init=reward_model names none."""
        if self.critic_model is not None:
            return self.critic_model
        if self.critic_init == "policy":
            return policy
        if reward_model is None:
            raise ConfigError(
                "ppo.critic_init=reward_model starts the critic from the reward model, but "
                "reward.model is null: set reward.model (a task=rm final/ folder) or "
                "ppo.critic_model, or use ppo.critic_init=policy"
            )
        return reward_model

"""The `reward` section of the online RL tasks: what scores a completion (reward functions,
reward servers over HTTP, a reward model) and how the rewards are weighted."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from align_anything.config.sections.base import _Section, names_a_missing_folder

# An environment variable's name (POSIX shells accept these).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RemoteRewardSection(_Section):
    """Reward servers over HTTP (`align_anything.rewards.remote`; `python -m align_anything
    serve-reward` serves a task=rm model this way)."""

    urls: list[str] = Field(
        description="Reward servers, each one reward (weighted in reward.weights after the functions, before the reward model), scoring every completion: a POST of JSON lists `prompts`, `completions` and one per data field (an entry per completion), answered with `{rewards: [float or null, ...]}`. []: none. Tokens belong in headers_env, not in the URL.",
    )
    timeout_s: float = Field(
        gt=0,
        description="Deadline in seconds for a server's whole answer, from connecting to its last byte (a server that trickles its answer is cut off there); past it the request is retried.",
    )
    retries: int = Field(
        ge=0,
        description="Further attempts after a connection error, a timeout or HTTP 408/429/5xx (other failures are not retried).",
    )
    backoff_s: float = Field(
        ge=0, description="Wait before the first retry; each further retry waits twice as long."
    )
    max_rows_per_request: int = Field(
        ge=1,
        description="Completions per request; a rank's completions go in requests of at most this many.",
    )
    headers_env: str | None = Field(
        description="Name of an environment variable holding a bearer token, or a JSON object of request headers (never shown or logged); null: no headers.",
    )

    @field_validator("urls", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        from urllib.parse import urlsplit

        for index, url in enumerate(urls):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"entry {index} is not an http(s) URL such as http://host:8000/score"
                )
            if parts.username is not None or parts.password is not None:
                raise ValueError(
                    f"entry {index} carries credentials (user:password@), which the saved config "
                    "would keep: put them in the environment variable reward.remote.headers_env "
                    "names"
                )
        return urls

    @field_validator("headers_env")
    @classmethod
    def _env_name(cls, name: str | None) -> str | None:
        if name is not None and not _ENV_NAME.fullmatch(name):
            raise ValueError(
                "not an environment variable name: give the variable's NAME (e.g. RM_TOKEN), "
                "never the token itself"
            )
        return name


class RewardSection(_Section):
    """Online RL: what scores a completion. Functions, reward servers and a reward model add up,
    weighted."""

    functions: list[str] = Field(
        description="Reward functions as `module:function` (`align_anything.rewards:arith_exact`); each gets (prompts, completions, **row fields) and returns one float or None (no opinion) per completion.",
    )
    weights: list[float] | None = Field(
        description="One weight per reward (the functions in order, then the remote URLs, then the reward model); null: all 1.0. TRL's reward_weights.",
    )
    model: str | None = Field(
        description="A reward model trained by task=rm (e.g. `outputs/rm/final`), run frozen (ZeRO-3: partitioned); it re-tokenises prompt + completion with its own tokenizer and chat template. null: none.",
    )
    timeout_seconds: float = Field(
        gt=0,
        description="Longest one call of a reward function (one step's completions on a rank) may take; past it the call is interrupted and the run stops with exit status 2, naming the function and the rows.",
    )
    remote: RemoteRewardSection = Field(description="Reward servers over HTTP.")

    @field_validator("functions", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("weights")
    @classmethod
    def _finite_weights(cls, value: list[float] | None) -> list[float] | None:
        # NaN or inf times any reward is NaN or inf: every advantage would be NaN or 0.
        bad = [w for w in value or [] if not math.isfinite(w)]
        if bad:
            raise ValueError(f"weights must be finite numbers, got {', '.join(map(str, bad))}")
        return value

    @field_validator("model")
    @classmethod
    def _model_folder_exists(cls, value: str | None) -> str | None:
        if value is not None and names_a_missing_folder(value):
            raise ValueError(
                "no such folder: give the final/ folder of a task=rm run (e.g. "
                "reward.model=outputs/rm/final)"
            )
        return value

    def count(self) -> int:
        """How many rewards: the functions, the remote URLs and the reward model."""
        return len(self.functions) + len(self.remote.urls) + (self.model is not None)

    @model_validator(mode="after")
    def _one_weight_each(self) -> RewardSection:
        count = self.count()
        if count == 0:
            raise ValueError(
                "reward: no reward: list reward.functions (e.g. [align_anything.rewards:arith_exact]), "
                "reward.remote.urls or set reward.model to a reward model folder"
            )
        if self.weights is not None and len(self.weights) != count:
            kinds = [f"{len(self.functions)} function(s)"]
            if self.remote.urls:
                kinds.append(f"{len(self.remote.urls)} remote URL(s)")
            if self.model:
                kinds.append("a reward model")
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries but there are {count} rewards "
                f"({' and '.join(kinds)}): give one weight per reward, functions first, then "
                "remote URLs, then the reward model, or null for all 1.0"
            )
        return self

    def weight_list(self) -> list[float]:
        """One weight per reward: the functions, the remote URLs, then the reward model."""
        return [1.0] * self.count() if self.weights is None else list(self.weights)

"""The `model` section: which model, which of its parts train, LoRA, the attention kernel."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from align_anything.config.sections.base import _Section


class LoraSection(_Section):
    """Low-rank adapters (PEFT LoRA) instead of full fine-tuning."""

    enabled: bool = Field(description="Train LoRA adapters; the base weights stay frozen.")
    r: int = Field(ge=1, description="Adapter rank.")
    alpha: float = Field(gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["all-linear", "default"] = Field(
        description="Module names to adapt, e.g. `[q_proj,v_proj]` (one name needs no brackets); `all-linear`: every linear layer of the language model except the output head; `default`: the model's usual targets (a language model's all-linear, a text-to-image denoiser's attention projections).",
    )
    save_merged: bool = Field(
        description="Also write output_dir/final-merged: the adapter merged into the model."
    )

    def adapters(self) -> dict[str, Any] | None:
        """`lora.add_adapters`' settings (r, alpha, dropout, target_modules), or None when off."""
        if not self.enabled:
            return None
        return dict(
            r=self.r, alpha=self.alpha, dropout=self.dropout, target_modules=self.target_modules
        )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        # `target_modules=q_proj` means the one module a user would expect, not an error.
        if isinstance(value, str):
            return value if value in ("all-linear", "default") else [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ValueError(
            "expected module names as a list, e.g. [q_proj,v_proj], or 'all-linear' or 'default'"
        )


ModelPart = Literal["vision_tower", "audio_tower", "projector", "language_model"]


class ModelConfig(_Section):
    name_or_path: str = Field(
        description="A hub name, a local folder, or a built-in name (`smollm2-135m-instruct`, `tiny-random-llama`, ...).",
    )
    trust_remote_code: bool = Field(
        description="Run the model repository's own Python code (off unless you trust its source).",
    )
    freeze: list[ModelPart] = Field(
        description="Parts whose weights stay fixed: any of `vision_tower`, `audio_tower`, `projector`, `language_model` (multimodal models).",
    )
    lora: LoraSection = Field(description="Train low-rank adapters instead of all weights.")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = (
        Field(
            description="Attention kernel: `auto` (what transformers picks: sdpa where the model supports it, else eager), `sdpa`, `eager`, `flash_attention_2` (needs the flash-attn package and a CUDA GPU, bf16/fp16) or `flex_attention` (GPU: no backward pass on CPU). An unavailable kernel is an error before any weights load; the shared-prefix layouts (`speed.share_prefix`) need sdpa or eager and fall back to plain rows otherwise, saying so; `sft.packing` runs on all five.",
        )
    )

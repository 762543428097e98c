"""The language-model family: transformers causal LMs, and their image-text and audio-text
variants (LLaVA, Qwen2-Audio, ...), as one room.

- loading: `loading` (config, tokenizer, processor, the model class of a task), `reward_head`
  (multimodal reward models), `value` (PPO's critic), `parts` (freezing by part), `prepare`
  (frozen parts, LoRA, activation checkpointing, in order), `lora`, `tied_embeddings`, `sizes`
  (parameter counts from a config, for the memory planner), `builtin` (the built-in models);
- data encoding: records through the chat template into token rows (`encode`; `prompts` for
  online RL), media through the processor (`multimodal`), the run's rows in Arrow
  (`pipeline`) and their on-disk cache (`token_cache`, read through `rows`), the batch layouts
  (`batches`: `Rows`, `Packed`, `SharedPrefix`) and what makes them (`collate`, `layouts`,
  `packing`);
- the forward pass and log-probabilities (`forward`), the frozen reference (`reference`), the
  held-out generation check (`evaluation`);
- the family's set-up and export steps (`family.LANGUAGE_MODELS`).

The batch layouts and collate functions are exported here."""

from align_anything.families.language.batches import Layout, Packed, Rows, SharedPrefix
from align_anything.families.language.collate import (
    collate_margins,
    collate_preference,
    collate_sft,
    collate_unpaired,
    pad_rows,
)
from align_anything.families.language.encode import IGNORE_INDEX, TRUNCATION_MODES

__all__ = [
    "IGNORE_INDEX",
    "TRUNCATION_MODES",
    "Layout",
    "Packed",
    "Rows",
    "SharedPrefix",
    "collate_margins",
    "collate_preference",
    "collate_sft",
    "collate_unpaired",
    "pad_rows",
]

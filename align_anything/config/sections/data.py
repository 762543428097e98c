"""The `data` section: where the rows come from (one source or a weighted mixture), how they map
to records, and how they are cut to fit `max_length`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from align_anything.config.sections.base import _Section

DataFormat = Literal[
    "auto",
    "conversation",
    "prompt_response",
    "preference",
    "hh",
    "unpaired",
    "prompt",
    "ranked_pair",
]
# The keys a `data.path` / `data.eval_path` list entry may leave out (they inherit or take all rows).
SOURCE_OPTIONAL = ("format", "columns", "weight", "rows")


class DataSource(_Section):
    """One source of a mixture (an entry of a `data.path` or `data.eval_path` list)."""

    path: str = Field(description="A file, folder, built-in name or hub dataset, as `data.path`.")
    format: DataFormat | None = Field(description="This source's format (null: `data.format`).")
    columns: dict[str, str] | None = Field(
        description="This source's column mapping (null: `data.columns`)."
    )
    weight: float | None = Field(
        gt=0,
        description="Share of the mixture relative to the other weighted sources' (the mix is as large as the scarcest weighted source allows without repeating rows).",
    )
    rows: int | None = Field(
        ge=1,
        description="Take this many rows (drawn by `train.seed`; beyond the source's size, its rows repeat).",
    )

    @model_validator(mode="before")
    @classmethod
    def _optional_keys(cls, value: Any) -> Any:
        # An entry names what it changes; the rest inherits (null), so no key needs writing out.
        if isinstance(value, dict):
            return {**{key: None for key in SOURCE_OPTIONAL}, **value}
        return value

    @model_validator(mode="after")
    def _one_amount(self) -> DataSource:
        if self.weight is not None and self.rows is not None:
            raise ValueError("give a source a weight or a row count, not both")
        return self


class DataConfig(_Section):
    path: str | list[DataSource] = Field(
        description="Training data: a local .json/.jsonl/.jsonl.gz/.parquet/.csv file or folder, a built-in name (`arith-sft`, `arith-pref`, `arith-pref-eval`, `arith-kto`, `arith-prompts`, `arith-prompts-eval`; for image-text models `shapes-vqa`, `shapes-vqa-pref`, `shapes-vqa-prompts` and their `-eval` sets; for audio-text models `tones-qa`, `tones-qa-pref`, `tones-qa-prompts` and their `-eval` sets) or a hub dataset; or a list of sources to mix, each `{path, format, columns, weight | rows}` (e.g. `[{path: a.jsonl, weight: 3}, {path: b.jsonl, weight: 1}]`).",
    )
    format: DataFormat = Field(
        description="How rows map to records; `auto` recognises conversations, prompt/response, preference pairs, HH-RLHF transcripts, unpaired rows (prompt, completion, label), prompts alone (online RL) and align-anything's ranked pairs (`response_1`, `response_2`, `overall_response`: `ranked_pair`). Its column names also serve: `question` for a missing `prompt`, `image` for `images`, `audio_path` for `audio`.",
    )
    columns: dict[str, str] = Field(
        description="Canonical name -> column in the file, e.g. `{prompt: question, chosen: good}` (names: messages, prompt, response or completion, chosen, rejected, system, margin, label).",
    )
    max_length: int = Field(
        ge=8, description="Token limit of one encoded sequence (prompt + completion)."
    )
    truncation: Literal["drop", "truncate_prompt", "truncate_completion"] = Field(
        description="Rows longer than `max_length`: drop them (counted in the start-up summary), or cut the prompt's start or the completion's end.",
    )
    eval_path: str | list[DataSource] | None = Field(
        description="A held-out file, or a list of sources as `data.path` takes; without it, `eval_fraction` of `data.path` is held out."
    )
    eval_fraction: float = Field(
        ge=0.0,
        lt=1.0,
        description="Share of `data.path` held out for evaluation when `eval_path` is unset.",
    )
    max_train_samples: int | None = Field(
        ge=1, description="Use at most this many training rows (null: all)."
    )
    max_eval_samples: int | None = Field(
        ge=1, description="Use at most this many evaluation rows (null: all)."
    )
    num_proc: int | None = Field(
        ge=1,
        description="Worker processes that tokenise (batched `datasets.map`; files under 2,000 rows per process stay in one). null: the CPUs this process may use, at most 8.",
    )
    resolution: int | None = Field(
        ge=8,
        description="Text-to-image tasks: images are resized (shorter side) and centre-cropped to this many pixels square before they are encoded into latents; null: the pipeline's own (its denoiser's sample size x the VAE's scale).",
    )
    max_image_pixels: int | None = Field(
        ge=1,
        description="The most pixels (width x height) an image may have, checked from its header before any pixel is decoded: a guard against decompression bombs (a small file that decodes to gigabytes), Pillow's own limit by default. Raise it for large images you trust; null: no limit.",
    )
    num_frames: int | None = Field(
        ge=1,
        description="Text-to-video tasks: frames per training clip, sampled from each clip's start at `fps`; null: the pipeline's own default (16 for the UNet-3D layout, 81 for Wan, whose VAE needs 4k+1).",
    )
    fps: float | None = Field(
        gt=0,
        description="Text-to-video tasks: the rate clips are sampled at (a frame every 1/fps s, by each frame's time; a clip whose rate is anywhere below it, or too short, is refused); null: consecutive frames at the clip's own rate. A folder of frames is taken as consecutive frames.",
    )
    audio_seconds: float | None = Field(
        gt=0,
        description="Text-to-audio tasks: seconds of audio per training clip (each file mixed to mono, resampled to the model's rate, cut or zero-padded at its end to this length); null: the pipeline's own (its denoiser's sample size in mel frames). Its mel frames must split evenly through the VAE and the denoiser: another length is refused, naming the nearest that work.",
    )
    refuse_silent_audio: bool = Field(
        description="Text-to-audio tasks: refuse (one error naming each row) clips whose used part is silence, a peak below -60 dBFS, which the normalisation would otherwise raise to full loudness; false: train on them as they are.",
    )
    cache_dir: str | None = Field(
        description="Where tokenised data is cached (null: `data/` under `ALIGN_ANYTHING_CACHE`, else ~/.cache/align_anything). A start with the same data, tokenizer, chat template, max_length, truncation and task encoding reads it instead of tokenising.",
    )

    @field_validator("path", "eval_path")
    @classmethod
    def _some_source(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:  # would fail deep in the pipeline (#24, 12)
            raise ValueError(
                "an empty list names no data: give a file, folder, built-in or hub name, or a "
                "list of at least one source, e.g. [{path: a.jsonl}]"
            )
        return value

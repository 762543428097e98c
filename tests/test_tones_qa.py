"""Questions about the tones world's clips (`families/text_to_audio/tones_qa.py`): the shipped
`tones-qa-*` sets against their generator, their answers against the clips, embedded FLAC bytes
as audio references, the built-in rewards that check an answer against the data or the clip,
and reward functions getting each row's clip (`prompt_audio`). In process, seconds."""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest
import soundfile

from align_anything.data.builtin import builtin_path
from align_anything.data.media import MediaUnreadable, load_audio, probe_audio
from align_anything.families.text_to_audio import tones, tones_qa
from align_anything.families.text_to_image import shapes
from align_anything.rewards import tones_answer, tones_audio

RATE = tones.SAMPLING_RATE


@pytest.fixture(scope="module")
def generated() -> dict[str, list[dict]]:
    return tones_qa.generate()


def _samples(flac: bytes) -> np.ndarray:
    return soundfile.read(io.BytesIO(flac), dtype="int16")[0]


def test_shipped_files_equal_their_generator(generated) -> None:
    """Every file, row for row; clips compared by their samples (FLAC bytes may differ across
    libsndfile builds)."""
    assert set(tones_qa.QA_DATASETS) == set(generated)
    for name, filename in tones_qa.QA_DATASETS.items():
        path = builtin_path(name)
        assert path is not None and path.name == filename
        shipped = shapes.read_parquet(path)
        assert len(shipped) == len(generated[name]), name
        for a, b in zip(shipped, generated[name], strict=True):
            assert {k: v for k, v in a.items() if k != "audio"} == {
                k: v for k, v in b.items() if k != "audio"
            }
            assert len(a["audio"]) == len(b["audio"]) == 1
            assert np.array_equal(_samples(a["audio"][0]), _samples(b["audio"][0]))


def test_sizes_kinds_and_columns(generated) -> None:
    sizes = {n: len(r) for n, r in generated.items()}
    assert sizes == {
        "tones-qa": tones_qa.SFT_ROWS, "tones-qa-eval": tones_qa.EVAL_ROWS,
        "tones-qa-pref": tones_qa.PREF_ROWS, "tones-qa-pref-eval": tones_qa.EVAL_ROWS,
        "tones-qa-prompts": tones_qa.PROMPT_ROWS, "tones-qa-prompts-eval": tones_qa.EVAL_ROWS,
    }  # fmt: skip
    for name, rows in generated.items():
        kinds = collections.Counter(r["question"] for r in rows)
        assert kinds["pitch"] == kinds["beeps"] == len(rows) // 2, name
        assert {r["answer"] for r in rows} == set(tones.PITCHES) | {"0", "1", "2"}, name
    assert set(generated["tones-qa"][0]) == {"messages", "audio", "answer", "question"}
    assert set(generated["tones-qa-pref"][0]) == {
        "prompt", "audio", "chosen", "rejected", "answer", "question"
    }  # fmt: skip
    assert set(generated["tones-qa-prompts"][0]) == {"prompt", "audio", "answer", "question"}


def test_no_clip_is_in_two_sets(generated) -> None:
    seen: dict[bytes, str] = {}
    for name, rows in generated.items():
        for row in rows:
            key = _samples(row["audio"][0]).tobytes()
            assert seen.setdefault(key, name) == name, f"a clip of {name} is in {seen[key]}"


def test_every_answer_is_what_the_clip_sounds_like(generated) -> None:
    """The waveform rule (`read_clip`) hears every clip's pitch and beeps as the row says."""
    for rows in generated.values():
        for row in rows:
            wave = load_audio(row["audio"][0], None, RATE)
            assert tones_qa.read_clip(wave)[row["question"]] == row["answer"]
            if "chosen" in row:
                assert row["chosen"] == row["answer"] != row["rejected"]
                assert row["rejected"] in tones_qa.ANSWERS[row["question"]]


def test_rejected_answers_are_the_models_confusion_half_the_time(generated) -> None:
    rows = generated["tones-qa-pref"] + generated["tones-qa-pref-eval"]
    confusable = [r for r in rows if tones_qa.confused(r["question"], r["answer"])]
    confused = [r for r in confusable
                if r["rejected"] == tones_qa.confused(r["question"], r["answer"])]  # fmt: skip
    assert 0.35 < len(confused) / len(confusable) < 0.8


def test_embedded_audio_bytes_are_read_raw_or_in_a_dict() -> None:
    """FLAC (or WAV) bytes, raw or as `{"bytes": ...}` (`datasets`' undecoded audio), probe to
    their length and decode to mono float32 at the asked rate; bytes that are no audio file
    raise `MediaUnreadable` naming them."""
    wave = tones.synthesize(500.0, [(0.1, 0.5)])
    flac = tones.flac_bytes(wave)
    for ref in (flac, {"bytes": flac, "path": None}):
        assert probe_audio(ref, None) == (RATE, RATE)
        decoded = load_audio(ref, None, RATE)
        assert decoded.dtype == np.float32 and decoded.shape == (RATE,)
        assert np.abs(decoded - wave).max() < 1e-4  # 16-bit
    assert load_audio(flac, None, 8000).shape == (8000,)
    with pytest.raises(MediaUnreadable, match="embedded bytes"):
        probe_audio(b"not audio", None)


def test_tones_answer_reward() -> None:
    assert tones_answer(["q"] * 4, ["low", "Mid.", "2", "high"], ["low", "mid", "1", None]) == [
        1.0, 1.0, 0.0, None
    ]  # fmt: skip


def test_tones_audio_reward_reads_the_answer_off_the_clip(generated) -> None:
    """The rule gets the row's clip (`prompt_audio`), not its answer column: a right answer
    scores 1 whatever the data says, a wrong one 0; None without exactly one clip, for a clip
    the rule cannot read, or for a question it does not know."""
    rows = generated["tones-qa-prompts-eval"][:8]
    clips = [[load_audio(r["audio"][0], None, RATE)] for r in rows]
    right = [r["answer"] for r in rows]
    wrong = [tones_qa.confused("pitch", r["answer"]) or "0" if r["question"] == "pitch"
             else ("1" if r["answer"] != "1" else "2") for r in rows]  # fmt: skip
    prompts = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    assert tones_audio(prompts, right, clips) == [1.0] * 8  # the kind from the question
    assert tones_audio(prompts, wrong, clips, question=[r["question"] for r in rows]) == [0.0] * 8
    silent = np.zeros(RATE, dtype=np.float32)
    assert tones_audio([tones_qa.QUESTIONS["pitch"]] * 3, ["low"] * 3,
                       [[], clips[0] + clips[1], [silent]]) == [None] * 3  # fmt: skip
    assert tones_audio(["Tell me a story."], ["low"], [clips[0]]) == [None]


def test_reward_functions_get_each_rows_clip() -> None:
    """`Rewards.score` of an audio-text policy hands the functions `prompt_audio`: per
    completion its row's clips (float32 at the model's rate, decoded from the row's FLAC
    bytes), the G completions of a row sharing one decoded array; `tones_audio` scores them."""
    import torch

    from align_anything.families.language.loading import load_processor
    from align_anything.families.language.multimodal import MediaSupport
    from align_anything.families.language.prompts import encode_prompt
    from align_anything.families.zoo import resolve_model_path
    from align_anything.tasks.online.common import Rewards

    processor = load_processor(resolve_model_path("tiny-random-qwen2-audio"))
    media = MediaSupport(processor, ("audio",), context=1024)
    prompts = []
    for row in shapes.read_parquet(builtin_path("tones-qa-prompts"))[:3]:
        record = media.prepare_record({**row, "prompt": [{"role": "user",
                                                          "content": row["prompt"]}]}, None)  # fmt: skip
        prompts.append(encode_prompt(record, processor.tokenizer, max_prompt_length=512))
    assert all(int(torch.tensor(p["prompt_ids"]).eq(media.token_id("audio")).sum()) == 25
               for p in prompts)  # fmt: skip
    seen: dict[str, list] = {}

    def look(prompts, completions, prompt_audio, **kwargs):
        seen["audio"] = prompt_audio
        return tones_audio(prompts, completions, prompt_audio, **kwargs)

    rows = [p for p in prompts for _ in range(2)]
    answers = [r["fields"]["answer"] for r in rows]
    rewards = Rewards([("look", look)], [1.0], None, timeout_s=None, media=media)
    total, _ = rewards.score(rows, answers, row_ids=[r["source_row"] for r in rows], step=0,
                             good_checkpoint=lambda: None)  # fmt: skip
    assert total == [1.0] * 6
    audio = seen["audio"]
    assert [len(a) for a in audio] == [1] * 6
    assert audio[0][0] is audio[1][0] and audio[0][0] is not audio[2][0]
    assert audio[0][0].dtype == np.float32 and audio[0][0].shape == (RATE,)

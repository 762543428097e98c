"""The built-in text-to-audio world and model: the tones check by hand-derived cases, the sets'
sizes, columns and shipped clips (equal to what `tones.generate` and `tones.clips` make), the
held-out check of built-in data, the shipped `tiny-t2a-tones` folder (its architecture, size,
files), and (slow) that the base model leaves the held-out check to fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from align_anything.data.builtin import BUILTIN_DIR, builtin_path
from align_anything.families.text_to_audio import audio, tones
from align_anything.families.text_to_audio import tones_model as t2a

RATE = tones.SAMPLING_RATE


def test_the_check_on_hand_made_tones() -> None:
    # 250 Hz over one second: the FFT's bin spacing is 1 Hz, so the peak is at 250 exactly.
    hum = tones.synthesize(250.0, [(0.1, 0.8)])
    assert tones.dominant_frequency(hum) == pytest.approx(250.0, abs=1.0)
    assert tones.pitch_of(hum) == "low"
    # 500 Hz is 1 octave above 250 (low) and half an octave below 707 (mid): mid.
    assert tones.pitch_of(tones.synthesize(500.0, [(0.1, 0.8)])) == "mid"
    assert tones.pitch_of(tones.synthesize(2600.0, [(0.1, 0.8)])) == "high"
    assert tones.pitch_of(tones.synthesize(6000.0, [(0.1, 0.8)])) is None  # 1.6 octaves off
    # The envelope: 10 ms frames; 0.8 s is one tone of ~80 frames, a hum.
    assert len(tones.tones_of(hum)) == 1 and abs(tones.tones_of(hum)[0][1] - 80) <= 2
    assert tones.pattern_of(hum) == "hum"
    assert tones.audio_matches(hum, "a low hum")
    assert not tones.audio_matches(hum, "a mid hum")  # wrong pitch
    assert not tones.audio_matches(hum, "a low beep")  # wrong pattern
    beep = tones.synthesize(2000.0, [(0.3, 0.2)])
    assert tones.pattern_of(beep) == "beep" and tones.audio_matches(beep, "a high beep")
    two = tones.synthesize(250.0, [(0.1, 0.15), (0.45, 0.15)])
    assert [n for _, n in tones.tones_of(two)] == pytest.approx([15, 15], abs=2)
    assert tones.audio_matches(two, "two low beeps") and not tones.audio_matches(two, "a low beep")
    # A 20 ms gap is bridged (under MIN_GAP_FRAMES): one tone, a beep, not two.
    bridged = tones.synthesize(250.0, [(0.1, 0.1), (0.22, 0.1)])
    assert tones.pattern_of(bridged) == "beep"
    assert tones.pattern_of(np.zeros(RATE, dtype=np.float32)) is None  # silence
    assert not tones.audio_matches(np.zeros(RATE, dtype=np.float32), "a low hum")
    assert tones.caption_words("Two HIGH beeps") == ("high", "two beeps")
    assert tones.match_rate([hum, beep], ["a low hum", "a low beep"]) == 0.5


def test_sets_and_clips_are_what_generate_makes() -> None:
    sizes = {"t2a-tones": (tones.SFT_ROWS, {"audio", "text"}),
             "t2a-tones-pref": (tones.PREF_TRAIN_ROWS, {"prompt", "chosen", "rejected"}),
             "t2a-tones-eval": (tones.EVAL_ROWS, {"text", "audio", "seed"}),
             "t2a-tones-pref-eval": (tones.PREF_EVAL_ROWS, {"prompt", "chosen", "rejected"})}  # fmt: skip
    generated = tones.generate()
    for name, (count, columns) in sizes.items():
        rows = tones.read_parquet(builtin_path(name))
        assert rows == generated[name], name
        assert len(rows) == count and set(rows[0]) == columns, name
    seeds = [r["seed"] for r in tones.read_parquet(builtin_path("t2a-tones-eval"))]
    assert seeds == list(range(tones.EVAL_ROWS))
    held_out = {tones.caption(*c) for c in tones.HELD_OUT}
    assert {r["text"] for r in generated["t2a-tones-eval"]} == held_out
    assert not held_out & {r["prompt"] for r in generated["t2a-tones-pref"]}
    assert not held_out & {r["text"] for r in generated["t2a-tones"]}
    features = audio.Features(1.0, RATE, 160, 16)
    for name, wave in tones.clips().items():
        shipped = audio.decode(audio.AudioRef(BUILTIN_DIR / name))[0][:, 0]
        assert np.abs(shipped - wave).max() < 2 / 2**15, name  # 16-bit FLAC
        # Read as the family reads it (normalised), every clip passes its own caption.
        pitch, pattern = name.split("/")[1].rsplit("-", 1)[0].split("-", 1)
        read = audio.waveform(audio.AudioRef(BUILTIN_DIR / name), features)
        assert tones.audio_matches(read, tones.caption(pitch, pattern.replace("-", " "))), name
    for row in generated["t2a-tones-pref"]:
        assert tones.audio_matches(tones.clips()[row["chosen"]], row["prompt"])
        assert not tones.audio_matches(tones.clips()[row["rejected"]], row["prompt"])


def test_the_tones_sets_have_the_held_out_check() -> None:
    from align_anything.families.text_to_audio.media import AUDIO

    check = AUDIO.check("t2a-tones-pref")
    assert check is not None and check.name == "tones" and len(check.captions) == tones.EVAL_ROWS
    assert check.seeds == list(range(tones.EVAL_ROWS)) and check.rule is tones.match_rate
    assert AUDIO.check("some/folder") is None and AUDIO.check("t2v-shapes-pref") is None


def test_steady_and_varied_timings() -> None:
    """Both timings stay inside the clip and keep the check's patterns apart; STEADY's tones
    start within 0.08 s of fixed places, its two beeps 0.12-0.15 s apart (the gap the VAE and
    vocoder keep at 2 kHz); VARIED's single beep roams over 0.4 s."""
    import random

    rng = random.Random(0)
    for steady in (True, False):
        for pattern in tones.PATTERNS:
            draws = [tones.segments_of(pattern, rng, steady) for _ in range(200)]
            assert all(0 < s and s + n <= tones.SECONDS for d in draws for s, n in d)
            assert {len(d) for d in draws} == {2 if pattern == "two beeps" else 1}
            starts = [d[0][0] for d in draws]
            spread = max(starts) - min(starts)
            assert spread <= 0.08 if steady else spread >= 0.09
            if pattern == "two beeps":
                gaps = [d[1][0] - d[0][0] - d[0][1] for d in draws]
                assert min(gaps) >= 0.12 and max(gaps) <= (0.15 if steady else 0.2)
    beeps = [tones.segments_of("beep", rng)[0][0] for _ in range(200)]
    assert max(beeps) - min(beeps) > 0.35
    with pytest.raises(ValueError, match="unknown pattern"):
        tones.segments_of("chirp", rng)


def test_shipped_folder_is_the_described_pipeline() -> None:
    from align_anything.families import diffusion
    from align_anything.families.zoo import resolve_model_path

    folder = t2a.SHIPPED_DIR
    assert resolve_model_path(t2a.NAME) == str(folder)
    info = diffusion.inspect_pipeline(t2a.NAME)
    assert info.kind == "audioldm" and info.prediction == "epsilon"
    assert info.default_resolution == 100 and info.mel_bins == t2a.MEL_BINS  # 1 s of mel frames
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "AudioLDMPipeline"
    weights = [p for p in folder.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin")]
    assert sorted(p.parent.name for p in weights) == ["text_encoder", "unet", "vae", "vocoder"]
    assert all(p.suffix == ".safetensors" for p in weights)
    assert sum(p.stat().st_size for p in weights) < 8 * 2**20


@pytest.mark.slow
def test_shipped_model_leaves_the_check_to_fix() -> None:
    """The base of the text-to-audio main job: on the 48 held-out captions (their seeds, DDIM
    20 steps, the main job's guidance of 1.5, fp32 CPU) it makes one second of finite, audible
    audio per caption, and at most half of the clips pass the check: the alignment run has
    something to fix (measured: 0.00, docs/text-to-audio.md)."""
    import torch
    from diffusers import DiffusionPipeline

    torch.manual_seed(0)
    pipeline = DiffusionPipeline.from_pretrained(t2a.SHIPPED_DIR)
    pipeline.set_progress_bar_config(disable=True)
    rows = tones.read_parquet(builtin_path("t2a-tones-eval"))
    captions = [r["text"] for r in rows]
    waves = t2a.sample_audio(pipeline, captions, [r["seed"] for r in rows], steps=20, guidance=1.5)
    assert all(w.shape == (RATE,) and np.isfinite(w).all() for w in waves)
    assert all(tones.envelope(w).max() > tones.SILENCE_RMS for w in waves)
    assert tones.match_rate(waves, captions) <= 0.5

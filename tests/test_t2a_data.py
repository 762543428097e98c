"""Text-to-audio data (`families/text_to_audio/audio.py`): every format the family reads gives
the tone it was written from, mixed to mono, resampled to the model's rate and cut or padded to
the clip length; the log-mel features are AudioLDM's (frames per hop, the Slaney mel bins
worked out by hand, the STFT against transformers' own); every bad row is named in one error
before any compute. No model is loaded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import t2a_data

from align_anything.errors import DataError
from align_anything.families.text_to_audio import audio as a
from align_anything.families.text_to_audio.media import mel_ready

FEATURES = a.Features(0.64, 16000, 160, 16)  # the tiny AudioLDM's: 64 frames x 16 mels


def dominant_frequency(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[int(np.argmax(spectrum))])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("t2a-data")
    t2a_data.captioned_folder(root / "captioned")
    t2a_data.pair_file(root / "pairs")
    return root


def test_wav_flac_ogg_and_mp3_read_as_mono_tones_at_the_models_rate(root: Path) -> None:
    source = a.read_audio_source(str(root / "captioned"), "captioned")
    assert [item.row for item in source.items] == [f"line {k}" for k in range(1, 5)]
    assert {p.suffix for p in source.audio_files} == {".wav", ".flac", ".ogg", ".mp3"}
    for item in source.items:
        wave = a.waveform(item.audio, FEATURES)
        assert wave.shape == (FEATURES.samples,) == (10240,)
        pitch = t2a_data.PITCH[item.caption]
        assert abs(dominant_frequency(wave, 16000) - pitch) <= 2.0, item.audio
        assert abs(float(wave.mean())) < 1e-3  # AudioLDM's normalisation: mean out,
        assert float(np.abs(wave).max()) == pytest.approx(a.PEAK, abs=1e-3)  # peak at 0.5


def test_stereo_is_the_mean_of_its_channels_and_resampling_keeps_the_pitch() -> None:
    stereo = np.stack([np.ones(8), np.zeros(8)], axis=1).astype(np.float32)
    assert np.allclose(a.to_mono(stereo), 0.5)
    tone = t2a_data.tone(440.0, 1.0, 44100)[:, 0]
    resampled = a.resample(tone, 44100, 16000)
    assert len(resampled) == 16000
    assert dominant_frequency(resampled, 16000) == pytest.approx(440.0, abs=1.0)


def test_short_clips_are_zero_padded_and_long_ones_cut(tmp_path: Path) -> None:
    short = t2a_data.write(tmp_path / "short.wav", t2a_data.tone(500, 0.3, 16000), 16000)
    wave = a.waveform(a.AudioRef(short), FEATURES)
    assert wave.shape == (10240,)
    assert np.all(wave[4800:] == 0) and float(np.abs(wave[:4800]).max()) > 0.4
    long = t2a_data.write(tmp_path / "long.wav", t2a_data.tone(500, 3.0, 16000), 16000)
    assert a.waveform(a.AudioRef(long), FEATURES).shape == (10240,)


def slaney_mel(frequency: float) -> float:
    """The Slaney mel scale (librosa's default): linear, 3 mels per 200 Hz, below 1 kHz;
    logarithmic above, 27 mels per factor 6.4."""
    if frequency < 1000:
        return 3 * frequency / 200
    return 15 + 27 * math.log(frequency / 1000) / math.log(6.4)


@pytest.mark.parametrize("pitch", [200.0, 1000.0, 2000.0, 5000.0])
def test_a_tone_lights_the_mel_bin_centred_nearest_it(pitch: float) -> None:
    """16 triangular filters between 0 and 8 kHz, equally spaced in Slaney mels: filter k
    (from 0) peaks at mel (k + 1) x top / 17; a tone's loudest bin is the one whose peak
    is nearest its mel."""
    wave = t2a_data.tone(pitch, 0.64, 16000)[:, 0]
    mel = a.log_mel(wave, FEATURES)
    assert mel.shape == (64, 16)  # one frame per hop of 160 samples
    spacing = slaney_mel(8000) / 17
    expected = int(np.argmin([abs(slaney_mel(pitch) - (k + 1) * spacing) for k in range(16)]))
    assert int(np.argmax(mel[8:-8].mean(axis=0))) == expected


def test_the_log_mel_is_transformers_spectrogram_with_audioldms_settings() -> None:
    """The same features through transformers' numpy STFT: the waveform reflect-padded by
    (1024 - 160) / 2, no centring, a periodic Hann window, magnitudes, log of at least 1e-5."""
    from transformers.audio_utils import spectrogram, window_function

    wave = np.random.default_rng(0).standard_normal(10240).astype(np.float32) * 0.1
    padded = np.pad(wave, (432, 432), mode="reflect")
    expected = spectrogram(
        padded, window_function(1024, "hann"), frame_length=1024, hop_length=160, power=1.0,
        center=False, mel_filters=a.mel_filters(FEATURES).numpy().T, mel_floor=1e-5,
        log_mel="log",
    ).T  # fmt: skip
    ours = a.log_mel(wave, FEATURES)
    assert ours.shape == expected.shape == (64, 16)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
    silence = a.log_mel(np.zeros(10240, dtype=np.float32), FEATURES)
    assert np.all(silence == np.float32(math.log(1e-5)))


def test_a_clip_is_made_ready_as_a_one_channel_spectrogram(root: Path) -> None:
    source = a.read_audio_source(str(root / "captioned"), "captioned")
    ready = mel_ready(FEATURES)(source.items[0].audio)
    assert ready.pixels.shape == (1, 64, 16) and ready.pixels.dtype == np.float32
    assert ready.geometry == (64, 16, 0, 0)


def test_generic_pairs_read_chosen_and_rejected(root: Path) -> None:
    source = a.read_audio_source(str(root / "pairs" / "pairs.jsonl"), "pairs")
    assert len(source.items) == 2 and source.kind == "pairs"
    for item in source.items:
        pitch = t2a_data.PITCH[item.caption]
        assert dominant_frequency(a.waveform(item.chosen, FEATURES), 16000) == pytest.approx(
            pitch, abs=2.0
        )
        rejected = dominant_frequency(a.waveform(item.rejected, FEATURES), 16000)
        assert rejected == pytest.approx(pitch * 1.5, abs=2.0)


def test_every_bad_row_is_named_in_one_error(tmp_path: Path) -> None:
    import soundfile

    t2a_data.write(tmp_path / "good.wav", t2a_data.tone(300, 0.5, 16000), 16000)
    (tmp_path / "noise.wav").write_bytes(b"RIFF not really a wave file")
    soundfile.write(str(tmp_path / "empty.wav"), np.zeros((0, 1), np.float32), 16000)
    rows = [{"file_name": "good.wav", "text": "a hum"}, {"file_name": "good.wav", "text": " "},
            {"file_name": "noise.wav", "text": "a hum"}, {"file_name": "empty.wav", "text": "x"},
            {"file_name": "gone.ogg", "text": "a hum"}]  # fmt: skip
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as caught:
        a.read_audio_source(str(tmp_path), "captioned")
    message = str(caught.value)
    assert f"4 row(s) of data file {tmp_path / 'metadata.jsonl'}" in message
    assert "line 2: missing or empty caption in column 'text'" in message
    assert f"line 3: audio {tmp_path / 'noise.wav'}: cannot be read as audio" in message
    assert f"line 4: audio {tmp_path / 'empty.wav'}: zero-length audio" in message
    assert f"line 5: audio {tmp_path / 'gone.ogg'}: no such file" in message
    assert "line 1" not in message


def test_a_pair_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a hum", "audio_0": "a.wav", "audio_1": "b.wav"}))
    with pytest.raises(DataError, match=r"in neither audio preference format: .* columns found: "
                                        r"prompt, audio_0, audio_1"):  # fmt: skip
        a.read_audio_source(str(path), "pairs")
    with pytest.raises(DataError, match="has no metadata.jsonl"):
        a.read_audio_source(str(tmp_path), "captioned")


def test_align_anythings_ranked_pairs_put_the_better_response_first(root: Path) -> None:
    """align-anything's AA_T2A rows (prompt, response_1, response_2, overall_audio): the
    better response is the chosen clip whichever column holds it; a preference that is not 1
    or 2 is named with its row."""
    folder = root / "pairs"
    rows = [{"prompt": "a high beep", "response_1": "good0.wav", "response_2": "bad0.flac",
             "overall_audio": 1},
            {"prompt": "a low hum", "response_1": "bad1.flac", "response_2": "good1.wav",
             "overall_audio": 2}]  # fmt: skip
    path = folder / "aa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = a.read_audio_source(str(path), "pairs")
    assert [(i.chosen.path.name, i.rejected.path.name) for i in source.items] == [
        ("good0.wav", "bad0.flac"), ("good1.wav", "bad1.flac")]  # fmt: skip
    bad = folder / "aa-bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "overall_audio": 3}) + "\n")
    with pytest.raises(DataError, match=r"line 1: overall_audio 3 is not 1 or 2"):
        a.read_audio_source(str(bad), "pairs")


def test_a_rate_that_cannot_be_resampled_and_refused_silence_are_named(tmp_path: Path) -> None:
    """Checked before any compute against the model's rate: 44,101 Hz does not reduce against
    16 kHz (16000/44101), 44.1 kHz does (160/441). Silence is refused only when asked, and
    only for the part of the clip that is used."""
    odd = a.AudioRef(t2a_data.write(tmp_path / "odd.wav", t2a_data.tone(300, 0.5, 44101), 44101))
    fine = a.AudioRef(t2a_data.write(tmp_path / "fine.wav", t2a_data.tone(300, 0.5, 44100), 44100))
    quiet = np.concatenate([np.full((16000, 1), 1e-4, np.float32) * np.sin(np.arange(16000))[:, None],
                            t2a_data.tone(300, 0.5, 16000)])  # fmt: skip
    late = a.AudioRef(t2a_data.write(tmp_path / "late.wav", quiet.astype(np.float32), 16000))
    checks = a.Checks(16000, 0.64, refuse_silence=True)
    assert a.check_audio(fine, a.Checks(16000)) is None
    problem = a.check_audio(odd, a.Checks(16000))
    assert problem == (
        f"audio {odd.path}: its sampling rate 44101 Hz cannot be resampled to the model's 16000 Hz "
        "(the ratio 16000/44101 does not reduce to factors of at most 1000); convert the file "
        "first, e.g. `ffmpeg -i IN -ar 16000 OUT.wav`"
    )
    assert a.check_audio(late, a.Checks(16000)) is None  # not asked
    assert a.check_audio(late, a.Checks(16000, 1.5, refuse_silence=True)) is None  # tone in it
    silent = a.check_audio(late, checks)  # its first 0.64 s peak at 1e-4
    assert silent is not None and silent.startswith(
        f"audio {late.path}: silence (its first 0.64 s "
    )
    assert "below 0.001, -60 dBFS; data.refuse_silent_audio=true" in silent
    rows = [{"file_name": "fine.wav", "text": "a hum"}, {"file_name": "odd.wav", "text": "x"},
            {"file_name": "late.wav", "text": "a hum"}]  # fmt: skip
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as caught:
        a.read_audio_source(str(tmp_path), "captioned", checks=checks)
    message = str(caught.value)
    assert "2 row(s)" in message and "line 2: audio" in message and "line 3: audio" in message
    assert len(a.read_audio_source(str(tmp_path / "metadata.jsonl"), "captioned").items) == 3

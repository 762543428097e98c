"""The text-to-audio family end to end, through the real entry point on the tiny random
AudioLDM pipeline and a few tones in every audio format, two steps a run: `diffusion_sft` and
`diffusion_dpo` at z0 on one rank (one module-scoped fixture runs both), their first step's
losses against the same step written out with diffusers and transformers by hand (the noise
and timestep each row's seed gives); every other preset against a one-process run of the
same task: LoRA under ZeRO-3 on 2 ranks against LoRA under ZeRO-2 on 1, a full fine-tune
under ZeRO-3 with CPU offload against the one at z0; what comes out loads with
`AudioLDMPipeline` and makes a waveform (`AudioLDMPipeline` has no LoRA loader: the adapter,
written in the UNet's layout, loads into its UNet with `load_lora_adapter` and equals
`final-merged/`); samples are WAV files with a spectrogram grid; and the settings an audio
pipeline cannot take are refused.

| run | task | preset | LoRA | ranks | checked against |
| --- | --- | --- | --- | --- | --- |
| sft | sft | z0 | - | 1 | diffusers by hand |
| dpo | dpo | z0 | - | 1 | diffusers by hand |
| dpo_z2_lora | dpo | z2 | LoRA | 1 | dpo (step 1) |
| dpo_z3_lora_2ranks | dpo | z3 | LoRA | 2 | dpo_z2_lora |
| sft_z3_offload | sft | z3_offload | - | 1 | sft |
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import t2a_data
import torch
from conftest import RunResult, launch, run_inline
from safetensors.torch import load_file

from align_anything.families.text_to_audio import audio as a

pytestmark = pytest.mark.slow

MODEL = "tiny-random-audioldm"
SEED = 7
FEATURES = a.Features(0.64, 16000, 160, 16)
FAST = [
    f"model.name_or_path={MODEL}", "deepspeed=z0", "train.precision=fp32", f"train.seed={SEED}",
    "train.max_steps=2", "train.learning_rate=1e-3", "train.lr_scheduler=constant",
    "train.warmup_ratio=0", "train.per_device_batch_size=2", "data.audio_seconds=0.64",
    "logging.sample_prompts=[a_low_hum]", "logging.sample_seeds=[0]",
]  # fmt: skip


class Runs(NamedTuple):
    data: Path
    sft: RunResult
    dpo: RunResult


def sft_args(root: Path) -> list[str]:
    return [*FAST, "task=diffusion_sft", f"data.path={root / 'train'}",
            f"data.eval_path={root / 'eval'}", "diffusion_sft.eval_draws=1",
            "diffusion_sft.check_samples=0", "diffusion_sft.sample_steps=1"]  # fmt: skip


def dpo_args(root: Path) -> list[str]:
    return [*FAST, "task=diffusion_dpo", f"data.path={root / 'pairs' / 'pairs.jsonl'}",
            f"data.eval_path={root / 'pairs-eval' / 'pairs.jsonl'}", "diffusion_dpo.beta=10",
            "diffusion_dpo.check_samples=0", "diffusion_dpo.sample_steps=1"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Both tasks' runs: 2 captioned clips (2 held out), 2 pairs (2 held out)."""
    root = tmp_path_factory.mktemp("t2a-runs")
    t2a_data.captioned_folder(root / "train", 2)
    t2a_data.captioned_folder(root / "eval", 2)
    t2a_data.pair_file(root / "pairs", 2)
    t2a_data.pair_file(root / "pairs-eval", 2)
    tensorboard = "logging.backends=[console,jsonl,tensorboard]"  # the samples play there
    sft = run_inline([*sft_args(root), tensorboard], root / "sft").check()
    dpo = run_inline(dpo_args(root), root / "dpo").check()
    return Runs(root, sft, dpo)


LORA = ["model.lora.enabled=true"]


@pytest.fixture(scope="module")
def dpo_z2_lora(runs: Runs) -> RunResult:
    """One process: what 2 ranks are held to."""
    return run_inline([*dpo_args(runs.data), *LORA, "deepspeed=z2"],
                      runs.data / "dpo_z2_lora").check()  # fmt: skip


@pytest.fixture(scope="module")
def dpo_z3_lora_2ranks(runs: Runs) -> RunResult:
    """The same 2 pairs a step, one a rank, through the deepspeed launcher."""
    overrides = [*dpo_args(runs.data), *LORA, "deepspeed=z3", "train.per_device_batch_size=1"]
    return launch(overrides, runs.data / "dpo_z3_lora_2ranks", launcher="deepspeed", nproc=2,
                  timeout_s=600).check()  # fmt: skip


@pytest.fixture(scope="module")
def sft_z3_offload(runs: Runs) -> RunResult:
    """A first z3_offload run in a fresh environment compiles DeepSpeed's CPU Adam (minutes)."""
    return run_inline([*sft_args(runs.data), "deepspeed=z3_offload"],
                      runs.data / "sft_z3_offload").check()  # fmt: skip


class ByHand:
    """The tiny AudioLDM's parts loaded plainly with diffusers and transformers, and one
    sample's epsilon MSE written out as AudioLDM's pipeline and diffusers' training scripts
    compute it."""

    def __init__(self) -> None:
        from diffusers import AudioLDMPipeline, DDPMScheduler

        from align_anything.families.zoo import resolve_model_path

        self.pipe = AudioLDMPipeline.from_pretrained(resolve_model_path(MODEL))
        self.scheduler = DDPMScheduler.from_config(self.pipe.scheduler.config)

    @torch.no_grad()
    def latents(self, path: Path) -> torch.Tensor:
        mel = torch.from_numpy(a.spectrogram(a.AudioRef(path), FEATURES))[None, None]
        vae = self.pipe.vae
        return vae.encode(mel).latent_dist.mean[0] * vae.config.scaling_factor

    @torch.no_grad()
    def text(self, caption: str) -> torch.Tensor:
        tokens = self.pipe.tokenizer(caption, padding="max_length", truncation=True,
                                     max_length=self.pipe.tokenizer.model_max_length,
                                     return_tensors="pt")  # fmt: skip
        out = self.pipe.text_encoder(tokens.input_ids, attention_mask=tokens.attention_mask)
        return torch.nn.functional.normalize(out.text_embeds, dim=-1)

    @torch.no_grad()
    def mse(self, latents: torch.Tensor, embeds: torch.Tensor, step: int, position: int) -> float:
        from align_anything.families.diffusion.forward import draw_seed

        generator = torch.Generator().manual_seed(draw_seed(SEED, step, position))
        noise = torch.randn(tuple(latents.shape), generator=generator)
        t = torch.randint(0, 1000, (1,), generator=generator)
        noisy = self.scheduler.add_noise(latents[None], noise[None], t)
        prediction = self.pipe.unet(noisy, t, encoder_hidden_states=None,
                                    class_labels=embeds).sample  # fmt: skip
        return float((prediction - noise[None]).pow(2).mean())


@pytest.fixture(scope="module")
def by_hand() -> ByHand:
    return ByHand()


def rows(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def test_both_tasks_ran_two_finite_steps_under_zero0(runs: Runs) -> None:
    for result in (runs.sft, runs.dpo):
        assert result.zero_stage() == 0
        steps = result.train_steps()
        assert [m["step"] for m in steps] == [1, 2]
        assert all(math.isfinite(m["loss"]) for m in steps)
        assert result.summary_line("resolution").startswith(
            "0.64 s of mono audio at 16000 Hz: 64 mel frames x 16 mels (hop 160); latents 4x32x8"
        )
        # the audio decoder's release is named beside diffusers' for a bug report
        assert ", diffusers " in result.summary_line("versions")
        assert ", soundfile " in result.summary_line("versions")


# The random UNet's prediction is small beside the noise, so a sample's MSE is about 1 whatever
# its clip and caption: another clip or caption moves it by ~1e-5 (relative), float32 rounding
# by ~3e-8. The comparisons are to 1e-6, and each test shows that a wrong input misses by more.
REL = 1e-6


def test_the_first_sft_step_is_diffusers_by_hand(runs: Runs, by_hand: ByHand) -> None:
    """Step 1 (drawn as step 0) reads both training clips; its loss is their mean MSE."""
    first = runs.sft.train_steps()[0]
    table = rows(runs.data / "train" / "metadata.jsonl")
    latents = [by_hand.latents(runs.data / "train" / row["file_name"]) for row in table]
    texts = [by_hand.text(row["text"]) for row in table]
    expected = np.mean([by_hand.mse(latents[k], texts[k], 0, k) for k in range(2)])
    assert first["loss"] == pytest.approx(expected, rel=REL)
    assert first["mse"] == pytest.approx(expected, rel=REL)
    swapped = np.mean([by_hand.mse(latents[k], texts[1 - k], 0, k) for k in range(2)])
    assert abs(swapped - expected) > 5 * REL * expected  # captions swapped: a miss
    before, after = runs.sft.eval("before"), runs.sft.eval("after")
    assert after["eval/loss"] < before["eval/loss"]  # two steps on the same tones helped


def test_the_first_dpo_step_is_diffusers_by_hand(runs: Runs, by_hand: ByHand) -> None:
    """Chosen and rejected share each pair's draw; the policy starts as the reference."""
    first, second = runs.dpo.train_steps()
    pairs = runs.data / "pairs"
    chosen, rejected = [], []
    for position, row in enumerate(rows(pairs / "pairs.jsonl")):
        embeds = by_hand.text(row["prompt"])
        chosen.append(by_hand.mse(by_hand.latents(pairs / row["chosen"]), embeds, 0, position))
        rejected.append(by_hand.mse(by_hand.latents(pairs / row["rejected"]), embeds, 0, position))
    assert first["mse/policy_chosen"] == pytest.approx(np.mean(chosen), rel=REL)
    assert first["mse/policy_rejected"] == pytest.approx(np.mean(rejected), rel=REL)
    assert abs(np.mean(chosen) - np.mean(rejected)) > 5 * REL  # chosen for rejected: a miss
    assert first["mse/ref_chosen"] == pytest.approx(first["mse/policy_chosen"], rel=1e-6)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert second["mse/ref_chosen"] != pytest.approx(second["mse/policy_chosen"], rel=1e-6)
    before, after = runs.dpo.eval("before"), runs.dpo.eval("after")
    assert after["eval/mse/ref_chosen"] == before["eval/mse/ref_chosen"]  # the base never moves
    assert after["eval/mse/policy_chosen"] != before["eval/mse/policy_chosen"]


def base_unet() -> dict[str, torch.Tensor]:
    from align_anything.families.zoo import resolve_model_path

    path = Path(resolve_model_path(MODEL)) / "unet" / "diffusion_pytorch_model.safetensors"
    return load_file(str(path))


def test_final_loads_with_audioldm_and_makes_a_waveform(runs: Runs) -> None:
    from diffusers import AudioLDMPipeline

    base = base_unet()
    for result in (runs.sft, runs.dpo):
        final = result.output_dir / "final"
        trained = load_file(str(final / "unet" / "diffusion_pytorch_model.safetensors"))
        assert set(trained) == set(base)
        assert any(not torch.equal(trained[k], base[k]) for k in base)
    pipe = AudioLDMPipeline.from_pretrained(str(runs.sft.output_dir / "final"))
    wave = pipe("a low hum", num_inference_steps=2, audio_length_in_s=0.64,
                generator=torch.Generator().manual_seed(0)).audios[0]  # fmt: skip
    assert wave.shape == (10240,) and np.isfinite(wave).all() and float(np.abs(wave).max()) > 0


def test_every_other_preset_ran_its_stage(
    dpo_z2_lora: RunResult, dpo_z3_lora_2ranks: RunResult, sft_z3_offload: RunResult
) -> None:
    for result, stage in ((dpo_z2_lora, 2), (dpo_z3_lora_2ranks, 3), (sft_z3_offload, 3)):
        assert result.zero_stage() == stage, result.output_dir
        steps = result.train_steps()
        assert [m["step"] for m in steps] == [1, 2]
        assert all(math.isfinite(m["loss"]) for m in steps)
        assert "latents 4x32x8" in result.summary_line("resolution")
    assert "LoRA r=16" in dpo_z3_lora_2ranks.output
    assert "offload" in sft_z3_offload.output and "cpu" in sft_z3_offload.summary_line("ds config")


# Two ranks sum a step's gradients in another order, and DeepSpeed's CPU Adam rounds otherwise
# than torch's: the losses of step 2 and after training differ from the one-process run's in
# float32 rounding (measured: up to 7e-7 relative); one LoRA step at lr 1e-3 moves the
# policy's MSE from the reference's by 6e-4 relative, two full steps the eval loss by 10%.
DIST_REL = 1e-5


def test_two_ranks_under_zero3_equal_one_rank_with_lora(
    runs: Runs, dpo_z2_lora: RunResult, dpo_z3_lora_2ranks: RunResult
) -> None:
    """The same 2 pairs a step, split over 2 ranks (micro 1) under ZeRO-3 or whole in one
    process, give the same losses: the draws depend on each pair's row alone. Step 1 (the
    adapters' B at zero) is also the full fine-tune's, checked by hand above."""
    one = {m["step"]: m for m in dpo_z2_lora.train_steps()}
    two = {m["step"]: m for m in dpo_z3_lora_2ranks.train_steps()}
    # ZeRO-2 in one process: the summary says what it costs there and names deepspeed=z0
    line = dpo_z2_lora.summary_line("one process")
    assert "ZeRO-2 has no other rank" in line and "use deepspeed=z0" in line
    with pytest.raises(AssertionError):  # two ranks have others to partition over
        dpo_z3_lora_2ranks.summary_line("one process")
    keys = ("loss", "mse/policy_chosen", "mse/policy_rejected", "mse/ref_chosen")
    for key in keys:
        assert one[1][key] == pytest.approx(runs.dpo.train_steps()[0][key], rel=REL), key
    for step in (1, 2):
        for key in keys:
            assert two[step][key] == pytest.approx(one[step][key], rel=DIST_REL), (step, key)
    assert abs(one[2]["mse/policy_chosen"] - one[2]["mse/ref_chosen"]) > (
        10 * DIST_REL * one[2]["mse/ref_chosen"]
    )  # step 1 moved the policy from the reference by more than the tolerance
    for phase in ("before", "after"):
        for key in ("eval/loss", "eval/mse/policy_chosen", "eval/mse/ref_chosen"):
            assert dpo_z3_lora_2ranks.eval(phase)[key] == pytest.approx(
                dpo_z2_lora.eval(phase)[key], rel=DIST_REL
            ), (phase, key)


def test_zero3_with_cpu_offload_equals_zero0(runs: Runs, sft_z3_offload: RunResult) -> None:
    """Partitioned weights, optimizer state on the CPU and DeepSpeed's CPU Adam: the same
    losses and, after two steps, the same UNet as the plain run."""
    for plain, offload in zip(runs.sft.train_steps(), sft_z3_offload.train_steps(), strict=True):
        assert offload["loss"] == pytest.approx(plain["loss"], rel=DIST_REL), plain["step"]
    for phase in ("before", "after"):
        assert sft_z3_offload.eval(phase)["eval/loss"] == pytest.approx(
            runs.sft.eval(phase)["eval/loss"], rel=DIST_REL
        )
    weights = "unet/diffusion_pytorch_model.safetensors"
    plain = load_file(str(runs.sft.output_dir / "final" / weights))
    offload = load_file(str(sft_z3_offload.output_dir / "final" / weights))
    base = base_unet()
    assert plain.keys() == offload.keys()
    moved = sum(float((plain[k] - base[k]).double().square().sum()) for k in base)
    diff = sum(float((offload[k] - plain[k]).double().square().sum()) for k in base)
    assert moved > 0 and diff**0.5 <= 0.01 * moved**0.5  # the same update, to 1%


def adapter(result: RunResult) -> dict[str, torch.Tensor]:
    """The adapter a LoRA run wrote: in Stable Diffusion's UNet layout, its B matrices trained."""
    weights = load_file(str(result.output_dir / "final" / "pytorch_lora_weights.safetensors"))
    assert weights and all(k.startswith("unet.") for k in weights)
    ups = [v for k, v in weights.items() if "lora.up" in k or "lora_B" in k]
    assert ups and any(float(v.abs().max()) > 0 for v in ups)  # B starts at zero: trained
    return weights


def test_lora_adapters_load_into_the_unet_and_equal_final_merged(
    dpo_z2_lora: RunResult, dpo_z3_lora_2ranks: RunResult
) -> None:
    """diffusers 0.42's `AudioLDMPipeline` has no `load_lora_weights`: its UNet (a
    `UNet2DConditionModel`) takes the adapter with `load_lora_adapter`, and then predicts what
    `final-merged/`'s UNet, the adapter folded in, predicts; `final-merged/` makes a waveform;
    the reference (adapters disabled) never moved."""
    from diffusers import AudioLDMPipeline

    from align_anything.families.zoo import resolve_model_path

    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(1, 4, 32, 8, generator=generator)
    embeds = torch.nn.functional.normalize(torch.randn(1, 16, generator=generator), dim=-1)
    for result in (dpo_z2_lora, dpo_z3_lora_2ranks):
        weights = adapter(result)
        pipe = AudioLDMPipeline.from_pretrained(resolve_model_path(MODEL))
        with torch.no_grad():
            base = pipe.unet(noisy, 500, encoder_hidden_states=None, class_labels=embeds).sample
        pipe.unet.load_lora_adapter(
            str(result.output_dir / "final"), prefix="unet", use_safetensors=True
        )
        loaded = [n for n, _ in pipe.unet.named_parameters() if "lora" in n]
        assert len(loaded) == len(weights)
        merged = AudioLDMPipeline.from_pretrained(str(result.output_dir / "final-merged"))
        with torch.no_grad():
            adapted = pipe.unet(noisy, 500, encoder_hidden_states=None, class_labels=embeds)
            folded = merged.unet(noisy, 500, encoder_hidden_states=None, class_labels=embeds)
        torch.testing.assert_close(adapted.sample, folded.sample, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(adapted.sample, base, rtol=1e-4, atol=1e-5)  # it did move
        before, after = result.eval("before"), result.eval("after")
        assert after["eval/mse/ref_chosen"] == before["eval/mse/ref_chosen"]
        assert after["eval/mse/policy_chosen"] != before["eval/mse/policy_chosen"]
    wave = merged("a low hum", num_inference_steps=2, audio_length_in_s=0.64,
                  generator=torch.Generator().manual_seed(0)).audios[0]  # fmt: skip
    assert wave.shape == (10240,) and np.isfinite(wave).all() and float(np.abs(wave).max()) > 0
    one, two = adapter(dpo_z2_lora), adapter(dpo_z3_lora_2ranks)
    # Adam's first steps move each weight by about lr (1e-3) whatever its gradient's size, so a
    # near-zero gradient summed in another order (2 ranks) may move a weight by up to a step
    # differently. The adapters as a whole must agree to 1% (an adapter initialised otherwise
    # differs by ~100%), every A matrix (initialised from train.seed) to a step.
    assert one.keys() == two.keys()
    diff = sum(float((two[k] - one[k]).double().square().sum()) for k in one)
    norm = sum(float(one[k].double().square().sum()) for k in one)
    assert diff**0.5 <= 0.01 * norm**0.5
    for key in (k for k in one if "lora.down" in k or "lora_A" in k):
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=2e-3)


def test_samples_are_wav_files_with_a_spectrogram_grid(runs: Runs) -> None:
    import soundfile
    from PIL import Image

    samples = runs.sft.output_dir / "samples"
    assert sorted(p.name for p in samples.iterdir()) == [
        "step-000000", "step-000000.png", "step-000002", "step-000002.png",
    ]  # fmt: skip
    for step in ("step-000000", "step-000002"):
        wav = samples / step / "p0-seed-0.wav"
        info = soundfile.info(str(wav))
        assert (info.samplerate, info.frames, info.channels) == (16000, 10240, 1)
        with Image.open(samples / f"{step}.png") as grid:
            assert grid.height >= 16 * 4  # 16 mel bins, 4 pixels each
            assert grid.width > 64  # 64 frames beside the label


def test_samples_play_in_tensorboard_as_the_wav_files(runs: Runs) -> None:
    """TensorBoard holds each step's samples as audio (the WAV's samples, 16-bit as written)
    beside the spectrogram grid."""
    import soundfile
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs.sft.output_dir / "tensorboard"), size_guidance={"audio": 0})
    events.Reload()
    assert events.Tags()["audio"] == ["samples/p0-seed-0"]
    assert "samples" in events.Tags()["images"]
    logged = {e.step: e for e in events.Audio("samples/p0-seed-0")}
    assert sorted(logged) == [0, 2]
    for step, event in logged.items():
        assert event.sample_rate == 16000
        played, rate = soundfile.read(io.BytesIO(event.encoded_audio_string), dtype="float32")
        written, _ = soundfile.read(str(runs.sft.output_dir / "samples" / f"step-{step:06d}" /
                                        "p0-seed-0.wav"), dtype="float32")  # fmt: skip
        assert rate == 16000 and played.shape == written.shape == (10240,)
        assert np.abs(played - written).max() <= 2 / 32768  # both 16-bit


def test_settings_an_audio_pipeline_cannot_take_are_refused() -> None:
    from align_anything.config import load_config
    from align_anything.errors import ConfigError
    from align_anything.families import diffusion
    from align_anything.families.diffusion.family import check_model_settings, resolution_of

    info = diffusion.inspect_pipeline(MODEL)
    assert (info.kind, info.medium, info.sampling_rate, info.hop_length, info.mel_bins) == (
        "audioldm",
        "audio",
        16000,
        160,
        16,
    )
    cfg = load_config(["task=diffusion_sft", f"model.name_or_path={MODEL}",
                       "data.audio_seconds=0.5"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"50 mel frames .* a multiple of 4 frames .* e\.g\. "
                                          r"data\.audio_seconds=0\.48 or 0\.52"):  # fmt: skip
        resolution_of(cfg, info)
    cfg = load_config(["task=diffusion_sft", f"model.name_or_path={MODEL}"])
    assert resolution_of(cfg, info) == 64  # the UNet's sample size x the VAE's scale
    cfg = load_config(["task=diffusion_sft", f"model.name_or_path={MODEL}",
                       "data.resolution=32", "data.num_frames=8"])  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        check_model_settings(cfg, info)
    assert "makes audio: leave them null" in str(caught.value)
    assert "data.resolution=32 sets an image side" in str(caught.value)
    cfg = load_config(["task=diffusion_sft", "model.name_or_path=tiny-random-sd",
                       "data.audio_seconds=1", "data.refuse_silent_audio=true"])  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        check_model_settings(cfg, diffusion.inspect_pipeline("tiny-random-sd"))
    assert ("sets the length of audio clips; tiny-random-sd is a sd pipeline, which makes "
            "images: leave it null") in str(caught.value)  # fmt: skip
    assert ("data.refuse_silent_audio=true checks audio clips; tiny-random-sd is a sd "
            "pipeline, which makes images: leave it false") in str(caught.value)  # fmt: skip


def test_another_pipeline_with_a_vocoder_is_refused_by_name(tmp_path: Path) -> None:
    import json
    import shutil

    from align_anything.errors import ModelError
    from align_anything.families import diffusion
    from align_anything.families.zoo import resolve_model_path

    folder = tmp_path / "musicldm"
    shutil.copytree(resolve_model_path(MODEL), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "MusicLDMPipeline"})
    )
    with pytest.raises(ModelError, match="is a MusicLDMPipeline .* only AudioLDMPipeline trains"):
        diffusion.inspect_pipeline(str(folder))


def test_the_planner_measures_spectrogram_latents() -> None:
    """Activations are measured at the clip's latent frames x latent mels, so they grow with
    data.audio_seconds; the vocoder counts among the frozen parts."""
    from align_anything.config import load_config
    from align_anything.families import diffusion
    from align_anything.families.diffusion.memory import denoiser_activations, estimate_memory
    from align_anything.families.diffusion.sizes import frozen_part_sizes

    info = diffusion.inspect_pipeline(MODEL)
    assert info.latent_size(64) == (32, 8)
    common = dict(samples=2, precision="fp32", gradient_checkpointing=False)
    short, long = (denoiser_activations(info, resolution=r, **common) for r in (64, 128))
    assert 1.8 < long / short < 2.1
    assert set(frozen_part_sizes(info)) == {"vae", "text_encoder", "vocoder"}
    cfg = load_config(["task=diffusion_dpo", f"model.name_or_path={MODEL}",
                       "data.audio_seconds=1.28"])  # fmt: skip
    planned = estimate_memory(cfg, world_size=1, gpus_per_node=1, precision="fp32")
    assert planned.shape == "128 mel frames x 16 mels"

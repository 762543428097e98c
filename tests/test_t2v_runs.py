"""The text-to-video family end to end, through the real entry point on the tiny random
UNet-3D (ModelScope's layout) and Wan pipelines and a few drawn clips of every file format:
every preset (z0, z2, z3, z3_offload), each with a full fine-tune and with LoRA, across
`diffusion_sft` and `diffusion_dpo` (each task meets each preset), LoRA under ZeRO-3 on 2 ranks
against the same run on 1 rank under ZeRO-0; and what comes out loads in diffusers: a full
fine-tune's `final/` through `DiffusionPipeline.from_pretrained`, which generates a video;
Wan's adapter through `WanPipeline.load_lora_weights`; the UNet-3D's (whose denoiser diffusers
loads no adapter into) as `final-merged/`.

| run | task | preset | LoRA | pipeline | ranks |
| --- | --- | --- | --- | --- | --- |
| sft_z0 | sft | z0 | - | UNet-3D | 1 |
| dpo_z0_lora | dpo | z0 | LoRA | UNet-3D | 1 |
| dpo_z3_lora_2ranks | dpo | z3 | LoRA | UNet-3D | 2 |
| dpo_z2 | dpo | z2 | - | Wan | 1 |
| sft_z2_lora | sft | z2 | LoRA | Wan | 1 |
| sft_z3 | sft | z3 | - | Wan | 1 |
| dpo_z3_offload | dpo | z3_offload | - | UNet-3D | 1 |
| sft_z3_offload_lora | sft | z3_offload | LoRA | Wan | 1 |
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import t2v_data
import torch
from conftest import RunResult, launch, run_inline
from safetensors.torch import load_file

from align_anything.families.text_to_video import motion

pytestmark = pytest.mark.slow

UNET3D, WAN = "tiny-random-t2v-unet3d", "tiny-random-wan"
FRAMES = {UNET3D: 8, WAN: 9}  # Wan's causal VAE takes 4k+1 frames
FAST = [
    "train.precision=fp32", "train.seed=7", "train.max_steps=2", "train.learning_rate=1e-3",
    "train.lr_scheduler=constant", "train.warmup_ratio=0", "data.fps=8", "data.resolution=32",
    "logging.sample_prompts=[a_red_circle_moving_left]", "logging.sample_seeds=[0]",
]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Clips of 9 frames at 8 fps: 4 captioned (mp4, webm, gif, a folder of PNG frames) and 2
    held out; 4 pairs (generic format) and 2 held out (align-anything's format)."""
    root = tmp_path_factory.mktemp("t2v-runs")
    t2v_data.captioned_folder(root / "train", 4, frames=9)
    t2v_data.captioned_folder(root / "eval", 2, frames=9)
    t2v_data.pair_files(root / "pairs", 4, frames=9)
    t2v_data.pair_files(root / "pairs-eval", 2, frames=9)
    return root


def args(data: Path, task: str, preset: str, model: str, *, lora: bool) -> list[str]:
    common = [*FAST, f"task={task}", f"deepspeed={preset}", f"model.name_or_path={model}",
              f"data.num_frames={FRAMES[model]}", f"{task}.check_samples=0",
              f"{task}.sample_steps=1", f"model.lora.enabled={str(lora).lower()}"]  # fmt: skip
    if task == "diffusion_sft":
        return [*common, f"data.path={data / 'train'}", f"data.eval_path={data / 'eval'}",
                "train.per_device_batch_size=2", "diffusion_sft.eval_draws=1"]  # fmt: skip
    return [*common, f"data.path={data / 'pairs' / 'pairs.jsonl'}",
            f"data.eval_path={data / 'pairs-eval' / 'safesora.jsonl'}",
            "diffusion_dpo.beta=10"]  # fmt: skip


def run(data: Path, tmp: pytest.TempPathFactory, name: str, task: str, preset: str, model: str,
        *, lora: bool = False, nproc: int = 1, micro: int = 2) -> RunResult:  # fmt: skip
    overrides = [*args(data, task, preset, model, lora=lora),
                 f"train.per_device_batch_size={micro}"]  # fmt: skip
    # One rank runs in this process (what a run computes and writes is tested, not how a
    # process behaves); two ranks through the deepspeed launcher. A first z3_offload run in a
    # fresh environment compiles DeepSpeed's CPU Adam (minutes).
    if nproc == 1:
        return run_inline(overrides, tmp.mktemp(name) / "run").check()
    return launch(overrides, tmp.mktemp(name) / "run", launcher="deepspeed", nproc=nproc,
                  timeout_s=600).check()  # fmt: skip


@pytest.fixture(scope="module")
def sft_z0(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "sft_z0", "diffusion_sft", "z0", UNET3D)


@pytest.fixture(scope="module")
def dpo_z0_lora(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "dpo_z0_lora", "diffusion_dpo", "z0", UNET3D, lora=True)


@pytest.fixture(scope="module")
def dpo_z3_lora_2ranks(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "dpo_z3_lora", "diffusion_dpo", "z3", UNET3D, lora=True,
               nproc=2, micro=1)  # fmt: skip


@pytest.fixture(scope="module")
def dpo_z2(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "dpo_z2", "diffusion_dpo", "z2", WAN)


@pytest.fixture(scope="module")
def sft_z2_lora(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "sft_z2_lora", "diffusion_sft", "z2", WAN, lora=True)


@pytest.fixture(scope="module")
def sft_z3(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "sft_z3", "diffusion_sft", "z3", WAN)


@pytest.fixture(scope="module")
def dpo_z3_offload(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "dpo_z3_offload", "diffusion_dpo", "z3_offload", UNET3D)


@pytest.fixture(scope="module")
def sft_z3_offload_lora(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(data, tmp_path_factory, "sft_z3_offload_lora", "diffusion_sft", "z3_offload", WAN,
               lora=True)  # fmt: skip


def base_weights(model: str, part: str) -> dict[str, torch.Tensor]:
    from align_anything.families.zoo import resolve_model_path

    return load_file(
        str(Path(resolve_model_path(model)) / part / "diffusion_pytorch_model.safetensors")
    )


def trained_whole(folder: Path, model: str, part: str) -> None:
    """`folder/part` holds every weight of the base denoiser, some of them moved."""
    weights, base = (
        load_file(str(folder / part / "diffusion_pytorch_model.safetensors")),
        base_weights(model, part),
    )
    assert set(weights) == set(base)
    assert any(not torch.equal(weights[k], base[k]) for k in base)


def trained_adapter(folder: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(folder / "pytorch_lora_weights.safetensors"))
    assert weights and all(v.numel() > 0 for v in weights.values())
    ups = [v for k, v in weights.items() if "lora_B" in k or "lora.up" in k]
    assert ups and any(float(v.abs().max()) > 0 for v in ups)  # B starts at zero: trained
    return weights


def test_every_preset_ran_its_stage_and_logged_finite_losses(
    sft_z0: RunResult, dpo_z0_lora: RunResult, dpo_z3_lora_2ranks: RunResult, dpo_z2: RunResult,
    sft_z2_lora: RunResult, sft_z3: RunResult, dpo_z3_offload: RunResult,
    sft_z3_offload_lora: RunResult,
) -> None:  # fmt: skip
    runs = [(sft_z0, 0), (dpo_z0_lora, 0), (dpo_z3_lora_2ranks, 3), (dpo_z2, 2),
            (sft_z2_lora, 2), (sft_z3, 3), (dpo_z3_offload, 3), (sft_z3_offload_lora, 3)]  # fmt: skip
    for result, stage in runs:
        assert result.zero_stage() == stage, result.output_dir
        steps = result.train_steps()
        assert [m["step"] for m in steps] == [1, 2]
        assert all(math.isfinite(m["loss"]) for m in steps)
        assert "frames (8 fps)" in result.summary_line("resolution")
    for result in (dpo_z0_lora, dpo_z3_lora_2ranks, dpo_z2, dpo_z3_offload):
        assert result.train_steps()[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for result in (sft_z3_offload_lora, dpo_z3_offload):
        assert "offload" in result.output and "cpu" in result.summary_line("ds config")
    assert "partitioned ZeRO-3 inference engine" in dpo_z3_offload.summary_line("reference")
    assert "4x8x16x16" in sft_z0.summary_line("resolution")  # [C, F, h, w] per clip
    assert "16x3x4x4" in sft_z3.summary_line("resolution")  # Wan: 9 frames -> 3 latent frames


def test_two_ranks_under_zero3_equal_one_rank_under_zero0_with_lora(
    dpo_z0_lora: RunResult, dpo_z3_lora_2ranks: RunResult
) -> None:
    """The same 2 pairs a step, split over 2 ranks (micro 1) under ZeRO-3 or whole on 1 rank
    under ZeRO-0, give the same losses: the draws depend on each pair's row alone."""
    one = {m["step"]: m for m in dpo_z0_lora.train_steps()}
    two = {m["step"]: m for m in dpo_z3_lora_2ranks.train_steps()}
    for step in (1, 2):
        for key in ("loss", "mse/policy_chosen", "mse/policy_rejected", "mse/ref_chosen"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-5), (step, key)
    for phase in ("before", "after"):
        assert dpo_z3_lora_2ranks.eval(phase)["eval/loss"] == pytest.approx(
            dpo_z0_lora.eval(phase)["eval/loss"], rel=1e-4
        )


def test_samples_are_an_animated_gif_with_a_contact_sheet(sft_z0: RunResult) -> None:
    from PIL import Image

    samples = sft_z0.output_dir / "samples"
    assert sorted(p.name for p in samples.iterdir()) == [
        "step-000000.gif", "step-000000.png", "step-000002.gif", "step-000002.png",
    ]  # fmt: skip
    with Image.open(samples / "step-000002.gif") as gif:
        assert gif.n_frames == 8
    with Image.open(samples / "step-000002.png") as sheet:
        assert sheet.width > 8 * 32  # a strip of the clip's 8 frames beside its label


def test_a_full_fine_tune_loads_in_diffusers_and_generates_a_video(
    sft_z0: RunResult, dpo_z2: RunResult, sft_z3: RunResult, dpo_z3_offload: RunResult
) -> None:
    from diffusers import DiffusionPipeline

    for result, model in ((sft_z0, UNET3D), (dpo_z2, WAN), (sft_z3, WAN), (dpo_z3_offload, UNET3D)):
        part = "transformer" if model == WAN else "unet"
        trained_whole(result.output_dir / "final", model, part)
    for result, model in ((sft_z0, UNET3D), (dpo_z2, WAN)):
        pipe = DiffusionPipeline.from_pretrained(str(result.output_dir / "final"))
        frames = pipe("a red circle moving left", num_frames=FRAMES[model], height=32, width=32,
                      num_inference_steps=2, guidance_scale=1.0, output_type="np",
                      generator=torch.Generator().manual_seed(0)).frames[0]  # fmt: skip
        assert frames.shape == (FRAMES[model], 32, 32, 3) and float(abs(frames).sum()) > 0


def test_wan_adapters_load_with_load_lora_weights(
    sft_z2_lora: RunResult, sft_z3_offload_lora: RunResult
) -> None:
    from diffusers import DiffusionPipeline

    from align_anything.families.zoo import resolve_model_path

    for result in (sft_z2_lora, sft_z3_offload_lora):
        weights = trained_adapter(result.output_dir / "final")
        pipe = DiffusionPipeline.from_pretrained(resolve_model_path(WAN))
        pipe.load_lora_weights(str(result.output_dir / "final"))
        loaded = {n for n, _ in pipe.transformer.named_parameters() if "lora" in n}
        assert len(loaded) == len(weights)


def test_unet3d_adapters_are_saved_and_merged(
    dpo_z0_lora: RunResult, dpo_z3_lora_2ranks: RunResult
) -> None:
    """diffusers loads no adapter into a `UNet3DConditionModel` (no PEFT integration): the
    adapter is written in diffusers' layout all the same, and `final-merged/` beside it is a
    whole pipeline; the reference (adapters disabled) never moved."""
    for result in (dpo_z0_lora, dpo_z3_lora_2ranks):
        weights = trained_adapter(result.output_dir / "final")
        assert all(k.startswith("unet.") for k in weights)
        trained_whole(result.output_dir / "final-merged", UNET3D, "unet")
        before, after = result.eval("before"), result.eval("after")
        assert after["eval/mse/ref_chosen"] == before["eval/mse/ref_chosen"]
        assert after["eval/mse/policy_chosen"] != before["eval/mse/policy_chosen"]
    one = load_file(str(dpo_z0_lora.output_dir / "final" / "pytorch_lora_weights.safetensors"))
    two = load_file(
        str(dpo_z3_lora_2ranks.output_dir / "final" / "pytorch_lora_weights.safetensors")
    )
    # Adam's first steps move each weight by about lr (1e-3) whatever its gradient's size, so
    # a near-zero gradient summed in another order (2 ranks) may move a weight by up to a step
    # differently. The adapters as a whole must agree to 1% (an adapter initialised otherwise
    # differs by ~100%), every A matrix (initialised from train.seed) to a step.
    assert one.keys() == two.keys()
    diff = sum(float((two[k] - one[k]).double().square().sum()) for k in one)
    norm = sum(float(one[k].double().square().sum()) for k in one)
    assert diff**0.5 <= 0.01 * norm**0.5
    for key in (k for k in one if "lora.down" in k):
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=2e-3)


def test_the_motion_check_reads_the_drawn_clips() -> None:
    """Guard of the data these runs train on: their chosen clips pass the check."""
    clip = t2v_data.clip(3, ("blue", "square", "up"), frames=9)
    assert motion.video_matches(clip, "a blue square moving up")
    assert not motion.video_matches(clip, "a blue square moving down")

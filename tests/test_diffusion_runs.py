"""The text-to-image tasks end to end, through the real entry point on the tiny random pipelines
and a few drawn shapes (tests/test_diffusion_tasks.py holds their losses to diffusers by hand):

- diffusion fine-tuning under ZeRO-2 with EMA: the start-up summary, the sample grids, `final/`
  and `final-ema/` as diffusers folders that load and sample, the held-out loss going down, and
  the export of a ZeRO-2 checkpoint equal to `final/`;
- diffusion fine-tuning of the built-in trained `tiny-t2i-shapes` on the built-in `t2i-shapes`:
  the held-out denoising loss on `t2i-shapes-val` (its 256 images at 4 fixed draws each) falls;
- Diffusion-DPO: 2 ranks under ZeRO-2 log the losses of 1 rank under ZeRO-3 (a partitioned
  reference), and a resume of the 2-rank ZeRO-2 checkpoint on 1 rank under ZeRO-3 continues
  them;
- Diffusion-DPO with LoRA under ZeRO-3 on the flow-matching SD3 pipeline: the adapter in
  `final/` is non-empty, trained, and loads with diffusers' `load_lora_weights`; the reference
  (the adapters disabled) never moves while the policy does.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from conftest import RunResult, assert_script_trained, run_inline, run_script, script_overrides

from align_anything.families.text_to_image import shapes

# End to end: the 2-rank run goes through scripts/diffusion_dpo.sh (conftest.run_script), the
# 1-rank runs are in-process (conftest.run_inline).
pytestmark = pytest.mark.slow

# Short runs: one sample image of one sampler step, no pixel check, fp32 on the CPU.
FAST = [
    "train.precision=fp32", "train.seed=7", "logging.sample_prompts=[a_red_circle]",
    "logging.sample_seeds=[0]",
]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few drawn shapes: 8 captioned images and 8 preference pairs to train on, 4 of each
    held out (Pick-a-Pic's columns for the pairs)."""
    root = tmp_path_factory.mktemp("shapes")
    rng = random.Random(3)
    combos = shapes.TRAIN_COMBOS
    shapes.write_parquet(shapes._picture_rows(rng, combos, 8), root / "images.parquet")
    shapes.write_parquet(shapes._picture_rows(rng, combos, 4), root / "images-eval.parquet")
    shapes.write_parquet(shapes._pair_rows(rng, combos, 8), root / "pairs.parquet")
    shapes.write_parquet(shapes._pair_rows(rng, combos, 4), root / "pairs-eval.parquet")
    return root


def sft_args(data: Path) -> list[str]:
    return [
        "task=diffusion_sft", "model.name_or_path=tiny-random-sd", *FAST,
        f"data.path={data / 'images.parquet'}", f"data.eval_path={data / 'images-eval.parquet'}",
        "diffusion_sft.check_samples=0", "diffusion_sft.sample_steps=1",
        "train.lr_scheduler=constant", "train.warmup_ratio=0",  # not the built-in recipe's
    ]  # fmt: skip


def dpo_args(data: Path, model: str = "tiny-random-sd") -> list[str]:
    # beta 10 rather than the main job's 1000: the loss amplifies the MSEs' last-digit
    # differences between layouts by beta, and these runs compare layouts.
    return [
        "task=diffusion_dpo", f"model.name_or_path={model}", *FAST, "diffusion_dpo.beta=10",
        f"data.path={data / 'pairs.parquet'}", f"data.eval_path={data / 'pairs-eval.parquet'}",
        "diffusion_dpo.check_samples=0", "diffusion_dpo.sample_steps=1",
        "train.learning_rate=1e-3", "train.max_steps=4",
    ]  # fmt: skip


def unet_state(folder: Path, part: str = "unet") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / part / "diffusion_pytorch_model.safetensors"))


# ---------------------------------------------------------------------------- fine-tuning


@pytest.fixture(scope="module")
def sft_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """Diffusion fine-tuning, ZeRO-2, 3 steps of 2 images, EMA, a grid every 2 steps, a
    checkpoint at step 3."""
    return run_inline(
        [
            *sft_args(data),
            "deepspeed=z2",
            "train.per_device_batch_size=2",
            "train.max_steps=3",
            "train.learning_rate=1e-3",
            "train.ema.enabled=true",
            "train.ema.decay=0.5",
            "logging.samples_every=2",
            "checkpoint.every_steps=3",
        ],  # fmt: skip
        tmp_path_factory.mktemp("sft") / "run",
    ).check()


def test_fine_tuning_summary_samples_and_held_out_loss(sft_run: RunResult) -> None:
    assert sft_run.zero_stage() == 2
    parts = sft_run.summary_line("parts")
    assert "unet" in parts and "vae" in parts and "text_encoder" in parts and "frozen" in parts
    assert "32 px" in sft_run.summary_line("resolution")
    assert "encoded 8 images" in sft_run.output or "cache hit" in sft_run.summary_line("data cache")
    assert "every 2 steps" in sft_run.summary_line("samples")
    grids = sorted(p.name for p in (sft_run.output_dir / "samples").glob("*.png"))
    assert grids == ["step-000000.png", "step-000002.png", "step-000003.png"]
    assert [m["step"] for m in sft_run.train_steps()] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and m["samples_per_second"] > 0
               for m in sft_run.train_steps())  # fmt: skip
    before, after = sft_run.eval("before")["eval/loss"], sft_run.eval("after")["eval/loss"]
    assert after < before, (before, after)


def test_fine_tuning_the_builtin_model_lowers_its_held_out_denoising_loss(
    tmp_path: Path,
) -> None:
    """The built-in recipe, shortened: 100 steps of 64 images at 3e-5 (warm-up, cosine decay)
    lower the held-out MSE of the trained base model on `t2i-shapes-val`. Measured by hand
    (2 shared CPU cores, fp32, about 30 s a run on quiet cores) with train.seed 1, 2, 3, which
    also seeds the held-out draws: 0.02396 -> 0.02359, 0.02612 -> 0.02578, 0.02628 -> 0.02596;
    the standard error of the paired difference of this estimate (256 images x 4 draws) is
    about 0.00008, so each fall is 4 to 5 of them. (The full recipe, 200 steps at 1e-4, falls
    0.0009.) The gain is small by nature: the base model already draws these shapes; what true
    captions add is their colour, which tells the denoiser most at high noise levels, where the
    epsilon MSE is small."""
    run = run_inline(
        [
            "task=diffusion_sft",
            "train.precision=fp32",
            "train.max_steps=100",
            "train.learning_rate=3e-5",
            "diffusion_sft.check_samples=0",
            "diffusion_sft.sample_steps=1",
            "logging.sample_seeds=[0]",
            "logging.sample_prompts=[a_red_circle]",
        ],  # fmt: skip
        tmp_path / "run",
    ).check()
    assert "t2i-shapes-val: kept 256 of 256 rows" in run.output
    assert "4 fixed noise draws" in run.summary_line("held-out loss")
    before, after = run.eval("before")["eval/mse"], run.eval("after")["eval/mse"]
    assert after < before, (before, after)


def test_final_and_final_ema_load_and_sample(sft_run: RunResult) -> None:
    from diffusers import DiffusionPipeline

    final, ema = sft_run.output_dir / "final", sft_run.output_dir / "final-ema"
    for folder in (final, ema):
        pipe = DiffusionPipeline.from_pretrained(str(folder))
        image = pipe("a red circle", num_inference_steps=2, height=32, width=32,
                     generator=torch.Generator().manual_seed(0), output_type="np").images[0]  # fmt: skip
        assert image.shape == (32, 32, 3) and float(abs(image).sum()) > 0
    trained, averaged = unet_state(final), unet_state(ema)
    assert set(trained) == set(averaged)
    assert any(not torch.equal(trained[k], averaged[k]) for k in trained)


def test_export_of_a_zero2_checkpoint_is_the_final_pipeline(sft_run: RunResult,
                                                            tmp_path: Path) -> None:  # fmt: skip
    from align_anything.tools.export import main as export

    out = tmp_path / "exported"
    assert export([str(sft_run.output_dir / "checkpoints" / "step-3"), "--out", str(out)]) == 0
    exported, final = unet_state(out), unet_state(sft_run.output_dir / "final")
    assert set(exported) == set(final)
    for key in final:
        torch.testing.assert_close(exported[key], final[key], rtol=0, atol=0)
    assert (out / "model_index.json").is_file() and (out / "vae").is_dir()


# ---------------------------------------------------------------------------- Diffusion-DPO


@pytest.fixture(scope="module")
def t2i_dpo_two_ranks(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """Diffusion-DPO, 2 ranks x 1 pair under ZeRO-2, 4 steps, checkpoints at 2 and 4; through
    scripts/diffusion_dpo.sh (PRESET=z2, --num_gpus 2: the deepspeed launcher)."""
    args = [*script_overrides(dpo_args(data)), "train.per_device_batch_size=1"]
    return run_script(
        "diffusion_dpo.sh", tmp_path_factory.mktemp("dpo") / "z2-2ranks",
        ["--num_gpus", "2", *args, "checkpoint.every_steps=2"], env={"PRESET": "z2"},
    ).check()  # fmt: skip


def close_steps(got: RunResult, expected: RunResult, steps: list[int]) -> None:
    """The logged losses and MSEs of `steps` agree. fp32 sums run in another order on other
    ranks and stages, and Adam's first updates (about lr·sign(g)) carry an element's last-digit
    difference whole: measured, the reference's MSEs agree to 2e-7 and the policy's to 1.4e-5
    relative by step 3; a wrong row, draw or split moves an MSE by 1e-2 or more."""
    by_step = {m["step"]: m for m in expected.train_steps()}
    lines = {m["step"]: m for m in got.train_steps()}
    assert sorted(lines) == steps
    for step in steps:
        for key in ("loss", "mse/policy_chosen", "mse/policy_rejected", "mse/ref_chosen"):
            assert lines[step][key] == pytest.approx(by_step[step][key], rel=1e-4, abs=1e-5), (
                step, key,
            )  # fmt: skip


def test_two_ranks_under_zero2_equal_one_rank_under_zero3(
    t2i_dpo_two_ranks: RunResult, data: Path, tmp_path: Path
) -> None:
    one = run_inline(
        [*dpo_args(data), "deepspeed=z3", "train.per_device_batch_size=2"], tmp_path / "z3-1rank"
    ).check()
    assert t2i_dpo_two_ranks.zero_stage() == 2 and one.zero_stage() == 3
    assert "partitioned ZeRO-3 inference engine" in one.summary_line("reference")
    assert t2i_dpo_two_ranks.train_steps()[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    close_steps(one, t2i_dpo_two_ranks, [1, 2, 3, 4])
    for phase in ("before", "after"):
        assert one.eval(phase)["eval/loss"] == pytest.approx(
            t2i_dpo_two_ranks.eval(phase)["eval/loss"], rel=1e-4
        )


def test_resume_of_the_two_rank_zero2_checkpoint_on_one_rank_under_zero3(
    t2i_dpo_two_ranks: RunResult, tmp_path: Path, data: Path
) -> None:
    step2 = t2i_dpo_two_ranks.output_dir / "checkpoints" / "step-2"
    resumed = run_inline(
        [*dpo_args(data), "deepspeed=z3", "train.per_device_batch_size=2", f"resume={step2}"],
        tmp_path / "resumed",
    ).check()
    assert "via a universal checkpoint: ZeRO-2 on 2 rank(s) -> ZeRO-3 on 1 rank(s)" in (
        resumed.output
    )
    close_steps(resumed, t2i_dpo_two_ranks, [3, 4])


def test_lora_under_zero3_saves_a_trained_adapter_diffusers_loads(
    data: Path, tmp_path: Path
) -> None:
    """The flow-matching SD3 pipeline, LoRA under ZeRO-3 (whose partitions are empty on a rank:
    the adapter is saved from the gathered weights), with the chosen images' own MSE added
    (`diffusion_dpo.sft_weight`)."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from align_anything.families.zoo import resolve_model_path

    run = run_inline(
        [
            *dpo_args(data, "tiny-random-sd3"),
            "deepspeed=z3",
            "train.per_device_batch_size=2",
            "model.lora.enabled=true",
            "train.max_steps=2",
            "diffusion_dpo.sft_weight=100",
        ],  # fmt: skip
        tmp_path / "lora",
    ).check()
    assert run.zero_stage() == 3
    assert "adapters disabled (no copy)" in run.summary_line("reference")
    # Step 1: policy = reference, so each pair's loss is ln 2 + 100·θ_w, and the batch's is
    # ln 2 plus 100 times its mean chosen MSE.
    first = run.train_steps()[0]
    assert first["loss"] == pytest.approx(math.log(2) + 100 * first["mse/policy_chosen"], rel=1e-6)
    assert first["rewards/margins"] == 0.0
    before, after = run.eval("before"), run.eval("after")
    # The reference is the base transformer: its MSEs never move; the policy's do.
    assert after["eval/mse/ref_chosen"] == before["eval/mse/ref_chosen"]
    assert after["eval/mse/policy_chosen"] != before["eval/mse/policy_chosen"]
    final = run.output_dir / "final"
    weights = load_file(str(final / "pytorch_lora_weights.safetensors"))
    assert weights and all(v.numel() > 0 for v in weights.values())
    ups = [v for k, v in weights.items() if "lora_B" in k or "lora.up" in k]
    assert ups and any(float(v.abs().max()) > 0 for v in ups)  # B starts at zero: trained
    pipe = DiffusionPipeline.from_pretrained(resolve_model_path("tiny-random-sd3"))
    pipe.load_lora_weights(str(final))
    loaded = {n for n, _ in pipe.transformer.named_parameters() if "lora" in n}
    assert len(loaded) == len(weights)


def test_script_trains_on_two_cpu_ranks(t2i_dpo_two_ranks: RunResult) -> None:
    """test_scripts.py's check of scripts/diffusion_dpo.sh, on its run above."""
    assert_script_trained(t2i_dpo_two_ranks, stage=2, steps=4)

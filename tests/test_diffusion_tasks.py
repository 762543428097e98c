"""The text-to-image tasks as objects, in this process: `DiffusionSFT` and `DiffusionDPO` on the
tiny random pipelines and a latent cache of a few drawn shapes, their losses against numbers
worked out by hand with diffusers' own scheduler and UNet (the noise and timestep each row's
seed gives); the seeding rules (a row's draw is its own; held-out draws never change); the
configs; and the memory planner's denoiser figures, counted from configs on the meta device.
No run is launched (tests/test_diffusion_runs.py launches them)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from align_anything.config import load_config
from align_anything.errors import ConfigError
from align_anything.families import diffusion, zoo
from align_anything.families.diffusion import memory as diffusion_memory
from align_anything.families.diffusion.forward import TimestepSampling, draw_seed
from align_anything.families.diffusion.latents import (
    LatentRows,
    ensure_latent_cache,
    latent_cache_folder,
    open_latent_cache,
)
from align_anything.families.pipelines import PIPELINES
from align_anything.families.text_to_image import media, shapes
from align_anything.families.text_to_image.images import read_image_source
from align_anything.tasks.diffusion.common import EVAL_STEP, Denoising
from align_anything.tasks.diffusion.dpo import DiffusionDPO
from align_anything.tasks.diffusion.sft import DiffusionSFT, check
from align_anything.training import memory_plan as plan
from align_anything.training.task import LossOutput, Task

sys.path.insert(0, str(Path(__file__).parent))
from test_diffusion_models import SD15_UNET, SDXL_UNET  # noqa: E402

SEED = 42


def encoded_rows(tmp: Path, name: str, kind: str, parts: diffusion.FrozenParts) -> LatentRows:
    """A few drawn shapes (captioned, or Pick-a-Pic pairs) encoded into a latent cache."""
    rng = random.Random(1)
    rows = (shapes._pair_rows if kind == "pairs" else shapes._picture_rows)(
        rng, shapes.TRAIN_COMBOS, 4
    )
    path = tmp / f"{name}.parquet"
    shapes.write_parquet(rows, path)
    source = read_image_source(str(path), kind)
    key = media.latent_key_parts(source, resolution=32, encoder=name)
    ensure_latent_cache(
        source, key, root=tmp, resolution=32, refs=media.image_refs(source),
        prepare=media.cropper(32), encode_media=parts.encode_images,
        encode_prompts=parts.encode_prompts,
    )  # fmt: skip
    images = open_latent_cache(latent_cache_folder(tmp, key))
    return LatentRows(images, range(len(images)))


@dataclasses.dataclass
class Setup:
    info: diffusion.PipelineInfo
    parts: diffusion.FrozenParts
    unet: torch.nn.Module
    images: LatentRows
    pairs: LatentRows


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    tmp = tmp_path_factory.mktemp("t2i")
    info = diffusion.inspect_pipeline("tiny-random-sd")
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    unet = diffusion.load_denoiser(info, dtype=torch.float32).eval()
    return Setup(info, parts, unet, encoded_rows(tmp, "images", "captioned", parts),
                 encoded_rows(tmp, "pairs", "pairs", parts))  # fmt: skip


def denoising(setup: Setup) -> Denoising:
    return Denoising(
        info=setup.info, scheduler=setup.parts.noise_scheduler, sampling=TimestepSampling(),
        seed=SEED, dtype=torch.float32, device=torch.device("cpu"), guidance=3.5,
    )  # fmt: skip


def by_hand(unet, setup: Setup, latents, embeds, step, position) -> tuple[float, int]:
    """One image's epsilon MSE with diffusers' own scheduler and UNet, the noise and timestep
    drawn as the row's seed documents: a generator seeded by draw_seed(seed, step, position),
    first the noise, then the timestep."""
    generator = torch.Generator().manual_seed(draw_seed(SEED, step, position))
    noise = torch.randn(tuple(latents.shape), generator=generator)
    t = torch.randint(0, 1000, (1,), generator=generator)
    noisy = setup.parts.noise_scheduler.add_noise(latents[None], noise[None], t)
    with torch.no_grad():
        prediction = unet(noisy, t, encoder_hidden_states=embeds[None]).sample
    return float((prediction - noise[None]).pow(2).mean()), int(t)


@pytest.mark.parametrize("cls", [DiffusionSFT, DiffusionDPO])
def test_every_diffusion_task_has_what_the_loop_calls(cls: type) -> None:
    members = [name for name in dir(Task) if not name.startswith("_")]
    fields = getattr(cls, "__dataclass_fields__", {})
    assert [name for name in members if not hasattr(cls, name) and name not in fields] == []


def test_sft_loss_is_the_mean_mse_of_each_rows_own_draw(setup: Setup) -> None:
    task = DiffusionSFT(policy=setup.unet, denoise=denoising(setup), min_snr_gamma=None,
                        pictures=None)  # fmt: skip
    rows = [setup.images[1].at(3), setup.images[2].at(3)]
    batch = task.collate(rows)
    assert task.count_items(batch) == 2 and task.count_tokens(batch) == 0
    with torch.no_grad():
        out = task.loss(batch, normalizer=4.0, training=True)
    assert isinstance(out, LossOutput) and set(out.losses) == {"policy"}
    tensors = setup.images.entry.batch([1, 2])
    expected = [
        by_hand(setup.unet, setup, tensors["latents"][i], tensors["prompt_embeds"][i], 3, row)[0]
        for i, row in enumerate((1, 2))
    ]
    assert float(out.metrics["mse"]) == pytest.approx(sum(expected), rel=1e-5)
    assert float(out.metrics["loss"]) == pytest.approx(sum(expected), rel=1e-5)
    assert float(out.losses["policy"]) == pytest.approx(sum(expected) / 4.0, rel=1e-5)


def test_min_snr_weights_the_mse_by_hand(setup: Setup) -> None:
    gamma = 5.0
    task = DiffusionSFT(policy=setup.unet, denoise=denoising(setup), min_snr_gamma=gamma,
                        pictures=None)  # fmt: skip
    with torch.no_grad():
        out = task.loss(task.collate([setup.images[0].at(7)]), normalizer=1.0, training=True)
    tensors = setup.images.entry.batch([0])
    mse, t = by_hand(setup.unet, setup, tensors["latents"][0], tensors["prompt_embeds"][0], 7, 0)
    alpha = float(setup.parts.noise_scheduler.alphas_cumprod[t])
    snr = alpha / (1 - alpha)
    assert float(out.metrics["mse"]) == pytest.approx(mse, rel=1e-5)
    assert float(out.metrics["loss"]) == pytest.approx(mse * min(snr, gamma) / snr, rel=1e-5)


def test_a_held_out_images_loss_is_the_mean_over_its_eval_draws(setup: Setup) -> None:
    """With eval_draws K, a held-out image's loss is the mean of its K draws' MSEs, the k-th
    seeded by (seed, EVAL_STEP + k, row) (the first the draw of one-draw evaluation; min-SNR
    weights each draw by its own noise level); a training row still gets one draw."""
    gamma = 5.0
    denoise = dataclasses.replace(denoising(setup), eval_draws=3)
    task = DiffusionSFT(policy=setup.unet, denoise=denoise, min_snr_gamma=gamma, pictures=None)
    batch = task.collate([setup.images[1], setup.images[3]])
    assert len(batch.all_draws) == 3 and task.count_items(batch) == 2
    assert len(task.collate([setup.images[1].at(4)]).all_draws) == 1
    with torch.no_grad():
        out = task.loss(batch, normalizer=1.0, training=False)
    tensors = setup.images.entry.batch([1, 3])
    mses, losses = [], []
    for i, row in enumerate((1, 3)):
        for k in range(3):
            mse, t = by_hand(setup.unet, setup, tensors["latents"][i], tensors["prompt_embeds"][i],
                             EVAL_STEP + k, row)  # fmt: skip
            alpha = float(setup.parts.noise_scheduler.alphas_cumprod[t])
            snr = alpha / (1 - alpha)
            mses.append(mse / 3)
            losses.append(mse * min(snr, gamma) / snr / 3)
    assert float(out.metrics["mse"]) == pytest.approx(sum(mses), rel=1e-5)
    assert float(out.metrics["loss"]) == pytest.approx(sum(losses), rel=1e-5)
    one = DiffusionSFT(policy=setup.unet, denoise=denoising(setup), min_snr_gamma=None,
                       pictures=None)  # fmt: skip
    with torch.no_grad():
        first = one.loss(one.collate([setup.images[1], setup.images[3]]), normalizer=1.0,
                         training=False)  # fmt: skip
    assert float(first.metrics["mse"]) == pytest.approx(sum(mses[0::3]) * 3, rel=1e-5)


def test_a_rows_draw_is_its_own_and_held_out_draws_never_change(setup: Setup) -> None:
    denoise = denoising(setup)
    alone = denoise.collate_images([setup.images[2].at(5)]).draw
    together = denoise.collate_images([setup.images[0].at(5), setup.images[2].at(5)]).draw
    assert torch.equal(alone.noise[0], together.noise[1])
    assert torch.equal(alone.timesteps[0], together.timesteps[1])
    later = denoise.collate_images([setup.images[2].at(6)]).draw
    assert not torch.equal(alone.noise[0], later.noise[0])  # another step, another draw
    held_out = [denoise.collate_images([setup.images[2]]).draw for _ in range(2)]
    assert torch.equal(held_out[0].noise, held_out[1].noise)
    generator = torch.Generator().manual_seed(draw_seed(SEED, EVAL_STEP, 2))
    assert torch.equal(held_out[0].noise[0], torch.randn(4, 16, 16, generator=generator))


def perturbed(unet: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    policy = copy.deepcopy(unet)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator) * param.std())
    return policy


@pytest.mark.parametrize(
    ("loss_type", "sft_weight"), [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("sigmoid", 20.0)]
)
def test_dpo_loss_by_hand_with_shared_noise_and_timestep(
    setup: Setup, loss_type: str, sft_weight: float
) -> None:
    beta = 50.0
    policy = perturbed(setup.unet)
    task = DiffusionDPO(policy=policy, reference=setup.unet, denoise=denoising(setup),
                        beta=beta, loss_type=loss_type, pictures=None,
                        sft_weight=sft_weight)  # fmt: skip
    rows = [setup.pairs[0].at(2), setup.pairs[3].at(2)]
    with torch.no_grad():
        out = task.loss(task.collate(rows), normalizer=2.0, training=True)
    chosen, rejected = setup.pairs.entry.batch([0, 3])
    losses, margins = [], []
    for i, row in enumerate((0, 3)):
        embeds = chosen["prompt_embeds"][i]
        theta_w, t_w = by_hand(policy, setup, chosen["latents"][i], embeds, 2, row)
        theta_l, t_l = by_hand(policy, setup, rejected["latents"][i], embeds, 2, row)
        ref_w, _ = by_hand(setup.unet, setup, chosen["latents"][i], embeds, 2, row)
        ref_l, _ = by_hand(setup.unet, setup, rejected["latents"][i], embeds, 2, row)
        assert t_w == t_l  # one draw per pair
        logits = (ref_w - ref_l) - (theta_w - theta_l)
        # the type's loss, plus the chosen image's own MSE at sft_weight
        losses.append({
            "sigmoid": math.log1p(math.exp(-beta * logits)),
            "hinge": max(0.0, 1 - beta * logits),
            "ipo": (logits - 1 / (2 * beta)) ** 2,
        }[loss_type] + sft_weight * theta_w)  # fmt: skip
        margins.append(beta * logits)
    assert float(out.metrics["loss"]) == pytest.approx(sum(losses), rel=1e-4, abs=1e-7)
    assert float(out.losses["policy"]) == pytest.approx(sum(losses) / 2.0, rel=1e-4, abs=1e-7)
    # A margin is β times a difference of four MSEs of about 0.03: the batched forward and the
    # one-image forwards above round each MSE differently (convolutions of another batch size;
    # 2e-5 relative measured with one thread), so the margin is compared to β·2e-6 as well.
    assert float(out.metrics["rewards/margins"]) == pytest.approx(
        sum(margins), rel=1e-3, abs=beta * 2e-6
    )


@pytest.mark.parametrize("name", ["tiny-random-sd-v", "tiny-random-sdxl", "tiny-random-sd3",
                                  "tiny-random-flux"])  # fmt: skip
def test_dpo_at_the_start_is_ln2_on_every_family(name: str, tmp_path: Path) -> None:
    """Policy = reference: the sigmoid loss is ln 2 exactly, on each kind's conditioning
    (v-prediction, SDXL's pooled embeddings and time ids, SD3's and Flux's flow target)."""
    info = diffusion.inspect_pipeline(name)
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    unet = diffusion.load_denoiser(info, dtype=torch.float32)
    pairs = encoded_rows(tmp_path, name, "pairs", parts)
    denoise = Denoising(info=info, scheduler=parts.noise_scheduler, sampling=TimestepSampling(),
                        seed=SEED, dtype=torch.float32, device=torch.device("cpu"),
                        guidance=3.5)  # fmt: skip
    task = DiffusionDPO(policy=unet, reference=unet, denoise=denoise, beta=1000.0,
                        loss_type="sigmoid", pictures=None)  # fmt: skip
    out = task.loss(task.collate([pairs[0].at(0), pairs[1].at(0)]), normalizer=2.0, training=True)
    assert float(out.metrics["loss"]) == pytest.approx(2 * math.log(2), abs=1e-6)
    out.losses["policy"].backward()
    assert all(p.grad is not None for p in unet.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------- configs


def test_the_diffusion_task_configs_compose() -> None:
    for task in ("diffusion_sft", "diffusion_dpo"):
        cfg = load_config([f"task={task}", "model.name_or_path=tiny-random-sd"])
        assert cfg.section() is not None and cfg.model.lora.target_modules == "default"
    cfg = load_config(["task=diffusion_dpo", "diffusion_dpo.loss_type=ipo"])
    assert cfg.diffusion_dpo.loss_type == "ipo"


def test_text_data_settings_are_refused_for_images() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["task=diffusion_dpo", "data.format=preference",
                     "data.path=[{path: a.parquet}, {path: b.parquet}]"])  # fmt: skip
    message = str(err.value)
    assert "data.format='preference' names a text format" in message
    assert "data.path is a list of sources; diffusion_dpo reads one source" in message
    with pytest.raises(ConfigError, match="diffusion_dpo.loss_type"):
        load_config(["task=diffusion_dpo", "diffusion_dpo.loss_type=cpo"])


def test_min_snr_on_a_flow_family_is_an_error() -> None:
    cfg = load_config(["task=diffusion_sft", "diffusion_sft.min_snr_gamma=5.0"])
    flow = SimpleNamespace(
        name="tiny-random-sd3", info=diffusion.inspect_pipeline("tiny-random-sd3")
    )
    with pytest.raises(ConfigError, match="min-SNR weighting is for epsilon and v-prediction"):
        check(cfg, flow)
    check(cfg, SimpleNamespace(name="sd", info=diffusion.inspect_pipeline("tiny-random-sd")))


# ---------------------------------------------------------------------------- the planner


def test_activations_are_measured_on_meta_and_scale_as_they_should() -> None:
    """SD 1.5's UNet at 512 px, from its config alone: twice the images keep twice the
    activations; twice the side about four times (attention is linear in the tokens as a
    memory-efficient kernel keeps it); checkpointing keeps a small share."""
    base = diffusion.inspect_pipeline("tiny-random-sd")
    info = dataclasses.replace(base, denoiser_config=SD15_UNET, vae_scale_factor=8)
    one = diffusion_memory.denoiser_activations(info, resolution=512, samples=1, precision="bf16",
                                    gradient_checkpointing=False)  # fmt: skip
    two = diffusion_memory.denoiser_activations(info, resolution=512, samples=2, precision="bf16",
                                    gradient_checkpointing=False)  # fmt: skip
    small = diffusion_memory.denoiser_activations(info, resolution=256, samples=1, precision="bf16",
                                      gradient_checkpointing=False)  # fmt: skip
    saved = diffusion_memory.denoiser_activations(info, resolution=512, samples=1, precision="bf16",
                                      gradient_checkpointing=True)  # fmt: skip
    fp32 = diffusion_memory.denoiser_activations(info, resolution=512, samples=1, precision="fp32",
                                     gradient_checkpointing=False)  # fmt: skip
    assert two == pytest.approx(2 * one, rel=0.01)
    assert 3.5 < one / small < 4.5
    assert fp32 == pytest.approx(2 * one, rel=0.05)
    assert saved < one / 4
    assert 0.5 * 2**30 < one < 2 * 2**30  # measured: 0.92 GiB (README)


def config_only_sdxl(folder: Path) -> Path:
    """An SDXL-shaped pipeline folder with configs and no weights: the real SDXL UNet and VAE
    configs, the tiny text encoders (a few thousand parameters, next to nothing)."""
    shutil.copytree(zoo.resolve_model_path("tiny-random-sdxl"), folder)
    unet = json.loads((folder / "unet" / "config.json").read_text())
    unet = {k: v for k, v in unet.items() if k.startswith("_")} | SDXL_UNET
    (folder / "unet" / "config.json").write_text(json.dumps(unet))
    vae = json.loads((folder / "vae" / "config.json").read_text())
    vae.update(block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32,
               down_block_types=["DownEncoderBlock2D"] * 4, sample_size=1024,
               up_block_types=["UpDecoderBlock2D"] * 4, scaling_factor=0.13025)  # fmt: skip
    (folder / "vae" / "config.json").write_text(json.dumps(vae))
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    return folder


def test_the_planner_knows_an_sdxl_unet_without_its_weights(tmp_path: Path) -> None:
    """deepspeed=auto for Diffusion-DPO of SDXL at 1024 px, micro-batch 1 (a pair: two images
    keep activations), bf16, on one 24 GiB device: full fine-tuning (2.57B parameters, at least
    16 bytes each of model states, and a frozen 16-bit copy as the reference) fits only with
    ZeRO-3 offloading the model states; with LoRA the 16-bit UNet, the adapters' states and the
    pair's activations (about 14 GiB) fit without ZeRO; checkpointing keeps about 1 GiB."""
    folder = config_only_sdxl(tmp_path / "sdxl")
    common = ["task=diffusion_dpo", f"model.name_or_path={folder}", "train.precision=bf16",
              "train.per_device_batch_size=1", "data.resolution=1024",
              "train.memory_budget_gb=24"]  # fmt: skip
    budget = 24 * 2**30

    def estimates_of(overrides: list[str]) -> list:
        return plan.plan(load_config(overrides), PIPELINES.estimate_memory, world_size=1)[
            0
        ].estimates

    figures = plan.plan(load_config(common), PIPELINES.estimate_memory, world_size=1)[0]
    estimates, sizes = figures.estimates, figures.sizes
    assert sizes.total == 2_567_463_684
    by_name = {e.preset: e for e in estimates}
    assert by_name["z0"].model_states > 16 * sizes.total * 0.99  # at least the ZeRO paper's 16 B
    assert by_name["z0"].reference > 2 * sizes.total  # the frozen base UNet in 16-bit
    assert 8 * 2**30 < by_name["z0"].activations < 20 * 2**30
    assert plan.choose(estimates, budget)[0].preset == "z3_offload"
    lora = estimates_of([*common, "model.lora.enabled=true"])
    assert lora[0].reference < by_name["z0"].reference / 10  # no copy of the UNet
    assert plan.choose(lora, budget)[0].preset == "z0"
    checkpointed = estimates_of([*common, "speed.gradient_checkpointing=true"])
    assert checkpointed[0].activations < 2 * 2**30

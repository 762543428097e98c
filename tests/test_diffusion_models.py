"""Text-to-image pipelines (`models/diffusion/`): recognising a folder's kind and parts, the
errors for folders that are not usable pipelines, frozen parts, parameter counts from configs
on the meta device (SD 1.5, SDXL, Flux), denoiser LoRA saved in the format diffusers'
`load_lora_weights` reads, and sampling to a labelled grid."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DIST_ENV_VARS, free_port

from align_anything.errors import ConfigError, ModelError
from align_anything.families import diffusion
from align_anything.families.diffusion import adapters, sampling
from align_anything.families.diffusion.sizes import denoiser_sizes

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("name", "kind", "prediction", "denoiser", "encoders"),
    [
        ("tiny-random-sd", "sd", "epsilon", "unet", ("text_encoder",)),
        ("tiny-random-sd-v", "sd", "v_prediction", "unet", ("text_encoder",)),
        ("tiny-random-sdxl", "sdxl", "epsilon", "unet", ("text_encoder", "text_encoder_2")),
        ("tiny-random-sd3", "sd3", "flow", "transformer",
         ("text_encoder", "text_encoder_2", "text_encoder_3")),
        ("tiny-random-flux", "flux", "flow", "transformer", ("text_encoder", "text_encoder_2")),
    ],
)  # fmt: skip
def test_kinds_are_recognised(name, kind, prediction, denoiser, encoders) -> None:
    info = diffusion.inspect_pipeline(name)
    assert (info.kind, info.prediction, info.denoiser_part) == (kind, prediction, denoiser)
    assert info.text_encoders == encoders
    assert info.tokenizers == tuple(e.replace("text_encoder", "tokenizer") for e in encoders)
    assert info.vae_scale_factor == 2 and info.latent_channels == 4
    flow = kind in ("sd3", "flux")
    assert info.shift_factor == (0.0609 if flow else 0.0)
    assert info.scaling_factor == (1.5035 if flow else 0.18215)


def _copy(name: str, dest: Path) -> Path:
    source = diffusion.inspect_pipeline(name).path
    return Path(shutil.copytree(source, dest))


def test_a_folder_without_model_index_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"model_index.json is missing \(found: nothing\)"):
        diffusion.inspect_pipeline(str(tmp_path))
    folder = _copy("tiny-random-sd", tmp_path / "pipe")
    (folder / "model_index.json").unlink()
    with pytest.raises(
        ModelError,
        match=r"found: align_anything_builtin.json, scheduler, text_encoder, tokenizer, unet, vae",
    ):
        diffusion.inspect_pipeline(str(folder))
    with pytest.raises(ModelError, match="no such folder"):
        diffusion.inspect_pipeline(str(tmp_path / "nowhere"))
    with pytest.raises(ModelError, match="did you mean 'tiny-random-sd3'"):
        diffusion.inspect_pipeline("tiny-random-sd33")


def test_a_causal_lm_is_refused_with_the_fix() -> None:
    with pytest.raises(ModelError, match="is a transformers language model: a diffusion task"):
        diffusion.inspect_pipeline("tiny-random-llama")


def test_a_pipeline_given_to_a_language_model_task_is_refused() -> None:
    from align_anything.families.language.loading import load_config, load_tokenizer

    with pytest.raises(ModelError, match="is a diffusers text-to-image pipeline"):
        load_config("tiny-random-sd")
    with pytest.raises(ModelError, match="train it with a diffusion task"):
        load_tokenizer("tiny-random-sdxl")


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    folder = _copy("tiny-random-sdxl", tmp_path / "pipe")
    shutil.rmtree(folder / "text_encoder_2")
    with pytest.raises(ModelError, match=r"lacks text_encoder_2/ \(named in model_index.json"):
        diffusion.inspect_pipeline(str(folder))
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = [None, None]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"scheduler \(not named in model_index.json\)"):
        diffusion.inspect_pipeline(str(folder))


def test_sd3_without_t5_is_accepted(tmp_path: Path) -> None:
    # Real SD3 folders may leave the T5 out (the pipeline then uses zeros in its place).
    folder = _copy("tiny-random-sd3", tmp_path / "pipe")
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder_3"] = index["tokenizer_3"] = [None, None]
    (folder / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(folder / "text_encoder_3")
    info = diffusion.inspect_pipeline(str(folder))
    assert info.text_encoders == ("text_encoder", "text_encoder_2")
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    assert parts.encode_prompts(["a cat"])["prompt_embeds"].shape[0] == 1


def test_pickled_weights_are_not_loaded(tmp_path: Path) -> None:
    folder = _copy("tiny-random-sd", tmp_path / "pipe")
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".bin"))  # the name only: nothing is unpickled
    info = diffusion.inspect_pipeline(str(folder))
    with pytest.raises(ModelError, match="only diffusion_pytorch_model.bin: pickled weights"):
        diffusion.load_denoiser(info, dtype=torch.float32)


def test_frozen_parts_and_trainable_denoiser() -> None:
    info = diffusion.inspect_pipeline("tiny-random-sdxl")
    parts = diffusion.load_frozen_parts(info, dtype=torch.bfloat16)
    for module in [parts.vae, *parts.text_encoders.values()]:
        assert not module.training
        assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in module.parameters())
    assert type(parts.noise_scheduler).__name__ == "DDPMScheduler"
    assert parts.noise_scheduler.config.prediction_type == "epsilon"
    denoiser = diffusion.load_denoiser(info, dtype=torch.bfloat16)
    assert denoiser.training
    assert all(p.requires_grad and p.dtype == torch.bfloat16 for p in denoiser.parameters())
    flow = diffusion.load_frozen_parts(diffusion.inspect_pipeline("tiny-random-flux"),
                                       dtype=torch.float32)  # fmt: skip
    assert type(flow.noise_scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert flow.max_sequence_length == 32  # the tiny T5 tokenizer's model_max_length


@pytest.mark.parametrize("name", ["tiny-t2i-shapes", "tiny-random-sdxl", "tiny-random-sd3"])
def test_the_bucket_width_squared_is_one_layer_weight(name: str) -> None:
    """DeepSpeed's "auto" reduce bucket (width²) is one of the denoiser's layer weights, as a
    language model's h² is one h x h projection: a UNet's c -> c 3x3 convolution kernel (c, the
    widest block's channels; with c² nearly every convolution's gradient overflowed the bucket
    and ZeRO-2 reduced gradients one at a time), a transformer's (3d)² its largest block weight,
    the modulation Linear(d, 6d) (with d², most of its gradients overflowed the bucket)."""
    info = diffusion.inspect_pipeline(name)
    denoiser = diffusion.load_denoiser(info, dtype=torch.float32)
    shapes = {tuple(p.shape) for p in denoiser.parameters()}
    config = info.denoiser_config
    if info.kind in ("sd", "sdxl"):
        c = max(config["block_out_channels"])
        assert (c, c, 3, 3) in shapes
        assert diffusion.bucket_width(info) ** 2 == c * c * 3 * 3
    else:
        d = config["num_attention_heads"] * config["attention_head_dim"]
        assert (6 * d, d) in shapes
        assert diffusion.bucket_width(info) ** 2 == 9 * d * d
        blocks = [p for n, p in denoiser.named_parameters() if n.startswith("transformer_blocks")]
        assert max(p.numel() for p in blocks) <= diffusion.bucket_width(info) ** 2


def test_encoder_identity_follows_the_encoders_only(tmp_path: Path) -> None:
    folder = _copy("tiny-random-sd", tmp_path / "pipe")
    info = diffusion.inspect_pipeline(str(folder))
    first = diffusion.encoder_identity(info, max_sequence_length=None, dtype=torch.float32)
    assert first == diffusion.encoder_identity(info, max_sequence_length=None, dtype=torch.float32)
    assert first != diffusion.encoder_identity(info, max_sequence_length=None, dtype=torch.bfloat16)
    (folder / "unet" / "notes.txt").write_text("the denoiser is not an encoder")
    assert first == diffusion.encoder_identity(info, max_sequence_length=None, dtype=torch.float32)
    config = folder / "text_encoder" / "config.json"
    config.write_text(config.read_text().replace('"hidden_act"', '"note": 1, "hidden_act"'))
    assert first != diffusion.encoder_identity(info, max_sequence_length=None, dtype=torch.float32)


# Configs of the real denoisers (their config.json, as dicts: no download), with their well
# known parameter counts.
SD15_UNET = dict(
    act_fn="silu", attention_head_dim=8, block_out_channels=[320, 640, 1280, 1280],
    center_input_sample=False, cross_attention_dim=768,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"], downsample_padding=1,
    flip_sin_to_cos=True, freq_shift=0, in_channels=4, layers_per_block=2,
    mid_block_scale_factor=1, norm_eps=1e-5, norm_num_groups=32, out_channels=4,
    sample_size=64, up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
)  # fmt: skip
SDXL_UNET = dict(
    addition_embed_type="text_time", addition_time_embed_dim=256, attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    in_channels=4, layers_per_block=2, norm_num_groups=32, out_channels=4,
    projection_class_embeddings_input_dim=2816, sample_size=128,
    transformer_layers_per_block=[1, 2, 10], use_linear_projection=True,
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
)  # fmt: skip
FLUX_DEV = dict(
    attention_head_dim=128, guidance_embeds=True, in_channels=64, joint_attention_dim=4096,
    num_attention_heads=24, num_layers=19, num_single_layers=38, patch_size=1,
    pooled_projection_dim=768, axes_dims_rope=[16, 56, 56],
)  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "cls", "config", "expected"),
    [
        ("sd", "UNet2DConditionModel", SD15_UNET, 859_520_964),  # SD 1.5: "0.86B"
        ("sdxl", "UNet2DConditionModel", SDXL_UNET, 2_567_463_684),  # SDXL base: "2.6B"
        ("flux", "FluxTransformer2DModel", FLUX_DEV, 11_901_408_320),  # Flux.1-dev: "12B"
    ],
)
def test_denoiser_sizes_from_config_on_meta(kind, cls, config, expected) -> None:
    base = diffusion.inspect_pipeline("tiny-random-sd")
    info = dataclasses.replace(base, kind=kind, denoiser_class=cls, denoiser_config=config)
    sizes = denoiser_sizes(info)
    assert sizes.total == sizes.trainable == expected
    assert 0 < sizes.largest_layer < expected


def test_lora_sizes_on_meta() -> None:
    base = diffusion.inspect_pipeline("tiny-random-sd")
    info = dataclasses.replace(
        base, denoiser_class="UNet2DConditionModel", denoiser_config=SD15_UNET
    )
    with torch.device("meta"):
        unet = diffusion.empty_denoiser(info)
    # r·(in + out) for every attention projection LoRA adapts, counted on the bare model.
    targets = adapters.UNET_TARGETS
    expected = sum(
        4 * (m.in_features + m.out_features)
        for name, m in unet.named_modules()
        if isinstance(m, torch.nn.Linear) and any(name.endswith(f".{t}") for t in targets)
    )
    sizes = denoiser_sizes(info, adapters=dict(r=4, alpha=4, dropout=0.0))
    assert sizes.trainable == expected == 797_184  # the well-known 3.2 MB SD 1.5 LoRA at r=4
    assert sizes.total == 859_520_964 + expected


def _inputs(info, batch: int = 2) -> tuple[tuple, dict]:
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, 4, 16, 16, generator=generator)
    if info.kind in ("sd", "sdxl"):
        width = 32 if info.kind == "sd" else 64
        kwargs = {"encoder_hidden_states": torch.randn(batch, 77, width, generator=generator)}
        if info.kind == "sdxl":
            kwargs["added_cond_kwargs"] = {
                "text_embeds": torch.randn(batch, 32, generator=generator),
                "time_ids": torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * batch),
            }
        return (latents, torch.tensor([10, 700])), kwargs
    return (), {
        "hidden_states": latents, "timestep": torch.tensor([100.0, 700.0]),
        "encoder_hidden_states": torch.randn(batch, 20, 32, generator=generator),
        "pooled_projections": torch.randn(batch, 64, generator=generator),
    }  # fmt: skip


@pytest.mark.parametrize(
    "name",
    ["tiny-random-sd", "tiny-random-sd3", pytest.param("tiny-random-sdxl", marks=pytest.mark.slow)],
)
def test_lora_adapter_loads_into_a_fresh_pipeline(name: str, tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    info = diffusion.inspect_pipeline(name)
    denoiser = diffusion.load_denoiser(info, dtype=torch.float32)
    args, kwargs = _inputs(info)
    with torch.no_grad():
        base = denoiser(*args, **kwargs).sample
    diffusion.add_denoiser_adapters(denoiser, kind=info.kind, r=4, alpha=8, dropout=0.0)
    trainable = {n for n, p in denoiser.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # stands in for training: B = 0 at the start would save a no-op
        for name_, param in denoiser.named_parameters():
            if "lora_B" in name_:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        adapted = denoiser(*args, **kwargs).sample
        with diffusion.adapters_disabled(denoiser):
            torch.testing.assert_close(denoiser(*args, **kwargs).sample, base)
    assert (adapted - base).abs().max() > 1e-3
    out = diffusion.save_denoiser_adapter(
        denoiser, denoiser.state_dict(), tmp_path / "adapter", kind=info.kind,
        denoiser_part=info.denoiser_part,
    )  # fmt: skip
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    pipe = DiffusionPipeline.from_pretrained(str(info.path))
    pipe.load_lora_weights(str(out))  # alpha 8 / r 4: the scale 2 comes from the saved metadata
    fresh = getattr(pipe, info.denoiser_part)
    with torch.no_grad():
        torch.testing.assert_close(fresh(*args, **kwargs).sample, adapted, rtol=1e-5, atol=1e-6)
    adapters.merge_adapters(denoiser)
    assert not any("lora_" in n for n, _ in denoiser.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(denoiser(*args, **kwargs).sample, adapted, rtol=1e-5, atol=1e-5)


def test_export_from_a_state_dict_with_a_merged_adapter(tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    info = diffusion.inspect_pipeline("tiny-random-sd3")
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    lora = dict(r=2, alpha=4, dropout=0.0)
    trained = diffusion.load_denoiser(info, dtype=torch.float32)
    diffusion.add_denoiser_adapters(trained, kind="sd3", **lora)
    with torch.no_grad():  # stands in for training
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.fill_(0.05)
    args, kwargs = _inputs(info)
    with torch.no_grad():
        expected = trained(*args, **kwargs).sample
    # What rank 0 gets from the engine: the full state dict (here: of the local model).
    plain = diffusion.denoiser_from_state_dict(info, trained.state_dict(), adapters=lora)
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    out = diffusion.save_pipeline(parts, plain, tmp_path / "final")
    loaded = DiffusionPipeline.from_pretrained(str(out))
    assert type(loaded).__name__ == "StableDiffusion3Pipeline"
    assert loaded.text_encoder_3 is not None and loaded.scheduler.config.shift == 3.0
    with torch.no_grad():
        fresh = loaded.transformer(*args, **kwargs).sample
    torch.testing.assert_close(fresh, expected, rtol=1e-5, atol=1e-5)


def test_an_empty_adapter_is_not_saved(tmp_path: Path) -> None:
    info = diffusion.inspect_pipeline("tiny-random-sd")
    denoiser = diffusion.load_denoiser(info, dtype=torch.float32)
    diffusion.add_denoiser_adapters(denoiser, kind="sd", r=2, alpha=2, dropout=0.0)
    # What a ZeRO-3 rank's own parameters look like: empty partitions.
    partitions = {k: torch.empty(0) for k in denoiser.state_dict()}
    with pytest.raises(RuntimeError, match="empty tensors"):
        diffusion.save_denoiser_adapter(
            denoiser, partitions, tmp_path / "a", kind="sd", denoiser_part="unet"
        )
    assert not (tmp_path / "a").exists()


def test_lora_targets_are_checked() -> None:
    info = diffusion.inspect_pipeline("tiny-random-sd")
    denoiser = diffusion.load_denoiser(info, dtype=torch.float32)
    with pytest.raises(
        ConfigError, match=r"'to_qq' names no module.*did you mean 'to_q'.*to_out\.0"
    ):
        diffusion.add_denoiser_adapters(
            denoiser, kind="sd", r=2, alpha=2, dropout=0.0, target_modules=["to_k", "to_qq"]
        )
    assert diffusion.default_denoiser_targets("flux")[-1] == "to_add_out"


def test_sampling_is_seeded_per_image_and_the_grid_is_labelled(tmp_path: Path) -> None:
    from PIL import Image

    # SD3: the cheapest denoiser to sample from (and its T5 prompt length is passed on)
    info = diffusion.inspect_pipeline("tiny-random-sd3")
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    denoiser = diffusion.load_denoiser(info, dtype=torch.float32)
    prompts, seeds = ["a red circle", "a blue square"], [11, 12]
    together = diffusion.sample_images(
        parts, prompts, seeds, resolution=32, steps=2, batch_size=2, denoiser=denoiser
    )
    assert denoiser.training  # back in training mode afterwards
    # One at a time, through a context that yields the denoiser (as ZeRO-3's gathering does):
    # each image's noise comes from its own seed, so the batch does not change it.
    alone = diffusion.sample_images(
        parts, prompts[1:], seeds[1:], resolution=32, steps=2,
        gathered=lambda: contextlib.nullcontext(denoiser),
    )  # fmt: skip
    assert [im.size for im in together] == [(32, 32), (32, 32)]
    difference = torch.tensor(
        [abs(a - b) for a, b in zip(together[1].tobytes(), alone[0].tobytes(), strict=True)]
    )
    assert difference.max() <= 1  # uint8 rounding of fp32 noise in other batch shapes
    assert together[0].tobytes() != together[1].tobytes()
    grid = diffusion.save_grid(
        [together, together], tmp_path / "samples" / "step-0.png",
        row_labels=["first prompt", "second prompt"], column_labels=["seed 11", "seed 12"],
    )  # fmt: skip
    with Image.open(grid) as image:
        rows, cols = 2, 2
        assert image.size == (
            sampling.LABEL_WIDTH + cols * (32 + sampling.GAP),
            sampling.LABEL_HEIGHT + rows * (32 + sampling.GAP),
        )
        assert image.getpixel((sampling.LABEL_WIDTH, sampling.LABEL_HEIGHT)) == together[
            0
        ].getpixel((0, 0))
    with pytest.raises(ValueError, match="exactly one"):
        diffusion.sample_images(parts, prompts, seeds, resolution=32)


# ZeRO-3 needs a process group; the check runs as 2 CPU ranks under torchrun.
@pytest.mark.slow
def test_zero3_partitioned_denoiser_and_whole_frozen_parts(tmp_path: Path) -> None:
    script = REPO_ROOT / "tests" / "diffusion_zero3_check.py"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**{k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS},
             "PYTHONPATH": str(REPO_ROOT),  # this checkout's package
             "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("zero3 check passed") == 2, result.stdout[-3000:]

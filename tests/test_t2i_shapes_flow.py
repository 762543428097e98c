"""The built-in flow-matching text-to-image model `tiny-t2i-shapes-flow`
(`families/text_to_image/shapes_flow_model.py`, trained by `scripts/build_builtin_t2i_flow.py`):
an SD3-style folder that the diffusion kit reads as a flow pipeline, the first model's VAE with
SD3's latent normalisation, the colour confusion its shipped samples record, and a short
Diffusion-DPO run on it through the real entry point."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, RunResult, launch
from PIL import Image

from align_anything.data.builtin import builtin_path
from align_anything.families import diffusion
from align_anything.families.text_to_image import shapes, shapes_model
from align_anything.families.text_to_image import shapes_flow_model as flow_model

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from build_builtin_t2i import grid  # noqa: E402  (the samples PNG's layout)

FOLDER = flow_model.SHIPPED_DIR
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def held_out() -> tuple[list[str], list[int]]:
    rows = shapes.read_parquet(builtin_path("t2i-shapes-eval"))
    return [r["text"] for r in rows], [r["seed"] for r in rows]


def shipped_samples() -> list[Image.Image]:
    """The 32 images of the shipped samples PNG (the build script's `grid`: 8 columns of
    32-pixel images 2 pixels apart, the sheet scaled 4x by repeating pixels)."""
    sheet = np.asarray(Image.open(flow_model.SAMPLES).convert("RGB"))[::4, ::4]
    step = shapes.IMAGE_SIZE + 2
    return [
        Image.fromarray(np.ascontiguousarray(
            sheet[r * step : r * step + shapes.IMAGE_SIZE, c * step : c * step + shapes.IMAGE_SIZE]
        ))
        for r in range(sheet.shape[0] // step) for c in range(sheet.shape[1] // step)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def info() -> diffusion.PipelineInfo:
    return diffusion.inspect_pipeline(flow_model.NAME)


@pytest.fixture(scope="module")
def parts(info: diffusion.PipelineInfo) -> diffusion.FrozenParts:
    """The frozen parts as the diffusion tasks load them (fp32)."""
    return diffusion.load_frozen_parts(info, dtype=torch.float32)


def test_the_name_is_a_shipped_text_to_image_model() -> None:
    from align_anything.families.zoo import SHIPPED_FAMILIES, names_of, resolve_model_path

    assert resolve_model_path(flow_model.NAME) == str(FOLDER)
    assert SHIPPED_FAMILIES[flow_model.NAME] == "text_to_image"
    assert flow_model.NAME in names_of("text_to_image")
    index = json.loads((FOLDER / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    weights = [p for p in FOLDER.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    assert sorted(p.parent.name for p in weights) == [
        "text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"
    ]  # fmt: skip
    assert all(p.suffix == ".safetensors" for p in weights)
    assert sum(p.stat().st_size for p in weights) < 8 * 2**20
    # no file names the folder it was built from
    for path in FOLDER.rglob("*.json"):
        assert "_name_or_path" not in path.read_text(), path


def test_the_folder_loads_as_an_sd3_flow_pipeline(
    info: diffusion.PipelineInfo, parts: diffusion.FrozenParts
) -> None:
    assert (info.kind, info.prediction, info.flow) == ("sd3", "flow", True)
    assert info.denoiser_part == "transformer"
    assert info.text_encoders == ("text_encoder", "text_encoder_2", "text_encoder_3")
    assert info.default_resolution == shapes.IMAGE_SIZE
    assert (info.latent_channels, info.vae_scale_factor) == (4, 4)
    assert type(parts.noise_scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert parts.noise_scheduler.config.shift == flow_model.SCHEDULER_SHIFT
    # T5's length comes from its tokenizer: 8 CLIP + 8 T5 tokens, not 256 zero tokens
    assert parts.max_sequence_length == flow_model.MAX_TOKENS
    embeds = parts.encode_prompts(["a red circle", "a blue cross"])
    assert embeds["prompt_embeds"].shape == (2, 2 * flow_model.MAX_TOKENS, flow_model.JOINT_WIDTH)
    assert embeds["pooled_prompt_embeds"].shape == (2, flow_model.JOINT_WIDTH)
    # the colour word reaches the transformer through every encoder's tokens
    red, blue = embeds["prompt_embeds"]
    assert not torch.allclose(red[: flow_model.MAX_TOKENS], blue[: flow_model.MAX_TOKENS])
    assert not torch.allclose(red[flow_model.MAX_TOKENS :], blue[flow_model.MAX_TOKENS :])


def test_the_vae_is_the_first_models_with_sd3s_latent_normalisation(
    info: diffusion.PipelineInfo, parts: diffusion.FrozenParts
) -> None:
    from safetensors.torch import load_file

    name = "diffusion_pytorch_model.safetensors"
    ours, theirs = (
        load_file(str(FOLDER / "vae" / name)),
        load_file(str(shapes_model.SHIPPED_DIR / "vae" / name)),
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    first = diffusion.inspect_pipeline(shapes_model.NAME)
    assert first.shift_factor == 0.0 and info.shift_factor != 0.0
    # both scales are one over the spread of the same pictures' latents (a shift keeps it)
    assert info.scaling_factor == pytest.approx(first.scaling_factor, rel=1e-5)
    # so the true pictures' latents are centred and of unit spread, as SD3's are
    rows = shapes.read_parquet(builtin_path("t2i-shapes"))[:128]
    pixels = torch.stack([
        torch.from_numpy(np.array(shapes.decode_png(r["image"]))).permute(2, 0, 1)
        for r in rows
    ]).float() / 127.5 - 1  # fmt: skip
    latents = parts.encode_images(pixels)
    assert abs(latents.mean().item()) < 0.1 and latents.std().item() == pytest.approx(1, abs=0.1)
    # and decoding undoes encoding: the check still reads the pictures' colours
    decoded = ((parts.decode_latents(latents).clamp(-1, 1) + 1) * 127.5).round().byte()
    images = [Image.fromarray(a) for a in decoded.permute(0, 2, 3, 1).numpy()]
    assert shapes.colour_match_rate(images, [r["text"] for r in rows]) == 1.0


def test_random_components_make_a_pipeline_of_the_shipped_architecture() -> None:
    """`build_components` has the shipped configs (the VAE's latent normalisation aside)."""
    parts = flow_model.build_components(seed=0)
    skip = {"_name_or_path", "_diffusers_version", "transformers_version", "scaling_factor",
            "shift_factor", "architectures", "dtype", "torch_dtype", "_class_name"}  # fmt: skip
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        shipped = json.loads((FOLDER / name / "config.json").read_text())
        built = parts[name].config
        built = built.to_dict() if hasattr(built, "to_dict") else dict(built)
        built = json.loads(json.dumps(built, default=str))  # tuples as the saved lists
        differing = {k for k in shipped if k not in skip and shipped[k] != built.get(k, shipped[k])}
        assert not differing, (name, {k: (shipped[k], built.get(k)) for k in differing})
    scheduler = json.loads((FOLDER / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["shift"] == parts["scheduler"].config.shift == flow_model.SCHEDULER_SHIFT


def test_every_tokenizer_gives_each_caption_word_one_token() -> None:
    from transformers import AutoTokenizer

    for part in ("tokenizer", "tokenizer_2"):
        tokenizer = AutoTokenizer.from_pretrained(FOLDER / part)
        assert [tokenizer.tokenize(w) for w in shapes_model.VOCAB_WORDS] == [
            [f"{w}</w>"] for w in shapes_model.VOCAB_WORDS
        ], part  # fmt: skip
        vocab, _ = shapes_model.tokenizer_files()
        assert json.loads((FOLDER / part / "vocab.json").read_text()) == vocab
    t5 = AutoTokenizer.from_pretrained(FOLDER / "tokenizer_3")
    assert t5.model_max_length == flow_model.MAX_TOKENS
    assert [t5.tokenize(w) for w in shapes_model.VOCAB_WORDS] == [
        [f"▁{w}"] for w in shapes_model.VOCAB_WORDS
    ]  # fmt: skip
    ids = t5("a cyan cross", padding="max_length", max_length=flow_model.MAX_TOKENS).input_ids
    assert t5.convert_ids_to_tokens(ids) == ["▁a", "▁cyan", "▁cross", "</s>", *["<pad>"] * 4]
    assert t5.tokenize("purple") == ["▁p", "u", "r", "p", "l", "e"]  # spelt, never unknown
    assert flow_model.t5_tokenizer().get_vocab() == t5.get_vocab()


def test_the_shipped_samples_hold_the_recorded_colour_check() -> None:
    """The samples PNG is the held-out captions' images, and its colour check is the one the
    build script recorded: shapes drawn, colours mostly wrong (the confusion an alignment run
    is to fix), near `tiny-t2i-shapes`'s 0.41."""
    images = shipped_samples()
    captions, _ = held_out()
    assert len(images) == len(captions) == 32
    regrid = np.asarray(grid(images))
    assert np.array_equal(regrid, np.asarray(Image.open(flow_model.SAMPLES).convert("RGB")))
    assert sum(shapes.dominant_colour(image) is not None for image in images) >= 30
    rate = shapes.colour_match_rate(images, captions)
    assert rate == flow_model.SAMPLES_COLOUR_MATCH
    assert 0.25 <= rate <= 0.5
    # when it errs it mostly draws the previous hue round the wheel, as its captions taught it
    drawn = [shapes.dominant_colour(image) for image in images]
    wanted = [shapes.caption_colour(text) for text in captions]
    wrong = [(d, w) for d, w in zip(drawn, wanted, strict=True) if d != w]
    assert sum(d == shapes.CONFUSED_WITH[w] for d, w in wrong) > len(wrong) / 2


@pytest.mark.slow
def test_the_shipped_model_samples_its_shipped_samples() -> None:
    """Sampling the held-out captions again (their seeds, Euler 20 steps, no guidance, fp32
    CPU) gives the shipped samples, so the recorded check is this folder's."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(FOLDER)
    pipeline.set_progress_bar_config(disable=True)
    captions, seeds = held_out()
    images = flow_model.sample_images(pipeline, captions, seeds, flow_model.CHECK_STEPS)
    shipped = shipped_samples()
    # other CPUs may round a pixel the other way
    for new, old in zip(images, shipped, strict=True):
        difference = np.abs(np.asarray(new, dtype=int) - np.asarray(old, dtype=int))
        assert difference.max() <= 2
    assert shapes.colour_match_rate(images, captions) == flow_model.SAMPLES_COLOUR_MATCH


# ---------------------------------------------------------------------------- Diffusion-DPO


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """Diffusion-DPO of the flow model on the built-in pairs: 2 steps of 2 pairs, ZeRO-2, the
    colour check on 4 held-out captions in 2 Euler steps."""
    return launch(
        [
            "task=diffusion_dpo",
            f"model.name_or_path={flow_model.NAME}",
            "deepspeed=z2",
            "train.precision=fp32",
            "train.seed=7",
            "train.max_steps=2",
            "train.per_device_batch_size=2",
            "data.max_train_samples=4",
            "data.max_eval_samples=4",
            "diffusion_dpo.check_samples=4",
            "diffusion_dpo.sample_steps=2",
            "logging.sample_seeds=[0]",
        ],
        tmp_path_factory.mktemp("flow-dpo") / "run",
    ).check()


@pytest.mark.slow
def test_diffusion_dpo_runs_on_the_flow_model(dpo_run: RunResult) -> None:
    assert dpo_run.zero_stage() == 2
    assert dpo_run.summary_line("pipeline").startswith("sd3 (SD3Transformer2DModel, flow target")
    assert re.search(r"text_encoder_3 [\d.]+K frozen", dpo_run.summary_line("parts"))
    assert dpo_run.summary_line("resolution").startswith("32 px")
    steps = dpo_run.train_steps()
    assert [m["step"] for m in steps] == [1, 2]
    # the policy starts as the reference: the first loss is exactly ln 2
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(math.isfinite(m["loss"]) for m in steps)
    for phase in ("before", "after"):
        assert 0.0 <= dpo_run.eval(phase)["eval/image_check"] <= 1.0


@pytest.mark.slow
def test_the_trained_flow_model_saves_a_pipeline_that_samples(dpo_run: RunResult) -> None:
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    final = dpo_run.output_dir / "final"
    assert diffusion.inspect_pipeline(str(final)).kind == "sd3"
    pipeline = DiffusionPipeline.from_pretrained(str(final))
    pipeline.set_progress_bar_config(disable=True)
    (image,) = flow_model.sample_images(pipeline, ["a red circle"], [0], steps=2)
    assert image.size == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE)
    name = "transformer/diffusion_pytorch_model.safetensors"
    trained, base = load_file(str(final / name)), load_file(str(FOLDER / name))
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the denoiser trained
    for part in ("vae", "text_encoder", "text_encoder_3"):  # the frozen parts did not
        weights = next((final / part).glob("*.safetensors")).name
        ours, theirs = (
            load_file(str(final / part / weights)),
            load_file(str(FOLDER / part / weights)),
        )
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), part

"""Text-to-image data at its edges (issue 38, cases 1, 2, 4, 7-11 and 17), through the real
entry point: images read as they are displayed, pairs of one image twice dropped, every bad
row one `error:` line before any training, and a finished run's weights readable by others.

- bad inputs (in-process `align_anything.train.main`, hub offline): each ends with exit 2, one
  message naming the file and the row (or the key that allows it), no traceback, no step;
- one Diffusion-DPO launch (`tiny-random-sd`, LoRA merged, EMA, a checkpoint) on pairs built to
  show each reading: a 16-bit grayscale PNG and its 8-bit copy, a phone JPEG stored sideways
  with its EXIF orientation and the same picture upright, a palette PNG with a transparent
  colour and its copy on white, string labels, and pairs of one image twice. Its latent cache
  (`data.cache_dir`) holds what the denoiser trained on: the latents of each picture and of its
  plain copy must agree, which they did not when 16-bit values were clipped to white, the
  orientation ignored and transparent pixels read as black.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import RunResult, launch
from PIL import Image

from align_anything.data.media import MediaUnreadable, probe_image
from align_anything.families.text_to_image import images
from align_anything.train import main

SD = "model.name_or_path=tiny-random-sd"
# The side images are cropped to, and the test images' size (w x h: a 3:2 landscape).
RESOLUTION = 32
SIZE = (48, 32)
UMASK_022 = ["sh", "-c", 'umask 022; exec "$@"', "sh"]


# ---------------------------------------------------------------------------- pictures


def _save(image: Image.Image, path: Path, **params) -> Path:
    image.save(path, **params)
    return path


def _noise(seed: int, mode: str = "RGB") -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (SIZE[1], SIZE[0], 3) if mode == "RGB" else (SIZE[1], SIZE[0])
    return rng.integers(0, 256, shape, dtype=np.uint8)


def write_gray16(folder: Path) -> tuple[Path, Path]:
    """A 16-bit grayscale PNG whose values are k·257 plus noise below half a step, and the
    8-bit copy of the same picture (k): what a 16-bit scanner image and its 8-bit export hold."""
    eight = _noise(1, "L")
    noise = np.random.default_rng(2).integers(0, 128, eight.shape)
    sixteen = (eight.astype(np.int64) * 257 + noise).clip(0, 65535).astype(np.uint16)
    wide = _save(Image.fromarray(sixteen), folder / "gray16.png")
    assert Image.open(wide).mode == "I;16"
    return wide, _save(Image.fromarray(eight, mode="L"), folder / "gray8.png")


def write_rotated_photo(folder: Path) -> tuple[Path, Path]:
    """A JPEG stored landscape with EXIF orientation 6 (a phone held upright: shown turned 90°
    clockwise, portrait), and a PNG of its pixels turned that way by numpy (not PIL): the
    picture as every viewer shows it."""
    exif = Image.Exif()
    exif[0x0112] = 6
    photo = _save(Image.fromarray(_noise(3)), folder / "phone.jpg", exif=exif, quality=95)
    with Image.open(photo) as stored:
        pixels = np.asarray(stored.convert("RGB"))  # as stored: PIL does not turn it by itself
    assert pixels.shape[:2] == (SIZE[1], SIZE[0])
    upright = _save(Image.fromarray(np.rot90(pixels, k=-1).copy()), folder / "phone-upright.png")
    return photo, upright


def write_transparent_logo(folder: Path) -> tuple[Path, Path]:
    """A palette PNG whose colour 0 (black in the palette) is transparent, and its copy with
    that colour white: transparent pixels are laid on white."""
    index = (_noise(4, "L") % 3).astype(np.uint8)
    palette = [0, 0, 0, 200, 40, 40, 40, 40, 200]
    logo = Image.fromarray(index, mode="P")
    logo.putpalette(palette)
    transparent = _save(logo, folder / "logo.png", transparency=0)
    white = Image.fromarray(index, mode="P")
    white.putpalette([255, 255, 255, *palette[3:]])
    return transparent, _save(white.convert("RGB"), folder / "logo-on-white.png")


def write_damaged_png(path: Path) -> Path:
    """A PNG whose chunks and checksums are all valid but whose compressed pixel stream is
    damaged (40 bytes flipped, the IDAT checksum recomputed): its header reads, decoding fails
    ("broken data stream")."""
    buffer = io.BytesIO()
    Image.fromarray(_noise(5)).save(buffer, format="PNG")
    data, out, pos = buffer.getvalue(), bytearray(buffer.getvalue()[:8]), 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], bytearray(data[pos + 8 : pos + 8 + length])
        if kind == b"IDAT":
            body[100:140] = bytes(b ^ 0xFF for b in body[100:140])
        out += struct.pack(">I", length) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        pos += 12 + length
    path.write_bytes(bytes(out))
    return path


def write_huge_png(path: Path, side: int = 14000) -> Path:
    """A valid black 1-bit PNG of side x side pixels (196 million for 14000: past twice
    Pillow's default limit), written row by row (25 KB on disk)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    packer = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)  # filter byte, then the row's bits
    stream = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", stream) + chunk(b"IEND", b"")
    )
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def bad_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad_images")
    _save(Image.new("RGB", SIZE, "red"), root / "red.png")
    blue = _save(Image.new("RGB", SIZE, "blue"), root / "blue.png")
    (root / "blue-copy.png").write_bytes(blue.read_bytes())
    write_damaged_png(root / "damaged.png")
    write_huge_png(root / "huge.png")
    pair = {"caption": "a red square", "jpg_0": "red.png", "jpg_1": "blue.png", "label_0": 1}
    _jsonl(root / "damaged.jsonl", [pair, {**pair, "jpg_1": "damaged.png"}, pair])
    _jsonl(root / "huge.jsonl", [pair, {**pair, "jpg_0": "huge.png"}])
    _jsonl(root / "caption_number.jsonl", [pair, {**pair, "caption": 42}, pair])
    _jsonl(root / "label_word.jsonl", [pair, {**pair, "label_0": "yes"}, {**pair, "label_0": "1"}])
    # Every pair one image twice: the same path, or two files of the same bytes.
    same = [{**pair, "jpg_1": "red.png"}, {**pair, "jpg_0": "blue.png", "jpg_1": "blue-copy.png"}]
    _jsonl(root / "identical.jsonl", same * 8)
    return root


# (id, task, data file, fragments of the message); {bad} is the fixture's folder.
CASES = [
    # Case 8: the header check passes it; the encoding names the file and its row.
    ("damaged-pixel-data", "diffusion_dpo", "damaged.jsonl",
     ["1 item(s) of {bad}/damaged.jsonl cannot be decoded", "line 2: image {bad}/damaged.png",
      "broken data stream", "Replace or remove those rows"]),
    # Case 9: named with the key that allows it, before any pixel is decoded.
    ("image-over-the-pixel-limit", "diffusion_dpo", "huge.jsonl",
     ["line 2: image {bad}/huge.png", "14000x14000 = 196,000,000 pixels",
      "more than data.max_image_pixels=89478485", "data.max_image_pixels=196000000"]),
    # Case 11: a number where the caption should be (a column mapped wrongly, most likely).
    ("caption-that-is-a-number", "diffusion_dpo", "caption_number.jsonl",
     ["1 row(s) of data file {bad}/caption_number.jsonl",
      "line 2: caption 42 in column 'caption' is a int, not text"]),
    # Case 10: "1" is read as 1 (line 3 passes); a word is named with its row.
    ("label-that-is-a-word", "diffusion_dpo", "label_word.jsonl",
     ["1 row(s) of data file {bad}/label_word.jsonl",
      "line 2: label 'yes' in column 'label_0' is not 0, 0.5 or 1"]),
    # Case 2: pairs of one image twice say nothing; all of them: nothing to train on.
    ("every-pair-one-image-twice", "diffusion_dpo", "identical.jsonl",
     ["no usable rows in {bad}/identical.jsonl", "kept 0 of 16 rows",
      "16  identical images (jpg_0 and jpg_1 are the same file: nothing to prefer) (lines 1, 2"]),
]  # fmt: skip


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize(("task", "data", "fragments"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_image_data_is_one_message_before_any_step(
    task: str, data: str, fragments: list[str], bad_images: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    status = main([f"task={task}", SD, "train.precision=fp32", f"data.path={bad_images / data}",
                   f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert err.count("error: ") == 1, err
    for fragment in fragments:
        assert fragment.format(bad=bad_images) in err, f"{fragment!r} not in:\n{err}"
    assert not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()


def test_the_pixel_limit_is_the_config_keys(bad_images: Path) -> None:
    """data.max_image_pixels decides (the header is read, nothing decoded): raised past the
    image's size, or null, the 196-million-pixel PNG passes the check."""
    huge = str(bad_images / "huge.png")
    with pytest.raises(MediaUnreadable, match="more than data.max_image_pixels=1000"):
        probe_image(huge, None, max_pixels=1000)
    assert probe_image(huge, None, max_pixels=196_000_000) == (14000, 14000)
    assert probe_image(huge, None, max_pixels=None) == (14000, 14000)


def test_each_image_mode_is_read_as_displayed(tmp_path: Path) -> None:
    """The crop the latents are encoded from (`images.center_crop`), mode by mode, against the
    same picture saved plainly: 16-bit grayscale (case 1), a rotated phone photo (case 4),
    palette and RGBA transparency, CMYK; a floating-point image is refused by the header
    check, naming the file."""

    def crop(path: Path) -> np.ndarray:
        return images.center_crop(path.read_bytes(), RESOLUTION).pixels

    wide, eight = write_gray16(tmp_path)
    assert np.array_equal(crop(wide), crop(eight))
    photo, upright = write_rotated_photo(tmp_path)
    assert np.array_equal(crop(photo), crop(upright))
    assert images.center_crop(photo.read_bytes(), RESOLUTION).original_size == (48, 32)
    assert probe_image(str(photo), None) == (32, 48)  # (width, height) as displayed
    logo, on_white = write_transparent_logo(tmp_path)
    assert np.array_equal(crop(logo), crop(on_white))
    rgba = np.dstack([_noise(6), np.where(_noise(7, "L") > 127, 255, 0).astype(np.uint8)])
    _save(Image.fromarray(rgba, mode="RGBA"), tmp_path / "rgba.png")
    flat = np.where(rgba[..., 3:] == 255, rgba[..., :3], 255).astype(np.uint8)
    _save(Image.fromarray(flat), tmp_path / "rgba-on-white.png")
    assert np.array_equal(crop(tmp_path / "rgba.png"), crop(tmp_path / "rgba-on-white.png"))
    cmyk = _save(Image.new("RGB", SIZE, (200, 30, 60)).convert("CMYK"), tmp_path / "c.jpg",
                 quality=100)  # fmt: skip
    assert np.abs(crop(cmyk)[:, 0, 0] - (np.array([200, 30, 60]) / 127.5 - 1)).max() < 0.02
    floats = _save(Image.fromarray(np.ones((8, 8), dtype=np.float32)), tmp_path / "f.tiff")
    with pytest.raises(MediaUnreadable, match=f"image {floats} holds floating-point pixels"):
        probe_image(str(floats), None)


# ---------------------------------------------------------------------------- one launch


@pytest.fixture(scope="module")
def pairs_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """Diffusion-DPO, 2 steps, LoRA (merged export too), EMA, a checkpoint at step 2, under
    umask 022, on 8 pairs: 4 whose chosen image is one of the pictures above, 4 whose chosen
    image is its plain copy (each rejected image the same red square), with labels written
    as strings ("1", "1.0") in some rows, and 4 pairs of one image twice (dropped)."""
    root = tmp_path_factory.mktemp("pairs")
    red = _save(Image.new("RGB", SIZE, "red"), root / "red.png")
    blue = _save(Image.new("RGB", SIZE, "blue"), root / "blue.png")
    (root / "blue-copy.png").write_bytes(blue.read_bytes())
    pictures = [write_gray16(root), write_rotated_photo(root), write_transparent_logo(root)]
    rows = []
    for (picture, copy), caption in zip(pictures, ("a gray scan", "a phone photo", "a logo"),
                                        strict=True):  # fmt: skip
        rows.append({"caption": caption, "jpg_0": picture.name, "jpg_1": red.name, "label_0": 1})
        rows.append({"caption": caption, "jpg_0": copy.name, "jpg_1": red.name, "label_0": "1"})
    rows.append({"caption": "a blue square", "jpg_0": red.name, "jpg_1": blue.name,
                 "label_0": "0"})  # fmt: skip
    rows.append({"caption": "a red square", "jpg_0": red.name, "jpg_1": blue.name,
                 "label_0": "1.0"})  # fmt: skip
    rows += [{"caption": "twice", "jpg_0": blue.name, "jpg_1": blue.name, "label_0": 1}] * 2
    rows += [{"caption": "twice", "jpg_0": blue.name, "jpg_1": "blue-copy.png", "label_0": 0}] * 2
    data = _jsonl(root / "pairs.jsonl", rows)
    return launch(
        [
            "task=diffusion_dpo",
            SD,
            "train.precision=fp32",
            "train.seed=7",
            "deepspeed=z0",
            f"data.path={data}",
            f"data.eval_path={data}",
            f"data.resolution={RESOLUTION}",
            f"data.cache_dir={root / 'cache'}",
            "train.per_device_batch_size=2",
            "train.max_steps=2",
            "diffusion_dpo.check_samples=0",
            "diffusion_dpo.sample_steps=1",
            "logging.sample_prompts=[a_logo]",
            "logging.sample_seeds=[0]",
            "model.lora.enabled=true",
            "model.lora.save_merged=true",
            "train.ema.enabled=true",
            "checkpoint.every_steps=2",
        ],  # fmt: skip
        root / "run",
        wrap=UMASK_022,
    ).check()


def _chosen_latents(run: RunResult) -> dict[str, np.ndarray]:
    """Row name ("line 3") -> the latents of that pair's chosen image, from the run's latent
    cache entry (`data.latents`: rows.npy indexes latents.npy; rows_from names the rows)."""
    (folder,) = (run.output_dir.parent / "cache").glob("latents-*")
    manifest = json.loads((folder / "manifest.json").read_text())
    rows, latents = np.load(folder / "rows.npy"), np.load(folder / "latents.npy")
    return {name: latents[rows[i, 1]] for i, name in enumerate(manifest["rows_from"])}


@pytest.mark.slow
def test_pairs_run_keeps_what_can_be_preferred(pairs_run: RunResult) -> None:
    """Case 2: the 4 pairs of one image twice (the same path twice, or two files of the same
    bytes) are dropped and counted in the summary, as the text tasks count theirs; case 10:
    labels "1", "1.0" and "0" are read as numbers (the blue square is chosen in line 7)."""
    out, data = pairs_run.output, pairs_run.output_dir.parent / "pairs.jsonl"
    assert f"data            {data}: kept 8 of 12 rows, dropped 4" in out, out
    assert "4  identical images (jpg_0 and jpg_1 are the same file: nothing to prefer) (lines " \
           "9, 10, 11, 12)" in out  # fmt: skip
    chosen = _chosen_latents(pairs_run)
    assert sorted(chosen, key=lambda n: int(n.split()[1])) == [f"line {i}" for i in range(1, 9)]
    assert not np.allclose(chosen["line 7"], chosen["line 8"])  # blue (label "0"), red ("1.0")


@pytest.mark.slow
@pytest.mark.parametrize(("picture", "copy", "what"), [
    ("line 1", "line 2", "16-bit grayscale PNG (case 1): scaled to 8 bits, not clipped to white"),
    ("line 3", "line 4", "EXIF orientation 6 (case 4): turned upright"),
    ("line 5", "line 6", "palette PNG with a transparent colour: laid on white"),
])  # fmt: skip
def test_the_denoiser_trained_on_the_picture_as_displayed(
    pairs_run: RunResult, picture: str, copy: str, what: str
) -> None:
    """The latents encoded for the picture equal those of its plain copy (the same pixels
    through the same VAE), while a picture read wrongly encodes to other latents: the red
    square's, the nearest other image, is far from both."""
    chosen = _chosen_latents(pairs_run)
    np.testing.assert_allclose(chosen[picture], chosen[copy], atol=1e-5, err_msg=what)
    assert np.abs(chosen[picture] - chosen["line 8"]).max() > 0.1


@pytest.mark.slow
def test_pairs_run_records_its_libraries_and_writes_readable_weights(
    pairs_run: RunResult,
) -> None:
    """Case 17: the start-up summary's versions name diffusers and peft, which compute this
    run. Case 7: under umask 022 every file the run exported or checkpointed, weights included
    (safetensors' `save_file` creates its files 0600 whatever the umask), is 0644 like the
    configs beside it."""
    versions = pairs_run.summary_line("versions")
    assert versions.startswith("torch ") and ", diffusers " in versions and ", peft " in versions
    folders = ["final", "final-merged", "final-ema", "checkpoints/step-2"]
    files = [p for name in folders for p in (pairs_run.output_dir / name).rglob("*") if p.is_file()]
    weights = [p for p in files if p.suffix == ".safetensors"]
    assert len(weights) >= 5, weights  # adapter, merged unet/vae/text encoder, EMA
    modes = {str(p.relative_to(pairs_run.output_dir)): oct(p.stat().st_mode & 0o777)
             for p in files}  # fmt: skip
    assert set(modes.values()) == {"0o644"}, modes

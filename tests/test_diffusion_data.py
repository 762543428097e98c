"""Text-to-image data (`families/text_to_image/images.py`, the image medium in `media.py`, the
latent cache `families/diffusion/latents.py`): the readers of image folders,
jsonl / parquet files and Pick-a-Pic pairs, one message naming every bad row, the centre crop,
and the encode-once latent cache (built once, read back memory-mapped, keyed by the images)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from align_anything.errors import DataError
from align_anything.families import diffusion
from align_anything.families.diffusion import latents
from align_anything.families.text_to_image import images, media


def png(color: str | tuple, size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def ensure(source, key, *, resolution: int, encode_images, **kwargs) -> str:
    """The latent cache of an image source, as the image medium builds it."""
    return latents.ensure_latent_cache(
        source, key, resolution=resolution, refs=media.image_refs(source),
        prepare=media.cropper(resolution), encode_media=encode_images, **kwargs,
    )  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_folder_with_txt_captions(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name, color in [("a.png", "red"), ("sub/b.jpg", "blue")]:
        Image.new("RGB", (8, 8), color).save(tmp_path / name)
        (tmp_path / name).with_suffix(".txt").write_text(f"  a {color} square\n")
    source = images.read_captioned_images(str(tmp_path))
    assert [(i.caption, i.row) for i in source.items] == [
        ("a red square", "a.png"), ("a blue square", "sub/b.jpg"),
    ]  # fmt: skip
    assert source.image_files == [tmp_path / "a.png", tmp_path / "sub" / "b.jpg"]
    assert source.data_files == [tmp_path / "a.txt", tmp_path / "sub" / "b.txt"]
    assert (source.report.total, source.report.kept) == (2, 2)


def test_folder_with_metadata_jsonl(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "x.png").write_bytes(png("green"))
    write_jsonl(tmp_path / "metadata.jsonl", [{"file_name": "imgs/x.png", "text": "green"}])
    source = images.read_captioned_images(str(tmp_path))
    assert source.items[0].caption == "green"
    assert source.items[0].image.path == tmp_path.resolve() / "imgs" / "x.png"
    assert source.items[0].row == "line 1"
    assert source.data_files == [tmp_path / "metadata.jsonl"]


def test_parquet_with_embedded_bytes_and_datasets_image_columns(tmp_path: Path) -> None:
    import datasets

    raw = write_parquet(tmp_path / "raw.parquet", [{"image": png("red"), "caption": "red"}])
    source = images.read_captioned_images(str(raw))
    assert source.items[0].image.read() == png("red")
    assert source.image_files == []  # embedded: the parquet file's digest covers them
    # `datasets`' own Image feature stores {"bytes", "path"}; read without decoding to PIL
    stored = datasets.Dataset.from_dict(
        {"image": [{"bytes": png("blue"), "path": None}], "text": ["blue"]},
        features=datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")}),
    )
    stored.to_parquet(str(tmp_path / "hf.parquet"))
    source = images.read_captioned_images(str(tmp_path / "hf.parquet"))
    assert source.items[0].image.read() == png("blue")
    assert source.items[0].caption == "blue"


def test_preference_pairs_chosen_rejected_and_ties(tmp_path: Path) -> None:
    red, blue = png("red"), png("blue")
    path = write_parquet(tmp_path / "pairs.parquet", [
        {"caption": "red", "jpg_0": red, "jpg_1": blue, "label_0": 1.0},
        {"caption": "blue", "jpg_0": red, "jpg_1": blue, "label_0": 0},
        {"caption": "either", "jpg_0": red, "jpg_1": blue, "label_0": 0.5},
    ])  # fmt: skip
    source = images.read_preference_pairs(str(path))
    assert [(p.caption, p.chosen.read(), p.rejected.read()) for p in source.items] == [
        ("red", red, blue),  # label_0 = 1: image 0 preferred
        ("blue", blue, red),  # label_0 = 0: image 1 preferred
    ]
    report = source.report
    assert (report.total, report.kept, report.dropped) == (3, 2, {images.TIE: 1})
    assert "tie (label_0 = 0.5" in report.summary() and "(row 3)" in report.summary()


def test_every_bad_row_is_named_in_one_message(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(png("red"))
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    path = write_jsonl(tmp_path / "pairs.jsonl", [
        {"caption": "fine", "jpg_0": "ok.png", "jpg_1": "ok.png", "label_0": 1},
        {"caption": "a", "jpg_0": "missing.png", "jpg_1": "ok.png", "label_0": 1},
        {"caption": "b", "jpg_0": "ok.png", "jpg_1": "broken.png", "label_0": 0},
        {"caption": "", "jpg_0": "ok.png", "jpg_1": "ok.png", "label_0": 1},
        {"caption": "c", "jpg_0": "ok.png", "jpg_1": "ok.png", "label_0": 0.3},
    ])  # fmt: skip
    with pytest.raises(DataError) as caught:
        images.read_preference_pairs(str(path))
    message = str(caught.value)
    assert message.startswith(f"4 row(s) of data file {path} cannot be used")
    assert f"line 2: image {tmp_path.resolve() / 'missing.png'}: image file" in message
    assert "does not exist" in message
    assert "line 3: image" in message and "broken.png: image" in message
    assert "cannot be read" in message
    assert "line 4: missing or empty caption in column 'caption'" in message
    assert "line 5: label 0.3 in column 'label_0' is not 0, 0.5 or 1" in message
    assert "line 1" not in message


def test_missing_captions_and_columns_are_named(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "lonely.png")
    with pytest.raises(DataError, match="lonely.png: no caption file lonely.txt beside it"):
        images.read_captioned_images(str(tmp_path))
    path = write_jsonl(tmp_path / "rows.jsonl", [{"image": "lonely.png", "prompt": "x"}])
    with pytest.raises(DataError, match=r"no caption column \(tried 'text', 'caption'\).*"
                                        r"data.columns.caption=NAME"):  # fmt: skip
        images.read_captioned_images(str(path))
    source = images.read_captioned_images(str(path), columns={"caption": "prompt"})
    assert source.items[0].caption == "x"


def test_center_crop_geometry() -> None:
    # 20×16 (w×h) at 16: no resize (the shorter side is 16), left = round((20 − 16)/2) = 2.
    ramp = np.tile((np.arange(20, dtype=np.uint8) * 10)[None, :, None], (16, 1, 3))
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, format="PNG")
    cropped = images.center_crop(buffer.getvalue(), 16)
    assert cropped.original_size == (16, 20) and cropped.crop_top_left == (0, 2)
    # column 0 of the crop is column 2 of the image: 20 → 20/127.5 − 1
    assert cropped.pixels.shape == (3, 16, 16)
    assert cropped.pixels[0, 5, 0] == pytest.approx(20 / 127.5 - 1)
    assert cropped.pixels[2, 0, 15] == pytest.approx(170 / 127.5 - 1)
    # 30×40 (w×h) at 15: scale 0.5 → 15×20, top = round(5/2) = 2 (round half to even)
    tall = images.center_crop(png("white", (30, 40)), 15)
    assert tall.original_size == (40, 30) and tall.crop_top_left == (2, 0)
    assert tall.pixels.min() == tall.pixels.max() == 1.0


@pytest.fixture(scope="module")
def parts() -> diffusion.FrozenParts:
    return diffusion.load_frozen_parts(diffusion.inspect_pipeline("tiny-random-sd"),
                                       dtype=torch.float32)  # fmt: skip


def _captioned(folder: Path) -> images.ImageSource:
    folder.mkdir(exist_ok=True)
    for name, color, caption in [("a", "red", "red one"), ("b", "blue", "blue one"),
                                 ("c", "red", "red one")]:  # c: a copy of a  # fmt: skip
        (folder / f"{name}.png").write_bytes(png(color))
        (folder / f"{name}.txt").write_text(caption)
    return images.read_captioned_images(str(folder))


def _refuse(*_: object) -> None:
    raise AssertionError("a cache hit must not encode anything")


def test_latent_cache_encodes_once_and_reads_back(tmp_path: Path, parts) -> None:
    source = _captioned(tmp_path / "data")
    key = media.latent_key_parts(source, resolution=32, encoder="tiny-sd")
    root = tmp_path / "cache"
    started = []
    note = ensure(
        source, key, root=root, resolution=32, encode_images=parts.encode_images,
        encode_prompts=parts.encode_prompts, batch_size=2,
        on_start=lambda n_images, n_captions: started.append((n_images, n_captions)),
    )  # fmt: skip
    assert note.startswith("encoded 2 images and 2 captions")  # c.png repeats a.png's bytes
    assert started == [(2, 2)]
    hit = ensure(
        source, key, root=root, resolution=32, encode_images=_refuse, encode_prompts=_refuse
    )
    assert hit.startswith("cache hit")
    encoded = latents.open_latent_cache(latents.latent_cache_folder(root, key))
    assert len(encoded) == 3 and encoded.kind == "captioned"
    batch = encoded.batch([2, 1])
    # the same numbers as encoding the cropped images and captions directly
    pixels = torch.from_numpy(np.stack([images.center_crop(png(c), 32).pixels
                                        for c in ("red", "blue")]))  # fmt: skip
    torch.testing.assert_close(batch["latents"], parts.encode_images(pixels))
    direct = parts.encode_prompts(["red one", "blue one"])["prompt_embeds"]
    torch.testing.assert_close(batch["prompt_embeds"], direct)
    # SDXL's conditioning: original 30×40 (h×w), resized to 32×43, crop left round(11/2) = 6
    assert batch["add_time_ids"].tolist() == [[30, 40, 0, 6, 32, 32]] * 2
    assert "pooled_prompt_embeds" not in batch  # SD 1.x has no pooled embedding
    assert isinstance(encoded.latents, np.memmap)  # memory-mapped, not read into memory


def test_latent_cache_key_follows_the_image_bytes(tmp_path: Path) -> None:
    source = _captioned(tmp_path / "data")
    key = media.latent_key_parts(source, resolution=32, encoder="tiny-sd")
    assert key == media.latent_key_parts(source, resolution=32, encoder="tiny-sd")
    assert key != media.latent_key_parts(source, resolution=64, encoder="tiny-sd")
    assert key != media.latent_key_parts(source, resolution=32, encoder="other-vae")
    (tmp_path / "data" / "b.png").write_bytes(png("green"))
    changed = media.latent_key_parts(source, resolution=32, encoder="tiny-sd")
    assert changed["image_files"] != key["image_files"]
    (tmp_path / "data" / "a.txt").write_text("a new caption")
    assert (
        media.latent_key_parts(source, resolution=32, encoder="tiny-sd")["data_files"]
        != (key["data_files"])
    )


def test_a_damaged_latent_cache_is_rebuilt(tmp_path: Path, parts) -> None:
    source = _captioned(tmp_path / "data")
    key = media.latent_key_parts(source, resolution=32, encoder="tiny-sd")
    common = dict(root=tmp_path / "cache", resolution=32, encode_images=parts.encode_images,
                  encode_prompts=parts.encode_prompts)  # fmt: skip
    ensure(source, key, **common)
    folder = latents.latent_cache_folder(tmp_path / "cache", key)
    with open(folder / "latents.npy", "r+b") as handle:
        handle.truncate(100)
    note = ensure(source, key, **common)
    assert "rebuilt: latents.npy is 100 bytes" in note
    assert latents.open_latent_cache(folder).batch([0])["latents"].shape == (1, 4, 16, 16)


def test_pairs_cache_in_bfloat16(tmp_path: Path) -> None:
    info = diffusion.inspect_pipeline("tiny-random-sdxl")
    parts = diffusion.load_frozen_parts(info, dtype=torch.bfloat16)
    path = write_parquet(tmp_path / "pairs.parquet", [
        {"caption": "red", "jpg_0": png("red"), "jpg_1": png("blue"), "label_0": 1.0},
        {"caption": "blue", "jpg_0": png("red"), "jpg_1": png("blue"), "label_0": 0.0},
    ])  # fmt: skip
    source = images.read_preference_pairs(str(path))
    key = media.latent_key_parts(source, resolution=32, encoder="tiny-sdxl-bf16")
    ensure(
        source, key, root=tmp_path / "cache", resolution=32, encode_images=parts.encode_images,
        encode_prompts=parts.encode_prompts,
    )  # fmt: skip
    encoded = latents.open_latent_cache(latents.latent_cache_folder(tmp_path / "cache", key))
    chosen, rejected = encoded.batch([0, 1])
    assert chosen["latents"].dtype == torch.bfloat16  # stored as its bit pattern, exact
    # The cache encodes its distinct images (red, then blue) as one batch; encode that same
    # batch here, since a bf16 convolution's result may depend on the batch size on some CPUs.
    pixels = [images.center_crop(png(colour), 32).pixels for colour in ("red", "blue")]
    red = parts.encode_images(torch.from_numpy(np.stack(pixels)))[0]
    assert torch.equal(chosen["latents"][0], red)  # pair 1 chose the red image
    assert torch.equal(rejected["latents"][1], red)  # pair 2 rejected it
    assert torch.equal(chosen["prompt_embeds"], rejected["prompt_embeds"])
    assert chosen["pooled_prompt_embeds"].shape == (2, 32)


def test_no_usable_rows_is_an_error(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "ties.parquet", [
        {"caption": "x", "jpg_0": png("red"), "jpg_1": png("blue"), "label_0": 0.5},
    ])  # fmt: skip
    source = images.read_preference_pairs(str(path))
    with pytest.raises(DataError, match="(?s)no usable rows.*dropped 1"):
        ensure(
            source, {}, root=tmp_path, resolution=32, encode_images=_refuse,
            encode_prompts=_refuse,
        )  # fmt: skip

"""The server's image preprocessing equals the folder's own transformers processor, and refuses what it cannot follow.

The folders hold the preprocessor_config.json of openai/clip-vit-base-patch32 and of
google/siglip-base-patch16-224 as published (written here: no network). The images are made with
Pillow in every mode and encoding a client may send; the reference is
`AutoImageProcessor.from_pretrained(folder)` run on the image as Pillow opens it.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor

from service.core.repository import RepositoryError
from service.errors import InvalidArgument, RequestTooLarge
from service.pipeline.images import PREPROCESSOR_CONFIG, FixedSize, ImagePreprocessor
from tests.processor_configs import CLIP_CONFIG, SIGLIP_CONFIG

TOLERANCE = 1e-5
"""Max abs difference allowed from the processor's pixel values (the same operations give 0)."""


EXIF_ORIENTATION = 0x0112
UPRIGHT_BY_ORIENTATION = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_270,
    8: Image.Transpose.ROTATE_90,
}
"""What turns a stored image upright for an EXIF orientation (the TIFF/EXIF specification's meaning)."""


def folder_with(tmp_path: Path, name: str, config: dict[str, object]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / PREPROCESSOR_CONFIG).write_text(json.dumps(config), encoding="utf-8")
    return folder


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """An image of random pixels (so that every resize filter and every crop offset shows)."""
    bands = len(Image.new(mode, (1, 1)).getbands())
    values = np.random.default_rng(seed).integers(0, 256, size=(height, width, bands), dtype=np.uint8)
    return Image.fromarray(values[..., 0] if bands == 1 else values, mode=mode)


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def palette_with_transparency() -> bytes:
    image = noise(64, 48, seed=3).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return encoded(image, "PNG", transparency=5)


def rgba_with_alpha_gradient() -> bytes:
    image = noise(90, 60, "RGBA", seed=4)
    alpha = np.tile(np.linspace(0, 255, 90, dtype=np.uint8), (60, 1))
    image.putalpha(Image.fromarray(alpha, mode="L"))
    return encoded(image, "PNG")


def rgb_with_a_transparent_colour() -> bytes:
    image = noise(50, 50, seed=12)
    image.paste((1, 2, 3), (0, 0, 20, 30))
    return encoded(image, "PNG", transparency=(1, 2, 3))


def jpeg_with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    return encoded(noise(120, 70, seed=orientation), "JPEG", exif=exif, quality=90)


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (40, 30), colour) for colour in ((250, 10, 10), (10, 250, 10), (10, 10, 250))]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)


IMAGES: dict[str, Callable[[], bytes]] = {
    "landscape png": lambda: encoded(noise(320, 200), "PNG"),
    "portrait jpeg": lambda: encoded(noise(150, 410, seed=1), "JPEG", quality=85),
    "model size png": lambda: encoded(noise(224, 224, seed=2), "PNG"),
    "1x1 png": lambda: encoded(noise(1, 1, seed=5), "PNG"),
    "3x500 png": lambda: encoded(noise(3, 500, seed=6), "PNG"),
    "500x3 png": lambda: encoded(noise(500, 3, seed=7), "PNG"),
    "grey L png": lambda: encoded(noise(100, 80, "L", seed=8), "PNG"),
    "grey L png with transparency": lambda: encoded(noise(70, 90, "L", seed=9), "PNG", transparency=128),
    "grey LA png": lambda: encoded(noise(60, 60, "LA", seed=10), "PNG"),
    "palette P png": lambda: encoded(noise(64, 48, seed=11).convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
    "palette P png with transparency": palette_with_transparency,
    "RGBA png": rgba_with_alpha_gradient,
    "RGB png with a transparent colour": rgb_with_a_transparent_colour,
    "CMYK jpeg": lambda: encoded(noise(80, 60, "CMYK", seed=13), "JPEG"),
    "lossy webp": lambda: encoded(noise(250, 130, seed=14), "WEBP", quality=80),
    "lossless RGBA webp": lambda: encoded(noise(130, 250, "RGBA", seed=15), "WEBP", lossless=True),
    "animated gif": animated_gif,
    "gif with transparency": lambda: encoded(noise(33, 77, "P", seed=16), "GIF", transparency=0),
    **{f"jpeg with exif orientation {n}": lambda n=n: jpeg_with_orientation(n) for n in UPRIGHT_BY_ORIENTATION},
}


def upright(data: bytes) -> Image.Image:
    """The image as the reference is given it: opened by Pillow, turned by its EXIF orientation where it has one."""
    image = Image.open(io.BytesIO(data))
    orientation = image.getexif().get(EXIF_ORIENTATION)
    return image.transpose(UPRIGHT_BY_ORIENTATION[orientation]) if orientation in UPRIGHT_BY_ORIENTATION else image


def reference_pixels(folder: Path, images: list[bytes]) -> np.ndarray:
    processor = AutoImageProcessor.from_pretrained(folder)
    # The PIL backend is what transformers gives without torchvision; with it, the torchvision backend
    # (a different resize) would be the reference, and this module does not follow that one.
    assert processor.backend == "pil", f"the reference is {type(processor).__name__}, not the PIL backend"
    return processor([upright(data) for data in images], return_tensors="np")["pixel_values"]


def assert_same_pixels(folder: Path, images: list[bytes]) -> np.ndarray:
    served = ImagePreprocessor.from_folder(folder).encode(images)
    expected = reference_pixels(folder, images)
    assert served.dtype == np.float32
    assert served.shape == expected.shape
    assert float(np.max(np.abs(served - expected))) <= TOLERANCE
    return served


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    return {name: make() for name, make in IMAGES.items()}


@pytest.mark.parametrize(("name", "config"), [("clip", CLIP_CONFIG), ("siglip", SIGLIP_CONFIG)])
def test_pixel_values_equal_the_folders_processor(
    tmp_path: Path, images: dict[str, bytes], name: str, config: dict[str, object]
) -> None:
    served = assert_same_pixels(folder_with(tmp_path, name, config), list(images.values()))
    assert served.shape == (len(images), 3, 224, 224)


def test_the_first_frame_of_an_animated_gif_is_taken(tmp_path: Path, images: dict[str, bytes]) -> None:
    folder = folder_with(tmp_path, "siglip", SIGLIP_CONFIG)
    pixels = ImagePreprocessor.from_folder(folder).pixel_values(images["animated gif"])
    red, green, blue = pixels.mean(axis=(1, 2))
    assert red > 0.9 and green < -0.9 and blue < -0.9


def test_exif_orientation_turns_the_image_upright(tmp_path: Path, images: dict[str, bytes]) -> None:
    folder = folder_with(tmp_path, "clip", CLIP_CONFIG)
    decoded = ImagePreprocessor.from_folder(folder).decode(images["jpeg with exif orientation 6"])
    assert decoded.size == (70, 120)  # stored 120 wide and 70 high, shown on its side
    assert decoded.mode == "RGB"


def test_transparency_is_composited_onto_white(tmp_path: Path) -> None:
    clear = encoded(Image.new("RGBA", (10, 10), (0, 0, 0, 0)), "PNG")
    folder = folder_with(tmp_path, "siglip", SIGLIP_CONFIG)
    decoded = ImagePreprocessor.from_folder(folder).decode(clear)
    assert np.all(np.asarray(decoded) == 255)


@pytest.mark.parametrize("resample", [int(member) for member in Image.Resampling])
def test_each_resample_filter_equals_the_processor(tmp_path: Path, images: dict[str, bytes], resample: int) -> None:
    folder = folder_with(tmp_path, "siglip", {**SIGLIP_CONFIG, "resample": resample})
    assert_same_pixels(folder, [images["landscape png"], images["portrait jpeg"], images["3x500 png"]])


@pytest.mark.parametrize(
    ("base", "change"),
    [
        (CLIP_CONFIG, {"size": {"shortest_edge": 200}, "crop_size": {"height": 230, "width": 210}}),  # crop > image
        (CLIP_CONFIG, {"do_resize": False, "crop_size": [100, 150]}),  # no resize: each image cropped or padded
        (CLIP_CONFIG, {"image_processor_type": "CLIPImageProcessorFast"}),  # transformers 5's legacy name
        (CLIP_CONFIG, {"do_rescale": False}),
        (CLIP_CONFIG, {"do_normalize": False}),
        (CLIP_CONFIG, {"image_mean": 0.4, "image_std": 0.2}),  # one number for all channels
        (CLIP_CONFIG, {"size": 256, "default_to_square": True}),  # a number is a square then
        (CLIP_CONFIG, {"resample": 2}),
        (SIGLIP_CONFIG, {"image_processor_type": "SiglipImageProcessorPil"}),
        (SIGLIP_CONFIG, {"size": [200, 260]}),  # [height, width]
        (SIGLIP_CONFIG, {"do_normalize": None, "do_rescale": None}),  # null is off
        (SIGLIP_CONFIG, {"do_center_crop": True, "crop_size": {"height": 100, "width": 120}}),
    ],
)
def test_config_variants_equal_the_processor(
    tmp_path: Path, images: dict[str, bytes], base: dict[str, object], change: dict[str, object]
) -> None:
    chosen = [images[name] for name in ("landscape png", "portrait jpeg", "1x1 png", "500x3 png", "RGBA png")]
    assert_same_pixels(folder_with(tmp_path, "model", {**base, **change}), chosen)


def test_siglip2_fixed_size_equals_the_processor(tmp_path: Path, images: dict[str, bytes]) -> None:
    """SigLIP 2's fixed-size folders name SiglipImageProcessor, bilinear, with `"do_convert_rgb": null`.

    transformers 5 reads that null as off: RGB images are taken as decoded (a transparent colour ignored),
    and the processor fails on any other mode; the server refuses those images by index instead.
    """
    config = {**SIGLIP_CONFIG, "resample": 2, "do_convert_rgb": None, "size": {"height": 256, "width": 256}}
    folder = folder_with(tmp_path, "siglip2", config)
    rgb = {name: data for name, data in images.items() if Image.open(io.BytesIO(data)).mode == "RGB"}
    assert "RGB png with a transparent colour" in rgb and "lossy webp" in rgb
    served = assert_same_pixels(folder, list(rgb.values()))
    assert served.shape == (len(rgb), 3, 256, 256)
    preprocessor = ImagePreprocessor.from_folder(folder)
    for name, data in images.items():
        if name in rgb:
            continue
        with pytest.raises(ValueError, match="mean must have"):
            reference_pixels(folder, [data])
        with pytest.raises(InvalidArgument, match=r"image 4 is a \w+ image of mode \w+, not RGB") as refused:
            preprocessor.pixel_values(data, 4)
        assert refused.value.reason == "image_not_rgb"


def test_an_empty_list_gives_an_empty_batch(tmp_path: Path) -> None:
    preprocessor = ImagePreprocessor.from_folder(folder_with(tmp_path, "clip", CLIP_CONFIG))
    assert preprocessor.encode([]).shape == (0, 3, 224, 224)
    assert preprocessor.output_size == FixedSize(224, 224)


def forged_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (its data is a 1x1 image's)."""
    data = bytearray(encoded(Image.new("RGB", (1, 1)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.fixture
def clip(tmp_path: Path) -> ImagePreprocessor:
    return ImagePreprocessor.from_folder(folder_with(tmp_path, "clip", CLIP_CONFIG))


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (b"", InvalidArgument, "image 2 is empty (0 bytes)"),
        (b"this is not an image", InvalidArgument, "image 2 is not a PNG, JPEG, WebP or GIF image"),
        (encoded(noise(8, 8), "BMP"), InvalidArgument, "image 2 is not a PNG, JPEG, WebP or GIF image"),
        (encoded(noise(8, 8), "TIFF"), InvalidArgument, "image 2 is not a PNG, JPEG, WebP or GIF image"),
        (encoded(noise(300, 200), "PNG")[:2000], InvalidArgument, "image 2: its PNG data does not decode"),
        (encoded(noise(300, 200), "JPEG")[:3000], InvalidArgument, "image 2: its JPEG data does not decode"),
        (forged_png(8000, 7000), RequestTooLarge, "image 2 is 8000x7000 pixels, over the limit of 50000000 pixels"),
        (forged_png(20000, 20000), RequestTooLarge, "image 2: over the limit of 50000000 pixels"),
        (
            encoded(noise(1, 10000), "PNG"),
            RequestTooLarge,
            "image 2: resizing its 1x10000 pixels to shortest edge 224 makes 224x2240000, over the limit",
        ),
    ],
)
def test_bad_images_are_refused_by_their_index(
    clip: ImagePreprocessor, images: dict[str, bytes], bad: bytes, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as refused:
        clip.encode([images["landscape png"], images["RGBA png"], bad])
    assert message in str(refused.value)


def test_the_pixel_bound_is_a_setting(tmp_path: Path, images: dict[str, bytes]) -> None:
    folder = folder_with(tmp_path, "siglip", SIGLIP_CONFIG)
    bounded = ImagePreprocessor.from_folder(folder, max_image_pixels=320 * 200)
    assert bounded.encode([images["landscape png"]]).shape == (1, 3, 224, 224)  # 320x200: at the bound
    with pytest.raises(RequestTooLarge, match=r"image 0 is 321x200 pixels, over the limit of 64000 pixels"):
        bounded.encode([encoded(noise(321, 200), "PNG")])
    with pytest.raises(ValueError, match="max_image_pixels must be between 1 and Pillow's bound"):
        ImagePreprocessor.from_folder(folder, max_image_pixels=Image.MAX_IMAGE_PIXELS + 1)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**SIGLIP_CONFIG, "crop_pct": 0.9}, "field 'crop_pct' is not implemented"),
        ({**SIGLIP_CONFIG, "do_pad": True}, "field 'do_pad' = True is not supported"),
        ({**SIGLIP_CONFIG, "resample": None}, "field 'resample' is null, and 'do_resize' needs it"),
        ({**CLIP_CONFIG, "crop_size": None}, "field 'crop_size' is null, and 'do_center_crop' needs it"),
        ({**CLIP_CONFIG, "do_center_crop": None}, "field 'do_center_crop' must be true unless 'size' is a fixed"),
        ({**SIGLIP_CONFIG, "resample": "bicubic"}, "field 'resample' = 'bicubic' is not one of Pillow's filters"),
        ({**SIGLIP_CONFIG, "resample": 99}, "field 'resample' = 99 is not one of Pillow's filters"),
        ({**CLIP_CONFIG, "size": {"longest_edge": 224}}, "field 'size' = {'longest_edge': 224} is not implemented"),
        (
            {**CLIP_CONFIG, "size": {"shortest_edge": 224, "longest_edge": 300}},
            "field 'size' = {'shortest_edge': 224, 'longest_edge': 300} is not implemented",
        ),
        ({**CLIP_CONFIG, "crop_size": {"shortest_edge": 224}}, "field 'crop_size' = {'shortest_edge': 224}"),
        ({**SIGLIP_CONFIG, "size": {"shortest_edge": 224}}, "field 'do_center_crop' must be true"),
        ({**SIGLIP_CONFIG, "image_mean": [0.5, 0.5]}, "field 'image_mean' must be a number or 3 numbers"),
        ({**SIGLIP_CONFIG, "image_std": [0.5, 0, 0.5]}, "field 'image_std' must not hold 0"),
        ({**SIGLIP_CONFIG, "do_resize": "yes"}, "field 'do_resize' must be true, false or null"),
        ({**SIGLIP_CONFIG, "size": {"height": 0, "width": 224}}, "field 'size' must hold positive whole numbers"),
        ({**SIGLIP_CONFIG, "image_processor_type": "ViTImageProcessor"}, "'ViTImageProcessor' is not implemented"),
        (
            {**SIGLIP_CONFIG, "image_processor_type": "Siglip2ImageProcessorFast", "max_num_patches": 256},
            "Siglip2ImageProcessorFast (SigLIP 2's NaFlex",
        ),
        ({"size": 224}, "names no 'image_processor_type'"),
        ({**CLIP_CONFIG, "auto_map": {"AutoImageProcessor": "x.Y"}}, "field 'auto_map' names remote code"),
    ],
)
def test_configs_it_cannot_follow_are_refused_by_field(tmp_path: Path, config: dict[str, object], message: str) -> None:
    with pytest.raises(RepositoryError, match=r"preprocessor_config\.json: ") as refused:
        ImagePreprocessor.from_folder(folder_with(tmp_path, "model", config))
    assert message in str(refused.value)


def test_a_missing_or_broken_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match=r"preprocessor_config\.json"):
        ImagePreprocessor.from_folder(tmp_path)
    (tmp_path / PREPROCESSOR_CONFIG).write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(RepositoryError, match="must hold a JSON object"):
        ImagePreprocessor.from_folder(tmp_path)

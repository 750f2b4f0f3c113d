"""Encoded images -> pixel values, as a model folder's `preprocessor_config.json` says, without transformers or torch.

`ImagePreprocessor.from_folder(folder)` reads the folder's preprocessor_config.json for the two processor
classes CLIP and SigLIP models ship with: CLIPImageProcessor (a shortest-edge resize, then a centre crop)
and SiglipImageProcessor (a resize to a fixed height and width; SigLIP 2's fixed-size checkpoints use it
too). Their legacy names are read as transformers 5 reads them: `...Fast` and `...Pil` for the class
itself, and a `feature_extractor_type` of CLIPFeatureExtractor where no `image_processor_type` is given.
SigLIP 2's NaFlex processor (Siglip2ImageProcessor: patches at the image's own aspect ratio) is refused.
So is any field this module does not implement, or a value of a field it implements only in part (a
size by longest edge, padding): with the field's name, never approximated. Fields are read as
transformers 5 reads them: a field left out takes the processor class's default, and a field set to
null is off (`"do_convert_rgb": null`, as SigLIP 2's fixed-size folders have it, converts nothing).

`encode(images)` turns encoded images (PNG, JPEG, WebP, GIF's first frame) into float32 pixel values
[n, 3, H, W]; `pixel_values(image, index)` does one, for a caller that answers each image on its own.
Each image is
- decoded with Pillow, after its header's width x height is checked against `max_image_pixels` (the
  decompression-bomb bound: no pixel is decoded over it); the resize's output is bounded the same way,
  so that a 1 x 100,000 strip cannot become 224 x 22,400,000 pixels;
- turned upright by its EXIF orientation (ImageOps.exif_transpose, as transformers' `load_image`);
- converted to RGB as the processor does it (transformers' `convert_to_rgb`): an image with an alpha band
  or a transparency entry (a palette or grey PNG's tRNS, a GIF's transparent index) is composited onto
  white; any other mode is converted by Pillow. Where the folder turns conversion off, only images
  Pillow decodes as RGB are taken, as they are (the processor fails on any other);
- resized with Pillow (the folder's `resample` filter), centre-cropped (padded with black where the
  crop is larger, as transformers does), rescaled in float64 and rounded to float32, and normalised in
  float32: the same operations in the same precision as the processor, so the values are equal.

The reference is the processor `transformers.AutoImageProcessor.from_pretrained(folder)` returns where
torchvision is not installed (none of this project's installs has it): the PIL backend
(CLIPImageProcessorPil, SiglipImageProcessorPil). With torchvision present transformers 5 picks its
torchvision backend instead, whose antialiased tensor resize differs from Pillow's by up to a few
hundredths; this module does not follow that one.

Errors name the image by its index: InvalidArgument for bytes that are not a PNG, JPEG, WebP or GIF
image, that do not decode, or (without conversion) that are not RGB; RequestTooLarge over the pixel
bound. A preprocessor_config.json that cannot be followed is a RepositoryError naming the field.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from service.core.repository import RepositoryError
from service.errors import InvalidArgument, RequestTooLarge

PREPROCESSOR_CONFIG = "preprocessor_config.json"
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""The encodings decoded (Pillow's format names); any other is refused."""
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
"""Width x height an image may have, decoded or resized: a 48-megapixel photo passes; its RGB pixels hold 150 MB."""
CHANNELS = 3

CLIP_PROCESSOR = "CLIPImageProcessor"
SIGLIP_PROCESSOR = "SiglipImageProcessor"
NAFLEX_PROCESSOR = "Siglip2ImageProcessor"
_LEGACY_SUFFIXES = ("Fast", "Pil")
"""transformers 5 reads `CLIPImageProcessorFast` and `CLIPImageProcessorPil` as `CLIPImageProcessor`."""

_IDENTITY_FIELDS = frozenset({"image_processor_type", "feature_extractor_type", "processor_class"})
"""Fields that name classes: read to choose the processor, no part of the pixels."""
_UNUSED_FIELD_VALUES: dict[str, tuple[object, ...]] = {
    "do_pad": (None, False),
    "pad_size": (None,),
    "data_format": (None, "channels_first"),
    "input_data_format": (None,),
    "device": (None,),
    "return_tensors": (None,),
    "disable_grouping": (None,),
}
"""Processing options of transformers' processors accepted only at the values that leave the pixels alone."""
_RESAMPLE_FILTERS = {int(member): member for member in Image.Resampling}
"""transformers' PILImageResampling is Pillow's own Resampling (NEAREST 0, LANCZOS 1, BILINEAR 2, BICUBIC 3, BOX 4,
HAMMING 5, and Pillow 13's MKS2013 6, MKS2021 7): every filter is Pillow's resize, as there."""


@dataclass(frozen=True)
class ShortestEdge:
    """Resize so that the shorter side has `length` pixels, keeping the aspect ratio (the longer side rounded down)."""

    length: int

    def target(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to (transformers' get_resize_output_image_size)."""
        short, long = (width, height) if width <= height else (height, width)
        resized_long = int(self.length * long / short)
        return (resized_long, self.length) if width <= height else (self.length, resized_long)

    def describe(self) -> str:
        """How this resize reads in an error message."""
        return f"to shortest edge {self.length}"


@dataclass(frozen=True)
class FixedSize:
    """A height and a width, in pixels: a resize's target whatever the image's aspect, or a crop."""

    height: int
    width: int

    def target(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) any image is resized to."""
        return self.height, self.width

    def describe(self) -> str:
        """How this resize reads in an error message."""
        return f"to {self.width}x{self.height}"


@dataclass(frozen=True)
class Resize:
    """A resize: to what size, with which of Pillow's filters."""

    size: ShortestEdge | FixedSize
    resample: Image.Resampling


@dataclass(frozen=True)
class _ProcessorDefaults:
    """A processor class's values (its class attributes) for the fields a preprocessor_config.json leaves out."""

    size: ShortestEdge | FixedSize
    crop_size: FixedSize | None
    do_center_crop: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255
    default_to_square: bool = False


_PROCESSOR_DEFAULTS = {
    CLIP_PROCESSOR: _ProcessorDefaults(
        size=ShortestEdge(224),
        crop_size=FixedSize(224, 224),
        do_center_crop=True,
        image_mean=(0.48145466, 0.4578275, 0.40821073),
        image_std=(0.26862954, 0.26130258, 0.27577711),
    ),
    SIGLIP_PROCESSOR: _ProcessorDefaults(
        size=FixedSize(224, 224),
        crop_size=None,
        do_center_crop=False,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    ),
}
_STEP_FIELDS = frozenset(
    {
        "do_convert_rgb",
        "do_resize",
        "size",
        "default_to_square",
        "resample",
        "do_center_crop",
        "crop_size",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
    }
)
"""The fields this module implements."""


@dataclass(frozen=True, eq=False)
class ImagePreprocessor:
    """A model's image preprocessing: encoded images in, float32 pixel values [n, 3, height, width] out.

    Build it with `from_folder`; it holds no state between calls, so worker threads may share one.
    """

    processor_class: str
    """The transformers class whose output this equals: CLIPImageProcessor or SiglipImageProcessor."""
    convert_rgb: bool
    """Whether images are converted to RGB; without, only images Pillow decodes as RGB are taken."""
    resize: Resize | None
    """None: no resize."""
    crop_size: FixedSize | None
    """None: no centre crop."""
    rescale_factor: float | None
    """None: no rescale."""
    image_mean: tuple[float, ...] | None
    """One a channel; None: no normalisation (then image_std is None too)."""
    image_std: tuple[float, ...] | None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Width x height an image may have, as decoded and as resized; at most Pillow's own bomb bound."""
    output_size: FixedSize = field(init=False)
    """The height and width of every image's pixel values: the crop's, else the resize's."""
    _mean: np.ndarray | None = field(init=False, repr=False)
    _std: np.ndarray | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pillow_bound = Image.MAX_IMAGE_PIXELS
        if self.max_image_pixels < 1 or (pillow_bound is not None and self.max_image_pixels > pillow_bound):
            raise ValueError(f"max_image_pixels must be between 1 and Pillow's bound {pillow_bound}")
        output_size = self.crop_size or (self.resize.size if self.resize is not None else None)
        if not isinstance(output_size, FixedSize):
            raise ValueError("without a centre crop, images need a resize to a fixed height and width")
        object.__setattr__(self, "output_size", output_size)
        normalize = self.image_mean is not None and self.image_std is not None
        object.__setattr__(self, "_mean", np.array(self.image_mean, dtype=np.float32) if normalize else None)
        object.__setattr__(self, "_std", np.array(self.image_std, dtype=np.float32) if normalize else None)

    @classmethod
    def from_folder(cls, folder: Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImagePreprocessor:
        """The preprocessing a model folder's preprocessor_config.json describes; RepositoryError where it cannot."""
        return cls.from_file(folder / PREPROCESSOR_CONFIG, max_image_pixels)

    @classmethod
    def from_file(cls, source: Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImagePreprocessor:
        """The preprocessing a preprocessor config file describes; RepositoryError where it cannot."""
        try:
            config = json.loads(source.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise RepositoryError(f"{source}: {error}") from error
        if not isinstance(config, dict):
            raise RepositoryError(f"{source}: must hold a JSON object")
        return _read_config(config, source, max_image_pixels)

    def encode(self, images: Sequence[bytes]) -> np.ndarray:
        """Pixel values of encoded images, float32 [n, 3, height, width]; errors name the image by its index."""
        size = self.output_size
        batch = np.empty((len(images), CHANNELS, size.height, size.width), dtype=np.float32)
        for index, image in enumerate(images):
            batch[index] = self.pixel_values(image, index)
        return batch

    def pixel_values(self, image: bytes, index: int = 0) -> np.ndarray:
        """One encoded image's pixel values, float32 [3, height, width]; `index` names it in errors."""
        rgb = self.decode(image, index)
        if self.resize is not None:
            height, width = self.resize.size.target(rgb.height, rgb.width)
            if height * width > self.max_image_pixels:
                raise RequestTooLarge(
                    f"image {index}: resizing its {rgb.width}x{rgb.height} pixels {self.resize.size.describe()}"
                    f" makes {width}x{height}, over the limit of {self.max_image_pixels} pixels",
                    "image_too_large",
                )
            rgb = rgb.resize((width, height), resample=self.resize.resample)
        pixels = np.asarray(rgb)
        if self.crop_size is not None:
            pixels = _centre_crop(pixels, self.crop_size)
        if self.rescale_factor is not None:
            values = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            values = pixels.astype(np.float32)
        if self._mean is not None and self._std is not None:
            values = (values - self._mean) / self._std
        return np.ascontiguousarray(values.transpose(2, 0, 1))

    def decode(self, image: bytes, index: int = 0) -> Image.Image:
        """An encoded image as an upright RGB Pillow image, its size checked before its pixels are decoded.

        Without `convert_rgb`, an image Pillow decodes in another mode (grey, palette, with alpha, CMYK) is
        refused, as the processor fails on it; an RGB image's transparent colour (tRNS) is ignored, as there.
        """
        if not image:
            raise InvalidArgument(f"image {index} is empty (0 bytes)", "image_unreadable")
        try:
            opened = Image.open(io.BytesIO(image), formats=IMAGE_FORMATS)
        except UnidentifiedImageError as error:
            raise InvalidArgument(
                f"image {index} is not a PNG, JPEG, WebP or GIF image ({len(image)} bytes)", "image_unreadable"
            ) from error
        except Image.DecompressionBombError as error:
            raise RequestTooLarge(
                f"image {index}: over the limit of {self.max_image_pixels} pixels ({error})", "image_too_large"
            ) from error
        width, height = opened.size
        if width * height > self.max_image_pixels:
            raise RequestTooLarge(
                f"image {index} is {width}x{height} pixels, over the limit of {self.max_image_pixels} pixels",
                "image_too_large",
            )
        try:
            opened.load()
            ImageOps.exif_transpose(opened, in_place=True)
            if self.convert_rgb:
                return _rgb(opened)
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise InvalidArgument(
                f"image {index}: its {opened.format} data does not decode ({error})", "image_corrupt"
            ) from error
        if opened.mode != "RGB":
            raise InvalidArgument(
                f"image {index} is a {opened.format} image of mode {opened.mode}, not RGB: this model's processor"
                " does not convert images to RGB (do_convert_rgb is off), so it takes RGB images only",
                "image_not_rgb",
            )
        return opened


def _rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' convert_to_rgb makes it: transparency composited onto white, other modes converted."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _centre_crop(pixels: np.ndarray, size: FixedSize) -> np.ndarray:
    """The centre `size` of pixels [height, width, 3], as transformers' center_crop: black around a smaller image.

    The crop starts at half the margin rounded down; a side shorter than the crop is first padded with
    half the shortfall rounded up before it (so the image sits centred, its odd pixel of padding after it).
    """
    height, width = pixels.shape[:2]
    pad_top = math.ceil(max(size.height - height, 0) / 2)
    pad_left = math.ceil(max(size.width - width, 0) / 2)
    if pad_top or pad_left:
        padded = np.zeros((max(height, size.height), max(width, size.width), CHANNELS), dtype=pixels.dtype)
        padded[pad_top : pad_top + height, pad_left : pad_left + width] = pixels
        pixels = padded
    top = pad_top + (height - size.height) // 2
    left = pad_left + (width - size.width) // 2
    return pixels[top : top + size.height, left : left + size.width]


def _read_config(config: dict[str, object], source: Path, max_image_pixels: int) -> ImagePreprocessor:
    """The preprocessing a preprocessor_config.json's fields describe (`source` names the file in errors).

    As transformers 5 reads the file: a field left out takes the class's default; a field set to null
    is None (the instance attribute shadows the class's), which its steps read as off, or as missing
    where a step that is on needs the value (then the processor fails on every image: refused here).
    """
    processor_class = _processor_class(config, source)
    _refuse_other_fields(config, source, processor_class)
    defaults = _PROCESSOR_DEFAULTS[processor_class]

    def setting(name: str, default: object) -> object:
        return config.get(name) if name in config else default

    def needed(name: str, default: object, step: str) -> object:
        value = setting(name, default)
        if value is None:
            raise RepositoryError(f"{source}: field {name!r} is null, and {step!r} needs it")
        return value

    default_to_square = _flag(setting("default_to_square", defaults.default_to_square), "default_to_square", source)
    resize = None
    if _flag(setting("do_resize", True), "do_resize", source):
        resize = Resize(
            _resize_rule(needed("size", defaults.size, "do_resize"), default_to_square, source),
            _resample(needed("resample", defaults.resample, "do_resize"), source),
        )
    crop_size = None
    if _flag(setting("do_center_crop", defaults.do_center_crop), "do_center_crop", source):
        crop_size = _crop_size(needed("crop_size", defaults.crop_size, "do_center_crop"), source)
    rescale_factor = None
    if _flag(setting("do_rescale", True), "do_rescale", source):
        rescale_factor = _number(
            needed("rescale_factor", defaults.rescale_factor, "do_rescale"), "rescale_factor", source
        )
    image_mean = image_std = None
    if _flag(setting("do_normalize", True), "do_normalize", source):
        image_mean = _per_channel(needed("image_mean", defaults.image_mean, "do_normalize"), "image_mean", source)
        image_std = _per_channel(needed("image_std", defaults.image_std, "do_normalize"), "image_std", source)
        if 0 in image_std:
            raise RepositoryError(f"{source}: field 'image_std' must not hold 0")
    if crop_size is None and not (resize is not None and isinstance(resize.size, FixedSize)):
        raise RepositoryError(
            f"{source}: field 'do_center_crop' must be true unless 'size' is a fixed height and width"
            " (otherwise images of different shapes keep different shapes)"
        )
    return ImagePreprocessor(
        processor_class=processor_class,
        convert_rgb=_flag(setting("do_convert_rgb", True), "do_convert_rgb", source),
        resize=resize,
        crop_size=crop_size,
        rescale_factor=rescale_factor,
        image_mean=image_mean,
        image_std=image_std,
        max_image_pixels=max_image_pixels,
    )


def _refuse_other_fields(config: dict[str, object], source: Path, processor_class: str) -> None:
    """Refuse a field that is not implemented here, or a processing option set to change the pixels."""
    for name, value in config.items():
        if name in _IDENTITY_FIELDS or name in _STEP_FIELDS:
            continue
        if name not in _UNUSED_FIELD_VALUES:
            raise RepositoryError(f"{source}: field {name!r} is not implemented here ({processor_class})")
        if value not in _UNUSED_FIELD_VALUES[name]:
            raise RepositoryError(f"{source}: field {name!r} = {value!r} is not supported (only its default)")


def _processor_class(config: dict[str, object], source: Path) -> str:
    """The processor class the file names, as transformers 5's AutoImageProcessor resolves it."""
    if "auto_map" in config:
        raise RepositoryError(f"{source}: field 'auto_map' names remote code, which is not run here")
    named = config.get("image_processor_type")
    if named is None and isinstance(config.get("feature_extractor_type"), str):
        named = str(config["feature_extractor_type"]).replace("FeatureExtractor", "ImageProcessor")
    if not isinstance(named, str):
        raise RepositoryError(f"{source}: names no 'image_processor_type' (nor a 'feature_extractor_type')")
    base = next((named.removesuffix(suffix) for suffix in _LEGACY_SUFFIXES if named.endswith(suffix)), named)
    if base == NAFLEX_PROCESSOR:
        raise RepositoryError(
            f"{source}: {named} (SigLIP 2's NaFlex patches at each image's own aspect ratio) is not implemented;"
            " SigLIP 2's fixed-size checkpoints (SiglipImageProcessor) are"
        )
    if base not in _PROCESSOR_DEFAULTS:
        raise RepositoryError(
            f"{source}: field 'image_processor_type' = {named!r} is not implemented"
            f" (implemented: {', '.join(_PROCESSOR_DEFAULTS)})"
        )
    return base


def _flag(value: object, name: str, source: Path) -> bool:
    """A step's switch: null is off, as transformers' steps read None."""
    if value is not None and not isinstance(value, bool):
        raise RepositoryError(f"{source}: field {name!r} must be true, false or null, not {value!r}")
    return bool(value)


def _positive_int(value: object, name: str, source: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RepositoryError(f"{source}: field {name!r} must hold positive whole numbers, not {value!r}")
    return value


def _number(value: object, name: str, source: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RepositoryError(f"{source}: field {name!r} must be a finite number, not {value!r}")
    return float(value)


def _per_channel(value: object, name: str, source: Path) -> tuple[float, ...]:
    """A number for each channel, or one number for all (as transformers' normalize takes either)."""
    if not isinstance(value, list):
        return (_number(value, name, source),) * CHANNELS
    if len(value) != CHANNELS:
        raise RepositoryError(f"{source}: field {name!r} must be a number or {CHANNELS} numbers, not {value!r}")
    return tuple(_number(item, name, source) for item in value)


def _height_width(value: object, name: str, source: Path) -> FixedSize | None:
    """A {"height", "width"} object or a [height, width] list; None for any other shape."""
    if isinstance(value, dict) and set(value) == {"height", "width"}:
        return FixedSize(_positive_int(value["height"], name, source), _positive_int(value["width"], name, source))
    if isinstance(value, list) and len(value) == 2:
        return FixedSize(_positive_int(value[0], name, source), _positive_int(value[1], name, source))
    return None


def _resize_rule(value: object, default_to_square: bool, source: Path) -> ShortestEdge | FixedSize:
    """`size` as transformers' get_size_dict reads it: a number is a square or a shortest edge by default_to_square."""
    if isinstance(value, (ShortestEdge, FixedSize)):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        length = _positive_int(value, "size", source)
        return FixedSize(length, length) if default_to_square else ShortestEdge(length)
    if isinstance(value, dict) and set(value) == {"shortest_edge"}:
        return ShortestEdge(_positive_int(value["shortest_edge"], "size", source))
    fixed = _height_width(value, "size", source)
    if fixed is None:
        raise RepositoryError(
            f"{source}: field 'size' = {value!r} is not implemented"
            ' (implemented: {"shortest_edge": n}, {"height": h, "width": w}, n, [h, w])'
        )
    return fixed


def _crop_size(value: object, source: Path) -> FixedSize:
    """`crop_size`: a number is a square, as transformers reads it."""
    if isinstance(value, FixedSize):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        length = _positive_int(value, "crop_size", source)
        return FixedSize(length, length)
    fixed = _height_width(value, "crop_size", source)
    if fixed is None:
        raise RepositoryError(
            f"{source}: field 'crop_size' = {value!r} is not implemented"
            ' (implemented: {"height": h, "width": w}, n, [h, w])'
        )
    return fixed


def _resample(value: object, source: Path) -> Image.Resampling:
    if isinstance(value, bool) or not isinstance(value, int) or value not in _RESAMPLE_FILTERS:
        raise RepositoryError(
            f"{source}: field 'resample' = {value!r} is not one of Pillow's filters {sorted(_RESAMPLE_FILTERS)}"
        )
    return _RESAMPLE_FILTERS[value]

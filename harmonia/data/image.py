"""Images into a fixed-size vision encoder's tiles, with the model's own transformers image processor.

The per-tile numbers (resize filter, centre crop, rescale, mean/std, RGB conversion) are those of the
transformers image processor of the model: read from a checkpoint's ``preprocessor_config.json``
(`ImagePreprocessor.from_pretrained`), or, for harmonia's presets, built from the encoder family's
constants (`FAMILIES`: CLIP, SigLIP, InternViT). transformers does the arithmetic, so the tensors equal
what the model's processor gives.

- ``max_tiles == 1``: one tile, the processor's own path (CLIP: shortest edge, centre crop; SigLIP and
  InternViT: resize to the square).
- ``max_tiles > 1``: InternVL dynamic tiling, done by transformers' GotOcr2 image processor with
  ``crop_to_patches`` and the same per-tile numbers: the grid of at most ``max_tiles`` tiles closest to
  the aspect ratio (`harmonia.workload.shapes.find_tile_grid` counts the same), plus a thumbnail when
  there is more than one tile.
- LLaVA-NeXT anyres (an encoder with ``grid_pinpoints``): the checkpoint's own
  ``LlavaNextImageProcessor`` (or one built with the family's constants), whose tiles are a base
  tile of the whole image then the grid of the best pinpoint (`harmonia.model.anyres` counts them).
- Video frames: one tile each, the processor's own path.

EXIF orientation is applied before anything, and header-only sizes are the oriented ones. An image
with more than ``max_pixels`` pixels is refused from its header (`MediaError` ``too_large``), never
decoded.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from harmonia.data.media_errors import MediaError
from harmonia.errors import ConfigError
from harmonia.model.anyres import pinpoint_grid
from harmonia.model.spec import EncoderSpec
from harmonia.workload.shapes import find_tile_grid

DEFAULT_MAX_PIXELS = 8192 * 8192
"""Largest image (height x width) decoded unless configured otherwise."""

_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that transpose the image


@dataclass(frozen=True)
class ImageFamily:
    """Preprocessing constants of an encoder family (its transformers processor's defaults)."""

    processor: str
    """transformers image processor class of the family."""
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


FAMILIES: dict[str, ImageFamily] = {
    # OPENAI_CLIP_MEAN / _STD (openai/clip-vit-large-patch14-336 preprocessor_config.json); EVA-CLIP too.
    "clip": ImageFamily("CLIPImageProcessor", (0.48145466, 0.4578275, 0.40821073),
                        (0.26862954, 0.26130258, 0.27577711)),
    # IMAGENET_STANDARD_MEAN / _STD (google/siglip-so400m-patch14-384): pixels scaled to [-1, 1].
    "siglip": ImageFamily("SiglipImageProcessor", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    # IMAGENET_DEFAULT_MEAN / _STD (OpenGVLab InternVL checkpoints, GotOcr2ImageProcessor).
    "internvit": ImageFamily("GotOcr2ImageProcessor", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}

# Encoder name prefix -> family, most specific first. The tiny test encoder uses SigLIP's numbers.
_FAMILY_OF_NAME = (("eva-clip", "clip"), ("clip", "clip"), ("siglip", "siglip"), ("internvit", "internvit"),
                   ("tiny-vit", "siglip"))


def encoder_family(encoder: EncoderSpec) -> str:
    """The preprocessing family of a preset vision encoder, from its name; `ConfigError` if unknown."""
    for prefix, family in _FAMILY_OF_NAME:
        if encoder.name.startswith(prefix):
            return family
    raise ConfigError(
        f"no image preprocessing is known for encoder {encoder.name!r}: give its checkpoint directory "
        f"(with preprocessor_config.json) or name its family, one of {sorted(FAMILIES)}"
    )


def _check_fixed_size(encoder: EncoderSpec) -> None:
    if not encoder.is_vision or encoder.native_resolution or encoder.channels != 3:
        raise ConfigError(
            f"encoder {encoder.name!r} is not a fixed-size RGB vision encoder (modalities={encoder.modalities}, "
            f"native_resolution={encoder.native_resolution}, channels={encoder.channels}); images are decoded "
            "only into square RGB tiles"
        )


def _processor_class(name: str, backend: str | None = None):
    """A transformers image processor class by name, in ``backend`` (default: as AutoImageProcessor picks)."""
    import transformers
    from transformers.utils import is_torchvision_available

    backend = backend or ("torchvision" if is_torchvision_available() else "pil")
    return getattr(transformers, name if backend == "torchvision" else f"{name}Pil")


def _side(size, what: str) -> tuple[int, int]:
    """``(height, width)`` of a transformers size dict or SizeDict; `ConfigError` if not a fixed square."""
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    h, w = get("height"), get("width")
    if h is None or w is None:
        raise ConfigError(f"image processor {what}={dict(size) if isinstance(size, dict) else size} gives "
                          "no fixed height and width; a fixed-size encoder needs square tiles")
    return int(h), int(w)


def _output_side(processor) -> tuple[int, int]:
    """``(height, width)`` of what the processor's single-image path returns."""
    if getattr(processor, "do_center_crop", False):
        return _side(processor.crop_size, "crop_size")
    return _side(processor.size, "size")


class ImagePreprocessor:
    """Turns images into the ``(n_tiles, 3, S, S)`` tiles a fixed-size vision encoder takes.

    Args:
        processor: the model's transformers image processor (single-image path, per-tile numbers).
        tile_size: the encoder's ``image_size`` ``S``; the processor must produce ``S x S``.
        max_tiles: most tiles an image is cut into (InternVL dynamic tiling beyond 1).
        max_pixels: images with more pixels are refused from their header.
        grid_pinpoints: the encoder's anyres pinpoints (LLaVA-NeXT); the processor must be a
            ``LlavaNextImageProcessor`` with the same ``image_grid_pinpoints``. Empty: no anyres.
    """

    def __init__(self, processor, tile_size: int, max_tiles: int = 1, max_pixels: int = DEFAULT_MAX_PIXELS,
                 grid_pinpoints: tuple[tuple[int, int], ...] = ()) -> None:
        if not getattr(processor, "do_resize", True):
            raise ConfigError(f"image processor {type(processor).__name__} has do_resize=False; a fixed-size "
                              "encoder needs its images resized to its tiles")
        if _output_side(processor) != (tile_size, tile_size):
            raise ConfigError(
                f"image processor {type(processor).__name__} gives {_output_side(processor)} images but the "
                f"encoder takes {tile_size}x{tile_size} tiles; use the encoder's own preprocessor_config.json"
            )
        if max_tiles < 1 or max_pixels < 1:
            raise ConfigError(f"max_tiles={max_tiles} and max_pixels={max_pixels} must be positive")
        self.processor, self.tile_size, self.max_tiles, self.max_pixels = processor, tile_size, max_tiles, max_pixels
        self.grid_pinpoints = tuple(tuple(p) for p in grid_pinpoints)
        if self.grid_pinpoints:
            _check_anyres_processor(processor, self.grid_pinpoints)
        self.tiler = self._build_tiler() if max_tiles > 1 and not self.grid_pinpoints else None

    @classmethod
    def for_encoder(cls, encoder: EncoderSpec, family: str | None = None,
                    max_pixels: int = DEFAULT_MAX_PIXELS) -> ImagePreprocessor:
        """The preprocessing of a preset encoder: its family's processor at ``encoder.image_size``."""
        _check_fixed_size(encoder)
        family = family or encoder_family(encoder)
        if family not in FAMILIES:
            raise ConfigError(f"unknown image family {family!r}; known: {sorted(FAMILIES)}")
        fam, s = FAMILIES[family], encoder.image_size
        size = {"shortest_edge": s} if fam.processor == "CLIPImageProcessor" else {"height": s, "width": s}
        extra = {"crop_size": {"height": s, "width": s}} if fam.processor == "CLIPImageProcessor" else {}
        name = fam.processor
        if encoder.grid_pinpoints:  # LLaVA-NeXT's processor with the family's per-tile numbers
            name = "LlavaNextImageProcessor"
            extra = {"crop_size": {"height": s, "width": s}, "do_center_crop": fam.processor == "CLIPImageProcessor",
                     "image_grid_pinpoints": [list(p) for p in encoder.grid_pinpoints]}
        processor = _processor_class(name)(size=size, image_mean=list(fam.mean), image_std=list(fam.std), **extra)
        return cls(processor, s, encoder.max_tiles, max_pixels, encoder.grid_pinpoints)

    @classmethod
    def from_pretrained(cls, path: str | Path, encoder: EncoderSpec,
                        max_pixels: int = DEFAULT_MAX_PIXELS) -> ImagePreprocessor:
        """The checkpoint's own image processor (``preprocessor_config.json``), offline.

        Tiling follows the encoder spec's ``max_tiles`` (the scheduler counts tiles from the spec); a
        checkpoint's ``max_patches`` is only its processor's default.
        """
        from transformers import AutoImageProcessor

        if not any((Path(path) / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
            raise ConfigError(f"{path} has no preprocessor_config.json: the image preprocessing of a checkpoint "
                              "comes from it (save the model's processor there)")
        processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        return cls(processor, encoder.image_size, encoder.max_tiles, max_pixels, encoder.grid_pinpoints)

    def _build_tiler(self):
        """GotOcr2 processor with crop_to_patches and this processor's per-tile numbers."""
        p, s = self.processor, self.tile_size
        if hasattr(p, "crop_to_patches"):
            return p
        return _processor_class("GotOcr2ImageProcessor", getattr(p, "backend", None))(
            size={"height": s, "width": s}, resample=p.resample, do_rescale=p.do_rescale,
            rescale_factor=p.rescale_factor, do_normalize=p.do_normalize, image_mean=p.image_mean,
            image_std=p.image_std, do_convert_rgb=p.do_convert_rgb,
        )

    def n_tiles(self, height: int, width: int) -> int:
        """Tiles of an image of this size (thumbnail or anyres base tile included), as `tiles` returns them."""
        if self.grid_pinpoints:
            rows, cols = pinpoint_grid(height, width, self.grid_pinpoints, self.tile_size)
            return 1 + rows * cols
        cols, rows = find_tile_grid(height, width, self.tile_size, self.max_tiles)
        return cols * rows + 1 if cols * rows > 1 else 1

    def tiles(self, img: Image.Image) -> torch.Tensor:
        """An (oriented) image -> ``(n_tiles, 3, S, S)`` float32: the grid row by row, then the thumbnail
        (InternVL); the base tile, then the grid row by row (anyres)."""
        if self.grid_pinpoints:
            out = self.processor(images=[img], return_tensors="pt")["pixel_values"]  # (1, n_tiles, 3, S, S)
            n = self.n_tiles(img.height, img.width)
            if out.ndim != 5 or out.shape[1] != n:
                raise MediaError("unsupported_media", f"the anyres processor gave {tuple(out.shape)} for a "
                                 f"{img.width}x{img.height} image, expected {n} tiles")
            return _checked(out[0], self.tile_size)
        if self.tiler is None:
            return self.frames([img])
        out = self.tiler(images=[img], crop_to_patches=True, min_patches=1, max_patches=self.max_tiles,
                         return_tensors="pt")["pixel_values"]
        return _checked(out, self.tile_size)

    def frames(self, imgs: list[Image.Image]) -> torch.Tensor:
        """One tile per image (video frames): ``(n, 3, S, S)`` float32, the processor's own path."""
        if self.grid_pinpoints:
            raise ConfigError(f"{type(self.processor).__name__} cuts every image into anyres tiles; video frames "
                              "need an encoder without grid_pinpoints")
        extra = {"crop_to_patches": False} if hasattr(self.processor, "crop_to_patches") else {}
        out = self.processor(images=list(imgs), return_tensors="pt", **extra)["pixel_values"]
        return _checked(out, self.tile_size)

    def load(self, data: bytes | str | Path) -> Image.Image:
        """Decode an image, refusing it from its header when over ``max_pixels``; EXIF orientation applied."""
        return load_image(data, self.max_pixels)


def _check_anyres_processor(processor, pinpoints: tuple[tuple[int, int], ...]) -> None:
    """The processor must be LLaVA-NeXT's with the encoder's pinpoints (token counts are the spec's)."""
    given = getattr(processor, "image_grid_pinpoints", None)
    if not type(processor).__name__.startswith("LlavaNextImageProcessor") or given is None:
        raise ConfigError(f"image processor {type(processor).__name__} does not cut images into anyres tiles; an "
                          "encoder with grid_pinpoints (LLaVA-NeXT) needs a LlavaNextImageProcessor")
    if tuple(tuple(p) for p in given) != pinpoints:
        raise ConfigError(f"image processor image_grid_pinpoints={given} but the model's config.json has "
                          f"{[list(p) for p in pinpoints]}; save the processor and model with the same pinpoints")


def _checked(pixels: torch.Tensor, side: int) -> torch.Tensor:
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, side, side):
        raise MediaError("unsupported_media", f"image preprocessing gave {tuple(pixels.shape)}, expected "
                         f"(n, 3, {side}, {side}); an image that is not RGB needs do_convert_rgb")
    return pixels.float()


def _open(data: bytes | str | Path) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
    except UnidentifiedImageError as e:  # its text names the in-memory buffer, not the file
        raise MediaError("corrupt_media", "cannot read image header: not an image format PIL recognises") from e
    except Exception as e:
        raise MediaError("corrupt_media", f"cannot read image header: {type(e).__name__}: {e}") from e


def _orientation(img: Image.Image) -> int:
    """EXIF (or XMP) orientation known from the header, without decoding pixels.

    A PNG's eXIf chunk after its pixels is not seen here (PIL would decode the file to reach it);
    `load_image` then finds the decoded size differs and raises ``shape_mismatch``.
    """
    try:
        return int(Image.Image.getexif(img).get(0x0112, 1))  # the base method never loads pixels
    except Exception:
        return 1


def _oriented_size(img: Image.Image) -> tuple[int, int]:
    """``(height, width)`` after the EXIF orientation."""
    w, h = img.size
    return (w, h) if _orientation(img) in _SWAPS_SIDES else (h, w)


def check_pixels(height: int, width: int, max_pixels: int) -> None:
    """Raise `MediaError` ``too_large`` when ``height * width > max_pixels``."""
    if height * width > max_pixels:
        raise MediaError("too_large", f"image is {width}x{height} = {height * width} pixels, more than "
                         f"max_pixels={max_pixels}; drop or downscale it, or raise max_pixels")


def image_header(data: bytes | str | Path, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """``(height, width)`` of an image after EXIF orientation, from its header only (no pixel decode)."""
    with _open(data) as img:
        h, w = _oriented_size(img)
    if max_pixels is not None:
        check_pixels(h, w, max_pixels)
    return h, w


def load_image(data: bytes | str | Path, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode an image with its EXIF orientation applied (mode left to the processor's RGB conversion).

    Raises:
        MediaError: ``too_large`` from the header, ``corrupt_media`` when it does not decode.
    """
    img = _open(data)
    expected = _oriented_size(img)
    if max_pixels is not None:
        check_pixels(*expected, max_pixels)
    try:
        img = ImageOps.exif_transpose(img)
    except Exception as e:
        raise MediaError("corrupt_media", f"cannot decode image: {type(e).__name__}: {e}") from e
    if (img.height, img.width) != expected:
        raise MediaError("shape_mismatch", f"image header says {expected} (height, width) after its orientation, "
                         f"the decoded image is {(img.height, img.width)}; re-save it with its EXIF first")
    return img

"""A prompt's images, ready for the engine: each image preprocessed, its placeholder run in
the prompt expanded to one token per merged block, its content hashed (the prefix cache and
the encoder cache key on it), and the prompt's M-RoPE ids computed once."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from r3srv.errors import InvalidRequestError
from r3srv.models.specs import VisionSpec
from r3srv.vision.decode import decode_image, rgb
from r3srv.vision.embeds import ImageEmbeds, is_embeds, split_embeds
from r3srv.vision.positions import ImageSpan, mrope_positions
from r3srv.vision.processor import ImageProcessorConfig, preprocess


@dataclass(frozen=True)
class ImageInput:
    span: ImageSpan  # where its placeholder tokens sit in the prompt, and its patch grid
    pixel_values: np.ndarray | None  # [patches, C * T * P * P] float32 (None: given as embeddings)
    content_hash: str  # of the decoded pixels: equal images share cached KV and encoder outputs
    embeds: torch.Tensor | None = None  # the tower's output, given by the caller (vision/embeds.py)

    def num_tokens(self, merge: int) -> int:
        return self.span.num_tokens(merge)


@dataclass(frozen=True)
class MultiModalPrompt:
    images: tuple[ImageInput, ...]
    positions: torch.Tensor  # [3, prompt tokens] M-RoPE ids
    delta: int  # a token after the prompt at index i has ids i + delta
    merge: int

    def positions_between(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] int64 M-RoPE ids of tokens [start, end)."""
        prompt = self.positions.shape[1]
        out = np.empty((3, end - start), dtype=np.int64)
        head = max(0, min(end, prompt) - start)
        out[:, :head] = self.positions[:, start:start + head].numpy()
        out[:, head:] = np.arange(start + head, end) + self.delta
        return out

    def overlaps(self, start: int, end: int) -> list[tuple[ImageInput, int, int]]:
        """(image, first, last + 1) of its tokens that fall in prompt tokens [start, end)."""
        found = []
        for image in self.images:
            first, n = image.span.start, image.num_tokens(self.merge)
            lo, hi = max(start, first), min(end, first + n)
            if lo < hi:
                found.append((image, lo - first, hi - first))
        return found

    def block_keys(self, start: int, end: int) -> tuple:
        """What, besides its token ids, tells a block of tokens [start, end) apart: the content
        and offset of each image it holds placeholders of."""
        return tuple((image.content_hash, lo) for image, lo, _ in self.overlaps(start, end))

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        return [image.span.grid for image in self.images]

    @property
    def placeholders(self) -> list[tuple[int, int]]:
        """Each image's (offset, length) of placeholder tokens in the expanded prompt."""
        return [(image.span.start, image.num_tokens(self.merge)) for image in self.images]


@dataclass(frozen=True)
class ImageInputConfig:
    """What the input processor needs to take a served model's images."""

    spec: VisionSpec
    processor: ImageProcessorConfig
    max_images: int  # per prompt
    max_pixels: int  # per decoded image, checked from its header before its pixels are decoded
    embeds_width: int | None = None  # columns of pre-computed embeddings (vision/embeds.py); None: none taken


def load_image(source, *, param: str, max_pixels: int) -> np.ndarray:
    """(H, W, 3) uint8 from image bytes, a PIL image or such an array."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), param=param, max_pixels=max_pixels)
    if isinstance(source, Image.Image):
        if source.width * source.height > max_pixels:
            raise InvalidRequestError(param=param, problem=f" has more than the {max_pixels} pixels an image may have")
        return rgb(source)
    if isinstance(source, np.ndarray) and source.dtype == np.uint8 and source.ndim == 3 and source.shape[2] == 3:
        return source
    raise InvalidRequestError(param=param, problem=" must be image bytes, a PIL image or an (H, W, 3) uint8 array")


def content_hash(pixels: np.ndarray) -> str:
    digest = hashlib.sha256(repr(pixels.shape).encode())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()


def with_images(ids: list[int], sources: list, config: ImageInputConfig, *, param: str,
                fields: list[str] | None = None) -> tuple[list[int], MultiModalPrompt]:
    """The prompt with each image's placeholder run expanded (a single placeholder token becomes
    one per merged block; a run already that long stays), and the images in prompt order.
    A run count that differs from the images', or a run of another length, is a 400 naming
    `param`; image i's problems name fields[i] (default `param[i]`)."""
    token, merge = config.spec.image_token_id, config.spec.merge_size
    fields = fields or [f"{param}[{k}]" for k in range(len(sources))]
    sources, fields = _one_per_image(sources, fields, merge, config.embeds_width)
    if len(sources) > config.max_images:
        raise InvalidRequestError(param=param, problem=f" holds {len(sources)} images; a prompt may hold at most "
                                  f"{config.max_images} (--max-images-per-prompt)")
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) != len(sources):
        raise InvalidRequestError(param=param, problem=f": the prompt has {len(runs)} image placeholders (runs of "
                                  f"token {token}) for {len(sources)} images")
    out, images, last = [], [], 0
    for k, ((start, length), source) in enumerate(zip(runs, sources)):
        where = fields[k]
        image = _image_input(source, config, where)
        n = image.num_tokens(merge)
        if length not in (1, n):
            raise InvalidRequestError(param=where, problem=f" takes {n} placeholder tokens; the prompt has a run of "
                                      f"{length} (give one, to be expanded, or all {n})")
        out += ids[last:start]
        images.append(dataclasses.replace(image, span=ImageSpan(len(out), image.span.grid)))
        out += [token] * n
        last = start + length
    out += ids[last:]
    positions, delta = mrope_positions(len(out), [image.span for image in images], merge)
    return out, MultiModalPrompt(tuple(images), positions, delta, merge)


def _one_per_image(sources: list, fields: list[str], merge: int, width: int | None) -> tuple[list, list[str]]:
    """Pre-computed embeddings split into one entry per image (an entry may hold several)."""
    out, where = [], []
    for source, field in zip(sources, fields):
        parts = split_embeds(source, param=field, merge=merge, width=width) if is_embeds(source) else [source]
        out += parts
        where += [field] * len(parts)
    return out, where


def _image_input(source, config: ImageInputConfig, where: str) -> ImageInput:
    """An image (or its given embeddings) ready for the tower, its span's start still 0."""
    if isinstance(source, ImageEmbeds):
        return ImageInput(ImageSpan(0, source.grid), None, source.content_hash, source.embeds)
    pixels = load_image(source, param=where, max_pixels=config.max_pixels)
    processed = preprocess(config.processor, pixels, param=where)
    return ImageInput(ImageSpan(0, processed.grid_thw), processed.pixel_values, content_hash(pixels))

"""Generated images for the vision tests: random pixels of several sizes, aspect ratios, modes
and formats, encoded as a client would send them."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# (width, height, mode, format): tall, wide, tiny, odd sizes; alpha, palette with a transparent
# entry, greyscale; lossless and lossy formats
IMAGE_CASES = [
    (64, 48, "RGB", "PNG"), (33, 97, "RGB", "JPEG"), (120, 20, "RGBA", "PNG"), (9, 7, "L", "PNG"),
    (50, 50, "P", "GIF"), (77, 31, "LA", "PNG"), (40, 64, "RGB", "WEBP"), (300, 2, "RGB", "BMP"),
]


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 4), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA").convert(mode) if mode != "P" else None
    if mode == "P":  # a palette image whose entry 0 is transparent
        image = Image.fromarray(pixels[..., 0] % 16, "P")
        image.putpalette(rng.integers(0, 256, size=16 * 3, dtype=np.uint8).tolist())
        image.info["transparency"] = 0
    return image


def encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    kwargs = {"transparency": 0} if fmt == "GIF" and "transparency" in image.info else {}
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def image_bytes(width: int, height: int, mode: str = "RGB", fmt: str = "PNG", seed: int = 0) -> bytes:
    return encode(random_image(width, height, mode, seed), fmt)

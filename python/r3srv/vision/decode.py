"""Image bytes -> an RGB image, as transformers' processors take one; every failure is a 400
naming the request field the bytes came from."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from r3srv.errors import InvalidRequestError

# the formats a client may send (Pillow reads many more, each a parser exposed to the network)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def decode_image(data: bytes, *, param: str, max_pixels: int) -> np.ndarray:
    """The image in `data` as an (H, W, 3) uint8 array: its first frame, transparency composited
    onto white (transformers' convert_to_rgb). An undecodable or truncated image, a format
    outside FORMATS, or one of more than `max_pixels` pixels is an InvalidRequestError naming `param`."""
    if not data:
        raise InvalidRequestError(param=param, problem=" is empty: expected the bytes of an image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size  # from the header: checked before the pixels are decoded
            if width * height > max_pixels:
                raise InvalidRequestError(param=param, problem=f" is {width}x{height} pixels, more than the "
                                          f"{max_pixels} an image may have")
            image.load()
            return rgb(image)
    except InvalidRequestError:
        raise
    except UnidentifiedImageError:
        raise InvalidRequestError(param=param, problem=f" is not an image in a supported format "
                                  f"({', '.join(FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:  # truncated or corrupt data, as Pillow reports it
        raise InvalidRequestError(param=param, problem=f" could not be decoded: {type(exc).__name__}: {exc}") from None


def rgb(image: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8: transparency (an alpha band or a palette's transparent entry) composited
    onto white, as transformers' convert_to_rgb does, else a plain conversion."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return np.array(image.convert("RGB"))

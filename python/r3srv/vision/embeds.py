"""vLLM's pre-computed image embeddings in an offline prompt's multi_modal_data:
`{"image": {"image_embeds": [tokens, width], "image_grid_thw": [t, h, w] or [[t, h, w], ...]}}`,
the tower's output for those images (one row per merged block, images in order), which the
engine then uses instead of running the tower. For Qwen3-VL `width` holds the deepstack
features after the embeddings (vLLM's layout: out_hidden_size * (1 + deepstack layers))."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from r3srv.errors import InvalidRequestError

KEYS = frozenset({"image_embeds", "image_grid_thw"})


@dataclass(frozen=True)
class ImageEmbeds:
    embeds: torch.Tensor  # [tokens, width] float32, on the host
    grid: tuple[int, int, int]

    @property
    def content_hash(self) -> str:
        digest = hashlib.sha256(b"embeds" + repr((self.grid, tuple(self.embeds.shape))).encode())
        digest.update(self.embeds.numpy().tobytes())
        return digest.hexdigest()


def is_embeds(source) -> bool:
    return isinstance(source, Mapping) and "image_embeds" in source


def split_embeds(source: Mapping, *, param: str, merge: int, width: int | None) -> list[ImageEmbeds]:
    """One entry as its images' embeddings, each checked against its grid: rows = t * (h / merge)
    * (w / merge), `width` columns (None: the model takes none). Problems are 400s naming `param`."""
    if width is None:
        raise InvalidRequestError(param=param, problem=": this model takes no pre-computed image embeddings")
    unknown = sorted(set(source) - KEYS)
    if unknown:
        raise InvalidRequestError(param=f"{param}.{unknown[0]}", problem=" is not supported by r3srv "
                                  "(image_embeds and image_grid_thw only)")
    try:
        embeds = torch.as_tensor(source["image_embeds"]).detach().to("cpu", torch.float32)
        grids = np.asarray(torch.as_tensor(source.get("image_grid_thw")).cpu(), dtype=np.int64).reshape(-1, 3)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidRequestError(param=param, problem=": image_embeds must be a [tokens, width] tensor and "
                                  "image_grid_thw each image's [t, h, w]") from None
    if embeds.ndim != 2 or embeds.shape[1] != width:
        raise InvalidRequestError(param=f"{param}.image_embeds", problem=f" has shape {tuple(embeds.shape)}; this "
                                  f"model's are [tokens, {width}]")
    if (grids <= 0).any() or (grids[:, 1:] % merge).any() or not len(grids):
        raise InvalidRequestError(param=f"{param}.image_grid_thw", problem=f": each image's grid is [t, h, w] "
                                  f"with h and w multiples of {merge}")
    sizes = [int(t * (h // merge) * (w // merge)) for t, h, w in grids.tolist()]
    if sum(sizes) != embeds.shape[0]:
        raise InvalidRequestError(param=f"{param}.image_embeds", problem=f" has {embeds.shape[0]} rows; the grids "
                                  f"take {sum(sizes)}")
    return [ImageEmbeds(part.contiguous(), tuple(grid)) for part, grid in zip(embeds.split(sizes), grids.tolist())]

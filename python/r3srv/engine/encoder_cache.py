"""The vision tower behind a cache of its outputs by image content: an image is encoded once
while its outputs stay cached (a conversation re-sending it, an n > 1 request, a preempted
prompt recomputed, a prefill continued in a later chunk), the images a step misses in one
batched call. Least recently used outputs go first once the cache holds more than its
capacity in tokens (never those the step being prepared needs)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from r3srv.models.layers import move_parameters
from r3srv.models.vision.layers import VisionOutput
from r3srv.vision.inputs import ImageInput


class EncoderCache:
    def __init__(self, tower, device: torch.device, dtype: torch.dtype, capacity_tokens: int) -> None:
        self.tower = tower
        self.device = device
        self.dtype = dtype
        self.capacity_tokens = capacity_tokens
        self._outputs: OrderedDict[str, VisionOutput] = OrderedDict()
        self._tokens = 0
        self.images_encoded = 0  # tower calls' images, for metrics and tests
        self.most_tokens_encoded = 0  # the largest call's tokens (the scheduler's encoder budget bounds it)
        self.hits = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._outputs

    def num_cached(self) -> int:
        """How many images' outputs are cached (not __len__: an empty cache is still a cache)."""
        return len(self._outputs)

    def outputs(self, images: list[ImageInput]) -> dict[str, VisionOutput]:
        """Each image's tower output, by content hash; the misses encoded together."""
        missing = list({image.content_hash: image for image in images if image.content_hash not in self._outputs}.values())
        self.hits += len({image.content_hash for image in images}) - len(missing)
        given = [image for image in missing if image.embeds is not None]  # the caller's embeddings: no tower
        for image in given:
            self._store(image, *image.embeds.to(self.device, self.dtype).chunk(1 + self.tower.num_deepstack, dim=1))
        missing = [image for image in missing if image.embeds is None]
        if missing:
            pixels = torch.from_numpy(np.concatenate([image.pixel_values for image in missing]))
            grids = [image.span.grid for image in missing]
            out = self.tower(pixels.to(self.device, self.dtype), grids)
            merge = self.tower.merge_size
            sizes = [image.num_tokens(merge) for image in missing]
            parts = zip(out.embeds.split(sizes), *(d.split(sizes) for d in out.deepstack))
            for image, (embeds, *deepstack) in zip(missing, parts):
                self._store(image, embeds, *deepstack)
            self.images_encoded += len(missing)
            self.most_tokens_encoded = max(self.most_tokens_encoded, sum(sizes))
        wanted = {image.content_hash for image in images}
        for key in wanted:
            self._outputs.move_to_end(key)
        self._evict(keep=wanted)
        return {key: self._outputs[key] for key in wanted}

    def _store(self, image: ImageInput, embeds: torch.Tensor, *deepstack: torch.Tensor) -> None:
        self._outputs[image.content_hash] = VisionOutput(embeds, list(deepstack))
        self._tokens += embeds.shape[0]

    def _evict(self, keep: set[str]) -> None:
        for key in list(self._outputs):
            if self._tokens <= self.capacity_tokens:
                return
            if key not in keep:
                self._tokens -= self._outputs.pop(key).embeds.shape[0]

    def clear(self) -> None:
        """Forget every output (the tower's weights changed)."""
        self._outputs.clear()
        self._tokens = 0

    def release_tower(self) -> None:
        """The tower's weights to the host (release_memory's "weights": pinned, from a GPU),
        until `resume_tower`."""
        move_parameters(self.tower, "cpu")

    def resume_tower(self) -> None:
        move_parameters(self.tower, self.device)

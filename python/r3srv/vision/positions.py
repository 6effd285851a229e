"""The M-RoPE position ids of a prompt with images, as the vision-language families number them
(transformers' get_rope_index): text counts up one per token; an image's tokens take the
temporal id of where it starts and height / width ids that run over its merged grid from there;
the text after it resumes past the larger of its two sides. Every token after the prompt (a
sampled one) has index + delta on all three axes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSpan:
    start: int  # prompt index of the image's first placeholder token
    grid: tuple[int, int, int]  # its (t, h, w) patch grid; merge_size**2 patches per token

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * (h // merge) * (w // merge)


def mrope_positions(num_tokens: int, spans: list[ImageSpan], merge: int) -> tuple[torch.Tensor, int]:
    """([3, num_tokens] int64 position ids, delta): `spans` in prompt order, not overlapping."""
    pieces, index, pos = [], 0, 0
    for span in spans:
        if span.start < index or span.start + span.num_tokens(merge) > num_tokens:
            raise ValueError(f"image span {span} overlaps another or runs past the {num_tokens} prompt tokens")
        pieces.append(torch.arange(span.start - index).expand(3, -1) + pos)
        pos += span.start - index
        t, h, w = span.grid[0], span.grid[1] // merge, span.grid[2] // merge
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pieces.append(torch.stack(grid).reshape(3, -1) + pos)
        pos += max(h, w)
        index = span.start + span.num_tokens(merge)
    pieces.append(torch.arange(num_tokens - index).expand(3, -1) + pos)
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens if num_tokens else 0

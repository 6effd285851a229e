"""Vision towers of the vision-language families (one module per tower: qwen3_vl.py for
Qwen3-VL and Qwen3.5, glm4v.py for GLM-4.5V; shared pieces in layers.py) and their loading
from the checkpoint's model.visual.* tensors. A family names its tower (Family.vision_tower)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from r3srv.errors import ConfigError

PREFIX = "model.visual."  # where every supported checkpoint keeps its vision tower


def load_vision_tower(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> nn.Module:
    """The vision tower of the checkpoint at `path`, its weights read from model.visual.* and
    cast to `dtype`; ConfigError for a family without one, a missing tensor or a wrong shape."""
    from r3srv.models.families import family_of

    path = Path(path)
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    family = family_of(raw)
    if family.vision_tower is None or not isinstance(raw.get("vision_config"), dict):
        raise ConfigError(f"{path}: {family.name} checkpoints have no vision tower r3srv can serve")
    tower = family.vision_tower(raw["vision_config"], dtype, torch.device(device))
    found = tower_tensors_in(path)
    check_tower_tensors(tower, {name: shape for name, (_, shape) in found.items()}, where=str(path), complete=True)
    copy_tower_tensors(tower, found)
    return tower.eval()


def tower_tensors_in(path: str | os.PathLike) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """The checkpoint's model.visual.* tensors: where each is and its shape (headers only)."""
    from r3srv.models.loader import safetensors_files

    found = {}
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    found[name] = (file, tuple(f.get_slice(name).get_shape()))
    return found


def check_tower_tensors(tower: nn.Module, shapes: dict[str, tuple[int, ...]], *, where: str, complete: bool,
                        strict: bool = False) -> list[str]:
    """The tower's parameters (checkpoint names) that tensors of these names and shapes leave
    unfilled; a ConfigError for a wrong shape, with `strict` for a name the tower does not use
    (a checkpoint's are ignored, as the language model's loader ignores them), with `complete`
    for any left unfilled. Reads shapes only, so it runs before any weight is copied."""
    params = dict(tower.named_parameters())
    for name, shape in shapes.items():
        param = params.get(name.removeprefix(PREFIX))
        if param is None:
            if strict:
                raise ConfigError(f"{where}: the vision tower has no tensor named {name}")
            continue
        if tuple(shape) != tuple(param.shape):
            raise ConfigError(f"{where}: tensor {name} has shape {tuple(shape)}, the vision_config implies "
                              f"{tuple(param.shape)}")
    missing = sorted(PREFIX + name for name in params if PREFIX + name not in shapes)
    if complete and missing:
        raise ConfigError(f"{where} lacks vision-tower weights for {len(missing)} parameters, e.g. {missing[:6]}")
    return missing


def copy_tower_tensors(tower: nn.Module, source: dict[str, tuple[Path, tuple[int, ...]]] | dict[str, torch.Tensor]) -> None:
    """Copy checked tensors into the tower (cast to its dtype): a checkpoint's, by file
    (tower_tensors_in), or tensors in memory by name."""
    params = dict(tower.named_parameters())
    with torch.no_grad(), contextlib.ExitStack() as stack:
        opened = {}  # each checkpoint file opened once, however many of its tensors are copied
        for name, where in source.items():
            param = params.get(name.removeprefix(PREFIX))
            if param is None:
                continue
            if isinstance(where, torch.Tensor):
                param.copy_(where)
                continue
            if where[0] not in opened:
                opened[where[0]] = stack.enter_context(safe_open(str(where[0]), framework="pt", device="cpu"))
            param.copy_(opened[where[0]].get_tensor(name))

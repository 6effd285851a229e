"""Vision towers of the vision-language families (one module per tower: qwen3_vl.py for
Qwen3-VL and Qwen3.5, glm4v.py for GLM-4.5V; shared pieces in layers.py) and their loading
from the checkpoint's model.visual.* tensors. A family names its tower (Family.vision_tower)."""

from __future__ import annotations

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
    from r3srv.models.loader import safetensors_files

    path = Path(path)
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    family = family_of(raw)
    if family.vision_tower is None or not isinstance(raw.get("vision_config"), dict):
        raise ConfigError(f"{path}: {family.name} checkpoints have no vision tower r3srv can serve")
    tower = family.vision_tower(raw["vision_config"], dtype, torch.device(device))
    params = dict(tower.named_parameters())
    filled = set()
    with torch.no_grad():
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    param = params.get(name.removeprefix(PREFIX)) if name.startswith(PREFIX) else None
                    if param is None:
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ConfigError(f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, the "
                                          f"vision_config implies {tuple(param.shape)}")
                    param.copy_(tensor)
                    filled.add(name.removeprefix(PREFIX))
    missing = sorted(set(params) - filled)
    if missing:
        raise ConfigError(f"{path}: the checkpoint lacks vision-tower weights {[PREFIX + m for m in missing[:6]]}")
    return tower.eval()

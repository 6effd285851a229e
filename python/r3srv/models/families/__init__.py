"""One module per model family, and the registry that maps config.json's `architectures` to them.

A family module (any module of this package not starting with "_") defines `FAMILY`, a `Family`:
its `architectures`, a `configure` that turns its config.json into the typed specs of
models/specs.py (on top of the shape models/config.py reads for every family), and
`weight_targets`, its checkpoint's tensor names for the model's parameters. docs/models.md
shows a template.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from r3srv.errors import ConfigError
from r3srv.models.families._parsing import Getter

if TYPE_CHECKING:
    import torch

    from r3srv.models.config import ModelConfig
    from r3srv.models.model import MoeForCausalLM

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "Family", "Getter", "family_named", "family_of"]


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.model_type; config.json's model_type picks the family when it lists no architectures
    architectures: tuple[str, ...]  # config.json "architectures" names; the first is the canonical one
    # (the config every family shares, the raw config.json, a Getter over it) -> the config with
    # this family's specs; raises ConfigError naming a key it does not implement
    configure: Callable[[ModelConfig, dict[str, Any], Getter], ModelConfig]
    # the model -> {checkpoint tensor name: the view of our parameter it fills}
    weight_targets: Callable[[MoeForCausalLM], dict[str, torch.Tensor]]
    spellings: dict[str, str] = field(default_factory=dict)  # this family's own key -> the common key
    count_layers: Callable[[dict[str, Any]], int] | None = None  # else num_hidden_layers
    # suffixes of tensor names a checkpoint may hold transposed in their last two dims (the
    # loader tells the layouts apart by shape)
    transposed: tuple[str, ...] = ()
    # (config.json's vision_config, dtype, device) -> the vision tower (models/vision/), for the
    # vision-language families; its weights are the checkpoint's model.visual.* tensors
    vision_tower: Callable[[dict[str, Any], torch.dtype, torch.device], torch.nn.Module] | None = None

    def architecture_of(self, raw: dict[str, Any]) -> str:
        listed = [arch for arch in raw.get("architectures") or [] if arch in self.architectures]
        return listed[0] if listed else self.architectures[0]

    def standard_spellings(self, raw: dict[str, Any]) -> dict[str, Any]:
        """raw with this family's own spellings of common keys added under the common names."""
        if not self.spellings:
            return raw
        return {**{common: raw[own] for own, common in self.spellings.items() if own in raw}, **raw}


def _discover() -> dict[str, Family]:
    families = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not module.name.startswith("_"):
            family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
            families[family.name] = family
    return families


FAMILIES: dict[str, Family] = _discover()
_BY_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES.values() for arch in f.architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCHITECTURE)


def family_named(name: str) -> Family:
    return FAMILIES[name]


def family_of(raw: dict[str, Any]) -> Family:
    """The family of a config.json: its first supported `architectures` name, else its model_type."""
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if not archs and raw.get("model_type") in FAMILIES:
        return FAMILIES[raw["model_type"]]
    found = ", ".join(archs) or f"model_type={raw.get('model_type')!r}"
    raise ConfigError(f"unsupported model architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

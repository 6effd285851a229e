"""vLLM's LoRARequest over r3srv's named adapters. vLLM code names an adapter per request by a
LoRARequest (name, integer id, path) and vLLM loads it from its path the first time that id is
seen (again with load_inplace); r3srv selects an adapter by name once it is loaded
(load_lora_adapter). `LoraIds` keeps the ids the compat layer has loaded and says what to load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3srv.errors import InvalidRequestError


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """vLLM's LoRARequest, field for field (base_model_name and is_3d_lora_weight are read by
    vLLM's listing and mixed-layout loading; r3srv reads either expert layout by itself)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:  # vLLM's: one adapter per name across engines
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


class LoraIds:
    """The adapters vLLM code has named, by lora_int_id -> r3srv adapter name."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}

    def to_load(self, request: Any) -> tuple[str, str | None]:
        """(the adapter's name, the path to load it from first; None: loaded already). `request`
        is vLLM's LoRARequest or anything with its fields (vLLM's own class included)."""
        try:
            name, lora_id = str(request.lora_name), int(request.lora_int_id)
            path, in_place = str(getattr(request, "lora_path", "") or ""), bool(getattr(request, "load_inplace", False))
        except (AttributeError, TypeError, ValueError):
            raise InvalidRequestError(f"lora_request must be a LoRARequest (lora_name, lora_int_id, lora_path), got "
                                      f"{type(request).__name__}", param="lora_request") from None
        known = self.names.get(lora_id)
        if known is not None and known != name:
            raise InvalidRequestError(f"lora_int_id {lora_id} names adapter {known!r}, not {name!r}: one id per adapter",
                                      param="lora_request")
        if known is not None and not in_place:
            return name, None
        if not path:
            raise InvalidRequestError(f"LoRA adapter {name!r} (id {lora_id}) is not loaded and names no lora_path",
                                      param="lora_request")
        return name, path

    def loaded(self, request: Any) -> None:
        self.names[int(request.lora_int_id)] = str(request.lora_name)

    def remove(self, lora_id: int) -> str | None:
        return self.names.pop(int(lora_id), None)

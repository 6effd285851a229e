"""LoRA adapter routes: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, SGLang's
/load_lora_adapter and /unload_lora_adapter (their request classes' fields, field for field)."""

from __future__ import annotations

from msgspec import Struct

from r3srv.errors import InvalidRequestError


class VllmLoadLoraRequest(Struct, kw_only=True):
    """vLLM 0.33's LoadLoRAAdapterRequest."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of this name (else: a 400 when the name exists)
    is_3d_lora_weight: bool = False  # vLLM's hint for 3-D expert tensors: r3srv reads the layout itself


class VllmUnloadLoraRequest(Struct, kw_only=True):
    """vLLM 0.33's UnloadLoRAAdapterRequest."""

    lora_name: str
    lora_int_id: int | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id is not None:
            raise InvalidRequestError(param="lora_int_id", problem=" is not supported by r3srv: name the adapter")


class SglangLoadLoraRequest(Struct, kw_only=True):
    """SGLang 0.5.23's LoadLoRAAdapterReqInput."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # kept in host memory whatever --max-cpu-loras says
    lora_id: str | None = None  # SGLang's tokenizer manager sets it; a client may not

    def __post_init__(self) -> None:
        _no_lora_id(self.lora_id)


class SglangUnloadLoraRequest(Struct, kw_only=True):
    """SGLang 0.5.23's UnloadLoRAAdapterReqInput."""

    lora_name: str
    lora_id: str | None = None

    def __post_init__(self) -> None:
        _no_lora_id(self.lora_id)


def _no_lora_id(lora_id: str | None) -> None:
    if lora_id is not None:
        raise InvalidRequestError(param="lora_id", problem=" is an internal field of SGLang, not part of r3srv's API")


class SglangLoraUpdateOutput(Struct, kw_only=True):
    """SGLang's LoRAUpdateOutput: the adapters loaded afterwards, name -> path."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None

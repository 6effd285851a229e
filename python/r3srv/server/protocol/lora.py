"""LoRA adapter routes: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, SGLang's
/load_lora_adapter, /load_lora_adapter_from_tensors and /unload_lora_adapter (their request
classes' fields, field for field), and r3srv's /load_lora_adapter_from_distributed."""

from __future__ import annotations

from typing import Any

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


class SglangLoadLoraFromTensorsRequest(Struct, kw_only=True):
    """SGLang 0.5.23's LoadLoRAAdapterFromTensorsReqInput: a trainer on the same GPU pushes an
    adapter from memory (PEFT's config and its tensors as CUDA IPC handles)."""

    lora_name: str
    config_dict: dict[str, Any]  # PEFT's adapter_config.json
    serialized_named_tensors: list[str]  # base64 ForkingPickler payloads of {name: tensor}, one per rank
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None  # name -> sha256 of the tensor's bytes, checked

    def __post_init__(self) -> None:
        _no_lora_id(self.lora_id)
        if self.added_tokens_config:
            raise InvalidRequestError(param="added_tokens_config",
                                      problem=" is not supported by r3srv: adapters add no tokens")
        if self.load_format is not None:
            raise InvalidRequestError(param="load_format", problem=" is not supported by r3srv: send the "
                                      "tensors as a dict (load_format null)")


class LoadLoraFromDistributedRequest(Struct, kw_only=True):
    """r3srv's adapter push over the weight-update group (/init_weights_update_group): SGLang
    0.5.23 sends full weights over that group but adapters only as CUDA IPC handles, so this body
    joins /load_lora_adapter_from_tensors' name and PEFT config to /update_weights_from_distributed's
    announcement; the tensors follow as broadcasts from the trainer (rank 0), in the order named."""

    lora_name: str
    config_dict: dict[str, Any]  # PEFT's adapter_config.json
    names: list[str]  # the adapter's PEFT tensor names (adapter_model.safetensors' keys)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    pinned: bool = False


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

"""Bodies of the trainer weight-sync routes: SGLang 0.5.23's (io_struct.py) and vLLM 0.33's
(entrypoints/rl/online/api_router.py and its NCCL weight-transfer info classes), with their
field names. A field r3srv does not implement is a 400 naming it, at decode."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct


def _refuse(field: str, why: str) -> None:
    raise ValueError(f"`{field}` {why}")


class InitWeightsUpdateGroupRequest(Struct, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupRequest(Struct, kw_only=True):
    group_name: str = "weight_update_group"


class _SglangUpdate(Struct, kw_only=True):
    flush_cache: bool = True  # the prefix cache is always emptied: its KV belongs to the old weights
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    def __post_init__(self) -> None:
        if self.load_format is not None:
            _refuse("load_format", f"{self.load_format!r} is not supported: send one tensor per name (load_format null)")
        if self.selector == "draft":
            _refuse("selector", "'draft' names a draft model, and r3srv serves none")


class UpdateWeightsFromDistributedRequest(_SglangUpdate, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class UpdateWeightsFromTensorRequest(_SglangUpdate, kw_only=True):
    serialized_named_tensors: list[str]  # base64 ForkingPickler payloads, one per tensor-parallel rank


class SglangResult(Struct, kw_only=True):
    success: bool
    message: str


class UpdateWeightVersionRequest(Struct, kw_only=True):
    """vLLM's and SGLang's /update_weight_version body."""

    new_version: str
    abort_all_requests: bool = False  # SGLang's default is true: r3srv aborts only when asked


# ---------------------------------------------------------------- vLLM 0.33's weight transfer

VLLM_GROUP = "weight_update_group"  # vLLM's init_info names no group: the SGLang default


class VllmInitInfo(Struct, kw_only=True):
    """NCCLWeightTransferInitInfo's fields; the trainer joins with torch.distributed (see
    docs/weight_sync.md), not with vLLM's StatelessProcessGroup, whose store exchange pickles."""

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None

    def __post_init__(self) -> None:
        if self.nccl_unique_id_b64 is not None:
            _refuse("init_info.nccl_unique_id_b64", "is not supported: pass master_address and master_port")
        if self.master_address is None or self.master_port is None:
            _refuse("init_info.master_address", "and init_info.master_port are required")
        if self.packed:
            _refuse("init_info.packed", "true is not supported: the trainer broadcasts one tensor per name")


class VllmInitRequest(Struct, kw_only=True):
    init_info: VllmInitInfo


class VllmUpdateInfo(Struct, kw_only=True):
    """NCCLWeightTransferUpdateInfo's fields (empty lists: the previous call's names again)."""

    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []


class VllmFinishRequest(Struct, kw_only=True):
    weight_version: str | None = None


class PrimeRlUpdateRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """prime-rl's /update_weights body: a directory of safetensors shards (no config.json needed)."""

    weight_dir: str | None


class VllmUpdateRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    update_info: VllmUpdateInfo | list[Any]


class VllmStatus(Struct, kw_only=True):
    status: str


class VllmMessage(Struct, kw_only=True):
    message: str


class WeightVersionResult(Struct, kw_only=True):
    success: bool
    new_version: str


class WeightInfo(Struct, kw_only=True):
    weight_version: str

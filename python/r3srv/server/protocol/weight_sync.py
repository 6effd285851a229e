"""Bodies of the trainer weight-sync routes: SGLang 0.5.23's (io_struct.py) and vLLM 0.33's
(entrypoints/rl/online/api_router.py and its NCCL weight-transfer info classes), with their
field names. A field r3srv does not implement is a 400 naming it, at decode."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from r3srv.errors import InvalidRequestError

from r3srv.engine.vllm_transfer import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS


def _refuse(field: str, why: str) -> None:
    # msgspec keeps it as the cause: the 400 names the field, under the path of its struct
    # (server/body.py; `field` is the struct's own field's name)
    raise InvalidRequestError(param=field, problem=f" {why}")


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



class VllmInitInfo(Struct, kw_only=True):
    """NCCLWeightTransferInitInfo's fields: the trainer opens vLLM's store rendezvous
    (engine/vllm_transfer.py); `packed` and its sizes are the wire layout of every round."""

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        if self.nccl_unique_id_b64 is not None:
            _refuse("nccl_unique_id_b64", "is not supported: pass master_address and master_port")
        if self.master_address is None or self.master_port is None:
            _refuse("master_address", "and master_port are required")
        packing(self)  # sizes checked at decode

    def packing(self) -> dict[str, int] | None:
        return packing(self)


def packing(info: Any) -> dict[str, int] | None:
    """The packed layout an init or update info asks for (Packing's fields), or None."""
    if not info.packed:
        return None
    for name in ("packed_buffer_size_bytes", "packed_num_buffers"):
        if getattr(info, name) < 1:
            _refuse(name, f"must be positive, got {getattr(info, name)}")
    return {"buffer_size_bytes": info.packed_buffer_size_bytes, "num_buffers": info.packed_num_buffers}


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
    """prime-rl's /update_weights body: a directory of safetensors shards (no config.json needed),
    or, once /init_broadcaster joined, the directory of its NCCL_READY marker (the push arrives
    over the broadcaster's group)."""

    weight_dir: str | None


class PrimeRlInitBroadcasterRequest(Struct, kw_only=True):
    """prime-rl's /init_broadcaster body (src/prime_rl/utils/client.py: init_nccl_broadcast)."""

    host: str
    port: int
    rank_offset: int  # this server's first rank among the inference ranks (the trainer's is before them)
    inference_world_size: int
    timeout: float | None = None  # seconds the rendezvous may wait (at most --weight-sync-timeout)
    quantize_in_weight_transfer: bool = False
    session_id: str = "default"

    def __post_init__(self) -> None:
        if self.quantize_in_weight_transfer:
            raise InvalidRequestError("quantize_in_weight_transfer (FP8 kernel-format layers) is not supported: "
                                      "send checkpoint weights", param="quantize_in_weight_transfer")


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


# ---------------------------------------------------------------- SGLang's weight-update session


class BeginWeightUpdateRequest(Struct, kw_only=True):
    """SGLang 0.5.23's BeginWeightUpdateReqInput (miles brackets every update with it)."""

    selector: Literal["target", "draft", "all"] = "all"

    def __post_init__(self) -> None:
        if self.selector == "draft":
            raise InvalidRequestError("selector 'draft' names a draft model, and r3srv serves none", param="selector")


class EndWeightUpdateRequest(Struct, kw_only=True):
    """SGLang 0.5.23's EndWeightUpdateReqInput: no fields of its own."""


# ---------------------------------------------------------------- vLLM's development-mode routes


class SleepStatus(Struct, kw_only=True):
    status: str  # "sleeping"
    level: int


class WakeStatus(Struct, kw_only=True):
    status: str  # "awake" once nothing is released and generation runs again, else "sleeping"
    tags: list[str] | None


class IsSleeping(Struct, kw_only=True):
    is_sleeping: bool


class WorldSize(Struct, kw_only=True):
    world_size: int


class CollectiveRpcRequest(Struct, kw_only=True):
    """vLLM's /collective_rpc body: a method of r3srv's fixed table (engine/rpc.py), never an
    arbitrary name; its arguments as JSON."""

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None  # seconds the answer may take (the call itself goes on, as in vLLM)


class CollectiveRpcResult(Struct, kw_only=True):
    results: list[Any]  # one per rank, as vLLM's workers answer

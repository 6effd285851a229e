"""RL control routes: weight updates from disk, the prefix cache, memory release, pause and
continue (SGLang's names, and vLLM's /reset_prefix_cache and /is_paused).
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct


class UpdateWeightsFromDiskRequest(Struct, kw_only=True):
    model_path: str  # a checkpoint directory of the served architecture, on the server's file system
    abort_all_requests: bool = False  # False: requests in flight finish on the old weights first
    weight_version: str | None = None  # names the new weights in later choices; default: model_path


class UpdateWeightsResponse(Struct, kw_only=True):
    success: bool
    message: str
    weight_version: str


class ResetPrefixCacheResponse(Struct, kw_only=True):
    success: bool
    num_blocks_forgotten: int


class MemoryOccupationRequest(Struct, kw_only=True):
    """SGLang's /release_memory_occupation and /resume_memory_occupation body."""

    tags: list[str] | None = None  # "kv_cache", "weights"; null: both


class MemoryOccupationResponse(Struct, kw_only=True):
    success: bool
    released: list[str]  # what is released after the call


class PauseGenerationRequest(Struct, kw_only=True):
    """SGLang's /pause_generation body. abort: end every request in flight; retract: free the
    running sequences' KV (they recompute, on the weights loaded by then, after
    /continue_generation); in_place: keep everything as it is."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class PauseGenerationResponse(Struct, kw_only=True):
    success: bool
    mode: str
    num_aborted: int  # requests ended with finish_reason "abort"
    num_retracted: int  # running sequences whose KV was freed


class ContinueGenerationResponse(Struct, kw_only=True):
    success: bool
    was_paused: bool


class IsPausedResponse(Struct, kw_only=True):
    is_paused: bool
    mode: str | None = None

"""Response bodies of the discovery, health and load endpoints, named as SGLang 0.5.23 names them.

The SGLang router (sglang-router 0.3.2) reads `model_path` and `served_model_name` from
/server_info and `model_type`/`architectures` from /model_info when it registers a worker,
and `num_tokens` from /get_load for its load monitor; RL frameworks read the parallel sizes,
`enable_memory_saver`, `enable_return_routed_experts` and `weight_version` before they
attach to an engine they did not launch. Keys SGLang sends but r3srv cannot measure are
null, never a made-up number.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct


class ServerInfo(Struct, kw_only=True):
    """SGLang's resolved server arguments (the subset r3srv has), plus live state."""

    model_path: str | None  # the checkpoint of the weights now served (null: the built-in model)
    tokenizer_path: str | None
    served_model_name: str
    weight_version: str
    host: str  # --host and --port as the server was started (miles compares them with the address it was given)
    port: int
    nnodes: int
    node_rank: int
    gpu_id_step: int  # a server's ranks take consecutive devices
    base_gpu_id: int  # the first rank's device index (0 on the CPU)
    tp_size: int
    dp_size: int  # of this replica: a fleet's replicas are separate servers behind the router
    pp_size: int
    ep_size: int
    device: str
    dtype: str
    context_length: int
    page_size: int
    max_total_num_tokens: int
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    disable_radix_cache: bool
    random_seed: int
    enable_return_routed_experts: bool
    # SGLang's flag (--enable-memory-saver): a trainer releases this server's memory between
    # rollouts; r3srv serves the memory routes with --enable-weight-updates either way, as SGLang
    # serves them without the flag.
    enable_memory_saver: bool
    enable_weight_updates: bool
    is_paused: bool
    internal_states: list[dict[str, Any]]
    version: str
    frontend: str = "r3srv"


class ModelInfo(Struct, kw_only=True):
    model_path: str | None
    served_model_name: str
    tokenizer_path: str | None
    is_generation: bool
    preferred_sampling_params: None
    weight_version: str
    load_format: None
    reasoning_parser: None
    tool_call_parser: None
    disaggregation_mode: str
    has_image_understanding: bool
    has_audio_understanding: bool
    model_type: str
    architectures: list[str]


class WeightVersion(Struct, kw_only=True):
    weight_version: str


class Load(Struct, kw_only=True):
    """The core keys of one SGLang LoadSnapshot (`/v1/loads` with include=core)."""

    timestamp: float
    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int | None
    num_used_tokens: int
    num_total_tokens: int
    num_active_tokens: int
    num_prealloc_ready_tokens: int | None
    max_total_num_tokens: int
    max_running_requests: int
    token_usage: float
    gen_throughput: float | None
    cache_hit_rate: float
    utilization: float
    total_prefill_uncached_tokens: int | None
    total_prefill_busy_us: int | None
    decode_moments: list[float] | None


class Loads(Struct, kw_only=True):
    timestamp: str
    version: str
    accelerator: str | None
    num_accelerators: int
    loads: list[Load]


class LegacyLoad(Struct, kw_only=True):
    """One entry of the list older SGLang answered on GET /get_load; sglang-router 0.3.2 sums num_tokens."""

    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int

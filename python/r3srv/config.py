"""Engine and parallel configuration, with the start-up checks that must fail before serving.

Every check raises `ConfigError` (a ValueError) with a message that says what to change.
Checks that need the model (MoE layers, context length, KV pool size) run in
`EngineConfig.finalize`, right after the model is loaded and before any request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from r3srv import settings
from r3srv.errors import ConfigError

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ParallelConfig:
    """Parallelism r3srv can serve with: tensor parallelism over worker processes (one rank per
    device; expert parallelism over the same ranks), no sharded KV layout; the rendezvous of
    the ranks (torch.distributed TCP: node 0's address and a port every node names)."""

    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node)
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size",
                     "tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.data_parallel_size > 1:  # vLLM's flag, which launch scripts pass: say so before loading anything
            raise ConfigError(
                f"data_parallel_size={self.data_parallel_size} is not supported: for more throughput run one "
                "server per replica behind a router; use data_parallel_size=1"
            )
        if not (isinstance(self.nnodes, int) and self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes):
            raise ConfigError(f"node_rank={self.node_rank!r} must be in 0..nnodes-1 (nnodes={self.nnodes!r})")
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of nnodes={self.nnodes} "
                "(every node runs as many ranks)"
            )
        if not (isinstance(self.master_port, int) and 0 <= self.master_port < 65536):
            raise ConfigError(f"master_port={self.master_port!r} must be a TCP port (0: a free one)")
        if self.nnodes > 1 and not self.master_port:
            raise ConfigError("master_port is required with nnodes > 1: every node must name the same port")
        if self.pipeline_parallel_size > 1:
            raise ConfigError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported: routed experts are "
                "captured per layer into one slot-indexed buffer, which a pipeline split across devices "
                "would scatter; use pipeline_parallel_size=1"
            )
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            value = getattr(self, name)
            if value > 1:
                raise ConfigError(
                    f"{name}={value} is not supported: routed-expert rows are indexed by KV slot and "
                    f"cannot follow a context-parallel (sharded) KV layout; use {name}=1"
                )


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the built-in random-weight model
    device: str = "cpu"
    dtype: str = "auto"
    enable_return_routed_experts: bool = True
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_fraction
    # Fraction of the memory free after loading the model (device memory on CUDA,
    # MemAvailable on the CPU) given to the KV cache when num_kv_blocks is None.
    kv_cache_memory_fraction: float | None = None
    max_num_batched_tokens: int = 2048
    # Most logprobs (sampled or prompt) a request may ask for per token, as vLLM's; -1: no limit.
    max_logprobs: int = 20
    seed: int = 0
    # Overlapped scheduling (vLLM's name): the host schedules and prepares step N+1 while the
    # device runs step N; the same tokens and rows as without (docs/architecture.md)
    async_scheduling: bool = False
    weight_version: str = "0"  # names the weights in outputs until an update names new ones
    # Decode steps replayed as CUDA graphs (engine/cuda_graphs.py). None: settings.cuda_graphs ($R3SRV_CUDA_GRAPHS).
    # Off by default until a GPU run has checked them; enforce_eager (vLLM's flag) wins.
    cuda_graphs: bool | None = None
    enforce_eager: bool = False
    # vision-language checkpoints' image inputs: the most per prompt, the most pixels a decoded
    # image may have (checked from its header), and the vision tower's outputs kept for images
    # sent again (in tokens: one per merged block of patches)
    max_images_per_prompt: int = 16
    max_image_pixels: int = 50_000_000
    encoder_cache_tokens: int = 65536
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # accept os.PathLike
        if self.device == "auto":  # the GPU when there is one
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"device={self.device!r} was asked for but CUDA is not available here; use 'cpu'")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_images_per_prompt", self.max_images_per_prompt)
        _positive("max_image_pixels", self.max_image_pixels)
        _positive("encoder_cache_tokens", self.encoder_cache_tokens)
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs={self.max_logprobs} must be -1 (no limit) or >= 0")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_fraction is not None and not (0.0 < self.kv_cache_memory_fraction <= 1.0):
            raise ConfigError(f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r} must be in (0, 1]")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        if self.cuda_graphs is None:
            self.cuda_graphs = settings.current().cuda_graphs

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps are to be captured: asked for, not enforce_eager, on CUDA."""
        return bool(self.cuda_graphs) and not self.enforce_eager and self.device.startswith("cuda")

    def finalize(self, model_config) -> None:
        """Checks that need the loaded model's config; fills max_model_len."""
        if self.enable_return_routed_experts and not model_config.moe_layers:
            raise ConfigError(
                f"enable_return_routed_experts=True, but model {model_config.name!r} has no MoE layers, "
                "so there are no routed experts to return; start without --enable-return-routed-experts"
            )
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}"
            )

    def check_kv_pool(self, num_kv_blocks: int) -> None:
        """A lone sequence of max_model_len tokens must fit the pool, or it could never finish."""
        assert self.max_model_len is not None
        needed = -(-self.max_model_len // self.block_size)
        if num_kv_blocks < needed:
            raise ConfigError(
                f"the KV cache has {num_kv_blocks} blocks of {self.block_size} tokens, fewer than the {needed} "
                f"one sequence of max_model_len={self.max_model_len} needs; lower max_model_len or give the "
                "cache more blocks (num_kv_blocks / kv_cache_memory_fraction)"
            )


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")

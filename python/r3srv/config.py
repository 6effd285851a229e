"""Engine and parallel configuration: every engine option declared once, with the start-up
checks that must fail before serving.

Each option is a field of `EngineConfig` or `ParallelConfig` made with `option(...)`: its
default, its help text and how `r3srv serve` spells it. `r3srv.engine_options` turns these
fields into the serve flags and into the keywords of `LLM`, `AsyncLLM` and
`LLMEngine.from_kwargs`, so an option is written here and nowhere else.

Every check raises `ConfigError` (a ValueError) with a message that says what to change.
Checks that need the model (MoE layers, context length, KV pool size) run in
`EngineConfig.finalize` and `EngineConfig.with_kv_pool`, right after the model is loaded and
before any request; both return a new config (the config is frozen).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from r3srv import settings
from r3srv.errors import ConfigError

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM 0.33's LogprobsMode: raw_* before any processing, processed_* after the sampler's
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_SAME = object()  # serve_default not given: the flag's default is the option's


def option(default: Any, help: str, *, serve_default: Any = _SAME, default_text: str | None = None,
           aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None, positional: bool = False,
           group: str | None = None) -> Any:
    """An engine option: a field whose `r3srv serve` flag is `--` + its name with dashes (vLLM's
    spelling) and whose keyword (LLM, AsyncLLM) is its name.

    help: what it does (the flag's help, without the default, which is added);
    serve_default: where `r3srv serve` must start elsewhere than the library, with the reason
    at the field; default_text: how the default reads when it is not a plain value (None);
    aliases: short flags (vLLM's -tp, ...); choices: the values it takes (shown; the checks below
    enforce them);
    positional: the serve argument without dashes (the model); group: a heading in --help.
    """
    serve_default = default if serve_default is _SAME else serve_default
    metadata = {"help": help, "serve_default": serve_default, "default_text": default_text, "aliases": aliases,
                "choices": choices, "positional": positional, "group": group}
    return field(default=default, metadata={"option": metadata})


_LORA = "LoRA adapters (vLLM's flags; docs/lora.md)"
_MULTI_NODE = "multi-node rendezvous (torch.distributed TCP; see docs/parallelism.md)"


@dataclass(frozen=True)
class ParallelConfig:
    """Parallelism r3srv can serve with: tensor parallelism over worker processes (one rank per
    device; expert parallelism over the same ranks), no sharded KV layout; the rendezvous of
    the ranks (torch.distributed TCP: node 0's address and a port every node names)."""

    pipeline_parallel_size: int = option(1, "pipeline stages (only 1: routed experts are captured into one "
                                         "slot-indexed buffer)", aliases=("-pp",))
    decode_context_parallel_size: int = option(1, "decode context parallelism (only 1: rows follow the KV slots)",
                                               aliases=("-dcp",))
    prefill_context_parallel_size: int = option(1, "prefill context parallelism (only 1: rows follow the KV slots)",
                                                aliases=("-pcp",))
    tensor_parallel_size: int = option(1, "ranks (devices) the model is split over, one worker process each",
                                       aliases=("-tp",))
    data_parallel_size: int = option(1, "serve only, N > 1: N replicas (a device each) behind r3srv's own front on "
                                     "--host/--port, every route served as by one server (docs/fleet.md); the engine "
                                     "itself takes 1",
                                     aliases=("-dp",))
    enable_expert_parallel: bool = option(False, "with -tp N: each rank holds 1/N of the routed experts whole, not a "
                                          "slice of every expert")
    master_addr: str = option("127.0.0.1", "node 0's address", group=_MULTI_NODE)
    master_port: int = option(0, "a port every node names", default_text="a free one, one node", group=_MULTI_NODE)
    nnodes: int = option(1, "nodes the ranks span", group=_MULTI_NODE)
    node_rank: int = option(0, "this node; only node 0 serves HTTP, the others run their ranks' workers",
                            group=_MULTI_NODE)

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


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(None, "checkpoint directory", default_text="the built-in model (RANDOM weights)",
                               positional=True)
    # serve takes the GPU where there is one (as vllm serve); the library stays on the CPU unless asked
    device: str = option("cpu", "auto (CUDA when available, else the CPU), cpu, cuda or cuda:N", serve_default="auto")
    dtype: str = option("auto", "weights' and KV cache's dtype", choices=SUPPORTED_DTYPES)
    # serve returns rows only when asked (vLLM's flag, off by default); the library returns them
    enable_return_routed_experts: bool = option(
        True, "return routed_experts with every completion by default (per request: return_routed_experts)",
        serve_default=False)
    # SGLang's proposed flag (#23999): the router's weight of every routed-experts id, on request
    enable_return_routed_expert_weights: bool = option(
        False, "capture the router's weights beside the routed experts (per request: "
        "return_routed_expert_weights); needs --enable-return-routed-experts")
    # vLLM 0.33's flag: every request's sampling mask by default (per request: return_sampling_mask)
    return_sampling_mask: bool = option(
        False, "return each sampled token's sampling mask (the ids the draw could pick) by default; "
        "per request: return_sampling_mask")
    sampling_mask_max_tokens: int = option(
        4096, "most token ids in one token's sampling mask (SGLang's flag); a request whose support is wider "
        "fails with a 400")
    # SGLang's and vLLM's flag (DeepSeek-V3.2, GLM-5): each token's sparse-attention key selections
    enable_return_indexer_topk: bool = option(
        False, "capture the sparse-attention indexer's selected key positions per token and indexer layer "
        "(DeepSeek-V3.2, GLM-5; per request: return_indexer_topk; the vLLM routes return them on every choice)")
    indexer_topk_max_values: int = option(
        1 << 26, "most indexer top-k values (tokens x indexer layers x index_topk) one request may return; "
        "a request that could return more is refused with a 400")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes")
    max_num_seqs: int = option(64, "sequences per step")
    max_model_len: int | None = option(None, "context length", default_text="the model's max_position_embeddings")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV pool size in blocks", default_text="from kv_cache_memory_fraction")
    kv_cache_memory_fraction: float | None = option(
        None, "share of the memory free after loading the model (device memory on CUDA, MemAvailable on the CPU) "
        "given to the KV cache when num_kv_blocks is not set", default_text="a share set per device kind")
    max_num_batched_tokens: int = option(2048, "tokens per step")
    logprobs_mode: str = option(
        "raw_logprobs", "what logprobs and prompt_logprobs hold (vLLM's flag): the model's logits or their "
        "log-softmax, raw (as the model gave them) or processed (after bans, logit_bias, penalties, temperature, "
        "min_p, top_k and top_p: what the draw read); prompt tokens are never processed (docs/sampling.md)",
        choices=LOGPROBS_MODES)
    max_logprobs: int = option(20, "most logprobs (sampled or prompt) a request may ask for per token, as vLLM's; "
                               "-1: no limit")
    seed: int = option(0, "seeds the noise of requests without a seed of their own")
    async_scheduling: bool = option(False, "overlapped scheduling, as vLLM's flag: prepare the next step while the "
                                    "device runs this one (same tokens and rows; docs/architecture.md)")
    weight_version: str = option("0", "name of the served weights in outputs, until an update names new ones")
    cuda_graphs: bool | None = option(None, "replay decode steps as CUDA graphs (docs/cuda_graphs.md; "
                                      "--enforce-eager wins)", default_text="$R3SRV_CUDA_GRAPHS, else off")
    enforce_eager: bool = option(False, "vLLM's flag: no CUDA graphs, whatever else asks")
    batch_invariant: bool = option(False, "a request's tokens, logprobs and routed experts bitwise the same alone or "
                                   "in any batch, chunked or not, cached or not (docs/replay.md, "
                                   "\"Determinism\")")
    # vision-language checkpoints' image inputs (docs/vision.md)
    max_images_per_prompt: int = option(16, "most images one prompt may hold", group="images")
    max_image_pixels: int = option(50_000_000, "most pixels a decoded image may have (checked from its header "
                                   "before its pixels are decoded)", group="images")
    max_num_encoder_tokens: int = option(2048, "image tokens the vision tower encodes per step at most (a prefill "
                                         "chunk stops before an image that would pass it; an image larger than "
                                         "this still runs, alone)", group="images")
    encoder_cache_tokens: int = option(65536, "vision-tower outputs kept for images sent again, in tokens (one per "
                                       "merged block of patches)", group="images")
    enable_lora: bool = option(False, "serve LoRA adapters (docs/lora.md): slots on every projection an adapter "
                               "may target", group=_LORA)
    max_loras: int = option(1, "adapters in one step (device slots)", group=_LORA)
    max_lora_rank: int = option(16, "the largest rank an adapter may have", group=_LORA)
    max_cpu_loras: int | None = option(None, "adapters kept in host memory; more may be registered, read again from "
                                       "their directories when used", default_text="max_loras", group=_LORA)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        # frozen: the values resolved here are set once, as the constructor's own
        if self.model is not None and not isinstance(self.model, str):
            object.__setattr__(self, "model", str(self.model))  # accept os.PathLike
        if self.device == "auto":  # the GPU when there is one
            import torch

            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
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
        _positive("max_num_encoder_tokens", self.max_num_encoder_tokens)
        _positive("sampling_mask_max_tokens", self.sampling_mask_max_tokens)
        _positive("indexer_topk_max_values", self.indexer_topk_max_values)
        self._check_expert_weights()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode={self.logprobs_mode!r} is not supported; use one of "
                              f"{', '.join(LOGPROBS_MODES)}")
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
            object.__setattr__(self, "cuda_graphs", settings.current().cuda_graphs)
        self._check_lora()

    def _check_expert_weights(self) -> None:
        if not self.enable_return_routed_expert_weights:
            return
        if not self.enable_return_routed_experts:
            raise ConfigError("enable_return_routed_expert_weights=True needs enable_return_routed_experts=True "
                              "(the weights follow the rows); add --enable-return-routed-experts")

    def _check_lora(self) -> None:
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")
        if not self.enable_lora:
            return

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps are to be captured: asked for, not enforce_eager, on CUDA."""
        return bool(self.cuda_graphs) and not self.enforce_eager and self.device.startswith("cuda")

    def finalize(self, model_config) -> EngineConfig:
        """Checks that need the loaded model's config; this config with max_model_len filled."""
        if self.enable_return_routed_experts and not model_config.moe_layers:
            raise ConfigError(
                f"enable_return_routed_experts=True, but model {model_config.name!r} has no MoE layers, "
                "so there are no routed experts to return; start without --enable-return-routed-experts"
            )
        limit = model_config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        return dataclasses.replace(self, max_model_len=self.max_model_len or limit)

    def with_kv_pool(self, num_kv_blocks: int) -> EngineConfig:
        """This config with its KV pool's size; a lone sequence of max_model_len tokens must fit
        the pool, or it could never finish."""
        assert self.max_model_len is not None, "finalize first"
        needed = -(-self.max_model_len // self.block_size)
        if num_kv_blocks < needed:
            raise ConfigError(
                f"the KV cache has {num_kv_blocks} blocks of {self.block_size} tokens, fewer than the {needed} "
                f"one sequence of max_model_len={self.max_model_len} needs; lower max_model_len or give the "
                "cache more blocks (num_kv_blocks / kv_cache_memory_fraction)"
            )
        return dataclasses.replace(self, num_kv_blocks=num_kv_blocks)


def engine_config(model: str | None = None, **options) -> EngineConfig:
    """An EngineConfig from its and ParallelConfig's options as flat keywords (LLM's, the serve
    flags'); an unknown keyword is a ConfigError naming it."""
    parallel_names = {f.name for f in dataclasses.fields(ParallelConfig)}
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "parallel"}
    unknown = sorted(set(options) - parallel_names - engine_names)
    if unknown:
        raise ConfigError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    parallel = ParallelConfig(**{name: value for name, value in options.items() if name in parallel_names})
    return EngineConfig(model=model, parallel=parallel,
                        **{name: value for name, value in options.items() if name in engine_names})


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")

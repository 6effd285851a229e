"""DeepSeek Sparse Attention's selections (--enable-return-indexer-topk): a host buffer by KV slot.

Each indexer layer writes the key positions it selected for every token of a step into the
step's capture ([T, indexer layers, index_topk] int32, ascending, -1 after them; models/dsa.py).
After the step they are scattered to the tokens' KV slots, as the routed experts' rows are
(engine/routed_experts.py), so a prefix-cache hit and a recomputation after preemption give the
selections of the forward pass that wrote those slots' keys.

Stored compactly: int16 where every position fits (max_model_len <= 32767), else int32; the
indexer layers only (GLM-5's shared layers reuse a selection: the SGLang dialect writes them out).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from r3srv.engine.routed_experts import num_routed_rows, step_buffer, token_slots
from r3srv.errors import ConfigError, InvalidRequestError


def storage_dtype(max_model_len: int) -> np.dtype:
    """The narrowest signed type that holds every position below max_model_len and the -1 pad."""
    return np.dtype(np.int16) if max_model_len <= np.iinfo(np.int16).max else np.dtype(np.int32)


def bytes_per_slot(mc, max_model_len: int) -> int:
    """Host bytes the buffer keeps for each KV slot (0 for a model without an indexer)."""
    sparse = mc.attention.sparse
    if sparse is None:
        return 0
    return len(sparse.indexer_layers(mc.num_layers)) * sparse.topk * storage_dtype(max_model_len).itemsize


class IndexerTopkBuffer:
    def __init__(self, num_slots: int, num_layers: int, topk: int, max_model_len: int) -> None:
        self.num_layers, self.topk = num_layers, topk
        self.dtype = storage_dtype(max_model_len)
        self.values = np.zeros((num_slots, num_layers, topk), dtype=self.dtype)  # pages mapped lazily
        self._capture: torch.Tensor | None = None

    @classmethod
    def for_model(cls, mc, num_slots: int, max_model_len: int, available: int | None = None) -> IndexerTopkBuffer:
        """The buffer of a model with an indexer (a ConfigError for one without, and for one
        larger than `available` bytes of host memory: its pages fill as the slots do, so too
        large a buffer would end the process long after start-up)."""
        sparse = mc.attention.sparse
        if sparse is None:
            raise ConfigError(f"enable_return_indexer_topk=True, but {mc.model_type} has no sparse-attention "
                              "indexer (DeepSeek-V3.2 and GLM-5 have one)")
        layers = len(sparse.indexer_layers(mc.num_layers))
        size = num_slots * bytes_per_slot(mc, max_model_len)
        if available is not None and size > available:
            raise ConfigError(
                f"the indexer top-k buffer (enable_return_indexer_topk) of {num_slots} KV slots x {layers} indexer "
                f"layers x {sparse.topk} positions takes {size / 2**30:.2f} GiB of host memory, more than the "
                f"{available / 2**30:.2f} GiB available: lower num_kv_blocks (or max_num_seqs or max_model_len, "
                "which size the automatic pool), or leave enable_return_indexer_topk off")
        return cls(num_slots, layers, sparse.topk, max_model_len)

    @property
    def values_per_token(self) -> int:
        return self.num_layers * self.topk

    def new_capture(self, num_tokens: int, device: torch.device | str) -> torch.Tensor:
        """The step's [num_tokens, layers, topk] int32 capture (every indexer layer writes all
        of its column's rows, so it is never zeroed again)."""
        self._capture = step_buffer(self._capture, num_tokens, (self.num_layers, self.topk), torch.int32, device)
        return self._capture[:num_tokens]

    def store(self, slot_mapping: np.ndarray, capture: torch.Tensor) -> None:
        """Scatter one step's selections to their tokens' slots (a synchronous copy from a device:
        the flag is opt-in and pays for it)."""
        self.values[slot_mapping] = capture.cpu().numpy().astype(self.dtype, copy=False)

    def sequence(self, block_table: np.ndarray | list[int], block_size: int, num_tokens: int,
                 prompt_start: int = 0) -> np.ndarray:
        """A finished sequence's selections from `prompt_start` on, as the rows' first axis
        (num_routed_rows of them): int32 [rows, layers, topk]."""
        end = prompt_start + num_routed_rows(num_tokens, prompt_start)
        return self.values[token_slots(block_table, block_size, prompt_start, end)].astype(np.int32)


@dataclass(frozen=True)
class IndexerTopkLimits:
    """What an engine allows a request to ask of indexer top-k (its input processor checks it)."""

    enabled: bool = False  # --enable-return-indexer-topk
    values_per_token: int | None = None  # indexer layers x index_topk; None: the model has no indexer
    max_values: int = 0  # --indexer-topk-max-values

    @classmethod
    def of(cls, config, mc) -> IndexerTopkLimits:
        sparse = mc.attention.sparse
        per_token = None if sparse is None else len(sparse.indexer_layers(mc.num_layers)) * sparse.topk
        return cls(config.enable_return_indexer_topk, per_token, config.indexer_topk_max_values)

    def resolve(self, params, n_prompt: int, max_tokens: int):
        """`params` with return_indexer_topk resolved (None: the engine's flag), after the checks:
        a 400 naming the field without the flag, for a model without an indexer, for a start past
        the prompt, or when the selections could exceed the cap."""
        want = self.enabled if params.return_indexer_topk is None else params.return_indexer_topk
        start = params.indexer_topk_prompt_start
        if not 0 <= start <= n_prompt:
            raise InvalidRequestError(param="indexer_topk_prompt_start",
                                      problem=f"={start} is outside 0..{n_prompt} (the prompt has {n_prompt} tokens)")
        if want and self.values_per_token is None:
            raise InvalidRequestError("return_indexer_topk=true, but the served model has no sparse-attention "
                                      "indexer (DeepSeek-V3.2 and GLM-5 have one)", param="return_indexer_topk")
        if want and not self.enabled:
            raise InvalidRequestError(
                "return_indexer_topk=true, but this engine was started without indexer top-k capture; start it "
                "with --enable-return-indexer-topk (enable_return_indexer_topk=True)", param="return_indexer_topk")
        if want:
            rows = num_routed_rows(n_prompt + max_tokens, start)
            if rows * self.values_per_token > self.max_values:
                raise InvalidRequestError(
                    f"return_indexer_topk: up to {rows} tokens x {self.values_per_token} values each exceed "
                    f"--indexer-topk-max-values {self.max_values}; ask for fewer tokens or raise the cap",
                    param="indexer_topk_max_values")
        if want == params.return_indexer_topk:
            return params
        return msgspec.structs.replace(params, return_indexer_topk=want)


def every_layer(selections: np.ndarray, mc) -> np.ndarray:
    """[rows, indexer layers, topk] -> [rows, num_layers, topk]: each shared layer (GLM-5) with
    the selection it attends with, the last indexer's before it (SGLang's layout)."""
    return selections[:, mc.attention.sparse.source_layers(mc.num_layers)]

"""The contract between the engine's model runner and a model's forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """One engine step: the new tokens of B sequences, concatenated (T tokens in all)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, KV-cache slot (block_id * block_size + offset) of each token
    query_lens: list[int]  # [B] tokens of each sequence in this step (sum == T)
    context_lens: list[int]  # [B] tokens with valid KV after this step (cached + computed + this step)
    block_tables: torch.Tensor  # [B, max_blocks] int64 (int32 accepted), padded with -1
    logits_indices: torch.Tensor  # [B] int64: the token (index into T) whose logits each sequence samples from
    # [T, num_layers, top_k] integer buffer, zero-filled by the engine; every MoE layer
    # writes the logical expert ids its router picked for token t into [t, layer]. None: no capture.
    routing_capture: torch.Tensor | None = None
    # [T, num_layers, top_k] float32 (--enable-return-routed-expert-weights): each MoE layer
    # copies the weight of each id it wrote into routing_capture to the same place. None: none.
    routing_weights: torch.Tensor | None = None
    # [T, indexer layers, index_topk] int32 (--enable-return-indexer-topk): every indexer layer
    # writes the key positions it selected for token t into [t, its place]. None: no capture.
    indexer_capture: torch.Tensor | None = None
    # [B] linear-attention state slot of each sequence (hybrid models only; None: slot i for
    # sequence i). A sequence whose step starts at position 0 starts from zero states.
    state_slots: list[int] | None = None
    # (snapshot entry, slot): states copied into a slot before the step (a prefix hit resumes)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    # (sequence index, position, snapshot entry): copy the sequence's states right after the
    # token before `position` (a block boundary inside this step) into the entry
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # A decode step replayed as a CUDA graph (engine/cuda_graphs.py): its per-sequence indices as
    # static device tensors, so the forward pass reads nothing from the host lists above.
    graph: "GraphDecodeInputs | None" = None
    # vision-language models: [3, T] M-RoPE ids (temporal, height, width) of each token
    # (r3srv/vision/positions.py; None: all three are `positions`), and the image embeddings
    # that stand in for this step's placeholder tokens
    mrope_positions: torch.Tensor | None = None
    visual: VisualRows | None = None
    # each token's adapter slot (r3srv.lora.slots.LoraBatch); None: every token runs the base model
    lora: "LoraBatch | None" = None


@dataclass
class VisualRows:
    """Image embeddings for some rows of a step (the vision tower's output for the placeholder
    tokens there); Qwen3-VL's deepstack features are added to the same rows after its first
    len(deepstack) decoder layers."""

    rows: torch.Tensor  # [N] int64 indices into the step's T tokens
    embeds: torch.Tensor  # [N, hidden]
    deepstack: list[torch.Tensor] = field(default_factory=list)  # each [N, hidden]

    def to(self, device: torch.device, dtype: torch.dtype) -> VisualRows:
        return VisualRows(self.rows.to(device), self.embeds.to(device, dtype),
                          [d.to(device, dtype) for d in self.deepstack])


@dataclass
class GraphDecodeInputs:
    """A graph-captured decode step's device-side indices: every row computes one token (row i is
    sequence i), padding rows included. The host lists of the batch are the capture's and are
    not read by attention or the recurrent layers."""

    context_lens: torch.Tensor  # [B] int32 keys each row attends to (this token's included)
    state_slots: torch.Tensor | None  # [B] int64 state entries (hybrids); padding rows: a scratch entry
    state_keep: torch.Tensor | None  # [B] float32: 0 for a padding row (starts from zero states)
    # the longest context any row may have (max_model_len): the paged decode kernel picks its
    # split of the contexts from this and the bucket's size, never from the step's data
    max_context: int

"""Turns a scheduled step into a ForwardBatch, runs the model, and hands back the step's rows.

The model owns its paged KV cache (`init_kv_cache`); this module only tells it where
each token's KV goes (slot mapping) and where each sequence's context lives (block
tables). When routed experts are enabled every step captures rows, whether or not
its requests asked for them: a later request may hit these blocks in the prefix cache
(the engine core stores them in its slot-indexed buffer; `rows` here only lends the
reusable capture tensor).
With `graphs` (engine/cuda_graphs.py) a decode step replays a captured CUDA graph instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from r3srv.engine.cuda_graphs import DecodeGraphs, is_graph_decode
from r3srv.engine.indexer_topk import IndexerTopkBuffer
from r3srv.engine.routed_experts import RoutedExpertsBuffer
from r3srv.engine.sequence import Sequence
from r3srv.engine.encoder_cache import EncoderCache
from r3srv.lora.slots import LoraBatch
from r3srv.models.batch import ForwardBatch, VisualRows
from r3srv.transfer import to_device


@dataclass
class RunOutput:
    """A step's float32 logits [len(seqs), vocab], its prompt spans' logits [R, vocab] (None when
    none), its routed-experts capture (None when off; a graph's is valid until its next replay)
    and its tokens' KV slots (where the rows go)."""

    logits: torch.Tensor
    prompt_logits: torch.Tensor | None
    capture: torch.Tensor | None
    slot_mapping: np.ndarray
    weights: torch.Tensor | None = None  # the capture's router weights (float32), when captured
    indexer_topk: torch.Tensor | None = None  # the step's indexer selections (int32), when captured


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device, rows: RoutedExpertsBuffer | None,
                 graphs: DecodeGraphs | None = None, encoder: EncoderCache | None = None,
                 indexer: IndexerTopkBuffer | None = None) -> None:
        self.model = model
        self.encoder = encoder  # a vision-language model's tower and its outputs by image
        self.block_size = block_size
        self.device = device
        self.rows = rows
        self.indexer = indexer  # the indexer top-k capture (--enable-return-indexer-topk)
        self.graphs = graphs
        self.graph_steps = 0  # steps replayed from a graph (tests and benches read it)

    def host_arrays(self, seqs: list[Sequence]) -> tuple[np.ndarray, ...]:
        """The step's input ids, positions, KV slots, block tables (-1 padded), query lengths and
        context lengths after the step, on the host.

        Python touches each sequence once (its new token ids, one memcpy of its block
        table); positions and slots are computed per token in numpy.
        """
        bs = self.block_size
        num_seqs = len(seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=num_seqs)
        query_lens = np.fromiter((s.num_scheduled_tokens for s in seqs), dtype=np.int64, count=num_seqs)
        ends = starts + query_lens
        tables = np.full((num_seqs, max(len(s.block_table) for s in seqs)), -1, dtype=np.int32)
        input_ids: list[int] = []
        for i, seq in enumerate(seqs):
            table = seq.block_table.array
            tables[i, : len(table)] = table
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + seq.num_scheduled_tokens])
        num_tokens = len(input_ids)
        if num_tokens == num_seqs:  # decode-only step: one token per sequence
            owner, positions = np.arange(num_seqs), starts
        else:
            owner = np.repeat(np.arange(num_seqs), query_lens)
            first_row = np.cumsum(query_lens) - query_lens
            positions = np.arange(num_tokens) - first_row[owner] + starts[owner]
        slot_np = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        return np.array(input_ids, dtype=np.int64), positions, slot_np, tables, query_lens, ends

    def prepare(
        self, seqs: list[Sequence], prompt_spans: list[tuple[int, int, int]] = ()
    ) -> tuple[ForwardBatch, np.ndarray]:
        """The step's ForwardBatch, and its KV slots on the host (where the rows go). Its logits
        rows: each sequence's last token, then the `prompt_spans`' positions ((sequence index,
        first position, count) each)."""
        input_ids, positions, slot_np, tables, query_lens, ends = self.host_arrays(seqs)
        num_tokens = len(input_ids)
        dev = self.device
        last_rows = np.cumsum(query_lens) - 1
        if prompt_spans:  # after the B sampling rows: the prompt rows whose logprobs are asked for
            first_row, starts = last_rows - query_lens + 1, ends - query_lens
            last_rows = np.concatenate([last_rows] + [
                np.arange(count) + first_row[i] + (position - starts[i]) for i, position, count in prompt_spans])
        # one transfer that does not wait for the GPU (the last step's work may still run)
        ids, positions_t, slots_t, tables_t, logits_indices = to_device(
            [input_ids, positions, slot_np, tables, last_rows], dev)
        batch = ForwardBatch(
            input_ids=ids,
            positions=positions_t,
            slot_mapping=slots_t,
            query_lens=query_lens.tolist(),
            context_lens=ends.tolist(),
            block_tables=tables_t,
            logits_indices=logits_indices,
            routing_capture=None if self.rows is None else self.rows.new_capture(num_tokens, dev),
            routing_weights=None if self.rows is None else self.rows.new_weight_capture(num_tokens, dev),
            indexer_capture=None if self.indexer is None else self.indexer.new_capture(num_tokens, dev),
            lora=LoraBatch.build([s.lora_slot for s in seqs], query_lens.tolist(), dev),
        )
        if any(s.multimodal is not None for s in seqs):
            batch.mrope_positions, batch.visual = self._vision_inputs(seqs, positions, query_lens)
        if seqs[0].state_slot >= 0:  # a hybrid: every admitted sequence holds a state slot
            batch.state_slots = [s.state_slot for s in seqs]
            batch.state_restores = [(s.restore_from, s.state_slot) for s in seqs if s.restore_from >= 0]
            # the planned snapshots inside this step's tokens (an overlapped step's plan may hold
            # the step before's, not booked yet)
            batch.state_snapshots = [(i, pos, entry) for i, s in enumerate(seqs) for pos, entry in s.snapshot_plan
                                     if s.num_computed_tokens < pos <= s.num_computed_tokens + s.num_scheduled_tokens]
            for s in seqs:
                s.restore_from = -1  # restored by this step
        return batch, slot_np

    def _vision_inputs(self, seqs: list[Sequence], positions: np.ndarray,
                       query_lens: np.ndarray) -> tuple[torch.Tensor, VisualRows | None]:
        """The step's M-RoPE ids (text: three equal ids) and the image embeddings of the
        placeholder tokens it computes (from the encoder cache: each image encoded once)."""
        ids = np.repeat(positions[None], 3, axis=0)
        first_rows = np.cumsum(query_lens) - query_lens
        wanted = [(i, image, lo, hi) for i, seq in enumerate(seqs) if seq.multimodal is not None
                  for image, lo, hi in seq.multimodal.overlaps(seq.num_computed_tokens,
                                                               seq.num_computed_tokens + seq.num_scheduled_tokens)]
        outputs = self.encoder.outputs([image for _, image, _, _ in wanted]) if wanted else {}
        for i, seq in enumerate(seqs):
            if seq.multimodal is not None:
                start = seq.num_computed_tokens
                ids[:, first_rows[i]:first_rows[i] + query_lens[i]] = seq.multimodal.positions_between(
                    start, start + seq.num_scheduled_tokens)
        mrope = to_device([ids], self.device)[0]
        if not wanted:
            return mrope, None
        rows, embeds, deepstack = [], [], []
        for i, image, lo, hi in wanted:
            out = outputs[image.content_hash]
            rows.append(np.arange(lo, hi) + image.span.start - seqs[i].num_computed_tokens + first_rows[i])
            embeds.append(out.embeds[lo:hi])
            deepstack.append([d[lo:hi] for d in out.deepstack])
        return mrope, VisualRows(to_device([np.concatenate(rows)], self.device)[0], torch.cat(embeds),
                                 [torch.cat(layer) for layer in zip(*deepstack)])

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], prompt_spans: list[tuple[int, int, int]] = ()) -> RunOutput:
        """Computes the scheduled tokens of `seqs`, keeping the logits of `prompt_spans`' positions too."""
        # a one-token step inside a prompt whose logprobs are asked for needs its row: no graph
        graphed = self.graphs is not None and not prompt_spans and is_graph_decode(seqs)
        replayed = self._replay(seqs) if graphed else None
        if replayed is not None:
            return replayed
        batch, slot_np = self.prepare(seqs, prompt_spans)
        logits = self.model.forward(batch)
        prompt_logits = logits[len(seqs):] if prompt_spans else None
        return RunOutput(logits[: len(seqs)] if prompt_spans else logits, prompt_logits, batch.routing_capture,
                         slot_np, batch.routing_weights, batch.indexer_capture)

    def _replay(self, seqs: list[Sequence]) -> RunOutput | None:
        input_ids, positions, slot_np, tables, _, _ = self.host_arrays(seqs)
        out = self.graphs.run(seqs, input_ids, positions, slot_np, tables)
        if out is None:
            return None
        self.graph_steps += 1
        logits, capture = out
        return RunOutput(logits, None, capture, slot_np)

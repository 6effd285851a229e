"""The channel rank 0 drives the other tensor-parallel ranks through: one torch.distributed
broadcast per command, of a packed int64 buffer.

A command is a fixed-size packet (header plus inline payload). A step's inputs (the host
side of a ForwardBatch: token ids, positions, KV slots, lengths, block tables, a hybrid's
state slots) fit inline for any decode step of up to a few hundred sequences; a larger
payload (a long prefill) follows in a second broadcast of exactly its length. Nothing is
pickled: every rank unpacks the same integers into the same ForwardBatch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from r3srv.models.batch import ForwardBatch, VisualRows

HEADER = 16  # int64 slots before the payload
PACKET = 4096  # int64 slots broadcast for every command (32 KiB)


class Command(enum.IntEnum):
    STEP = 1  # a forward pass (payload: the packed batch)
    INIT_KV_CACHE = 2  # args: num_blocks, block_size, num_state_slots, num_state_snapshots
    FREE_KV_CACHE = 3
    WEIGHTS_TO_HOST = 4
    WEIGHTS_TO_DEVICE = 5
    LOAD_WEIGHTS = 6  # payload: the checkpoint path, utf-8, one byte per slot
    SHUTDOWN = 7
    # a trainer's weight push (engine/weight_sync.py); payload: the call as JSON, as LOAD_WEIGHTS' path
    JOIN_WEIGHT_GROUP = 8
    LEAVE_WEIGHT_GROUP = 9
    RECEIVE_WEIGHTS = 10
    DROP_STAGED_WEIGHTS = 11
    CHECK_STAGED_WEIGHTS = 12
    APPLY_STAGED_WEIGHTS = 13
    # LoRA (r3srv.lora): args: the number of slots / the slot; an adapter comes by broadcast_object_list
    ENABLE_LORA = 14
    LOAD_LORA_SLOT = 15
    CLEAR_LORA_SLOT = 16


@dataclass
class Message:
    command: Command
    args: list[int]
    payload: np.ndarray  # int64


class StepChannel:
    """Rank 0 `send`s, every other rank `receive`s, in the same order."""

    def __init__(self, device: torch.device) -> None:
        # NCCL moves device tensors only; gloo host ones
        self.device = device
        self.packet = torch.zeros(PACKET, dtype=torch.int64, device=device)

    def send(self, command: Command, args: tuple[int, ...] = (), payload: np.ndarray | None = None) -> None:
        payload = np.zeros(0, dtype=np.int64) if payload is None else payload
        if len(args) > HEADER - 2:
            raise ValueError(f"at most {HEADER - 2} arguments")
        header = np.zeros(HEADER, dtype=np.int64)
        header[0], header[1] = command, len(payload)
        header[2 : 2 + len(args)] = args
        inline = min(len(payload), PACKET - HEADER)
        packet = np.zeros(PACKET, dtype=np.int64)
        packet[:HEADER], packet[HEADER : HEADER + inline] = header, payload[:inline]
        self.packet.copy_(torch.from_numpy(packet))
        dist.broadcast(self.packet, src=0)
        if inline < len(payload):
            dist.broadcast(torch.from_numpy(np.ascontiguousarray(payload[inline:])).to(self.device), src=0)

    def agree(self, ok: bool) -> list[int]:
        """Every rank says whether its part of a command succeeded; all learn which ranks failed."""
        votes = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=self.device)
        votes[dist.get_rank()] = int(not ok)
        dist.all_reduce(votes)
        return [rank for rank, failed in enumerate(votes.tolist()) if failed]

    def receive(self) -> Message:
        dist.broadcast(self.packet, src=0)
        packet = self.packet.cpu().numpy()
        command, size = Command(int(packet[0])), int(packet[1])
        inline = min(size, PACKET - HEADER)
        payload = packet[HEADER : HEADER + inline].copy()
        if inline < size:
            rest = torch.empty(size - inline, dtype=torch.int64, device=self.device)
            dist.broadcast(rest, src=0)
            payload = np.concatenate([payload, rest.cpu().numpy()])
        return Message(command, [int(a) for a in packet[2:HEADER]], payload)


# ---- a ForwardBatch as integers -----------------------------------------------------------
def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.int64).numpy().reshape(-1)


def _float_bits(t: torch.Tensor) -> np.ndarray:
    """A float tensor's values as float32 bit patterns, one per int64 slot (exact for the model
    dtypes: float32 itself, and bfloat16 / float16 widened)."""
    return t.detach().to("cpu", torch.float32).numpy().reshape(-1).view(np.int32).astype(np.int64)


def _from_float_bits(values: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.int32).view(np.float32).reshape(shape).copy())


def pack_batch(batch: ForwardBatch) -> tuple[tuple[int, ...], np.ndarray]:
    """(args, payload) describing `batch` (routing capture aside: only rank 0 captures). An image
    prompt's M-RoPE ids and image embeddings (rank 0's vision tower computed them) travel too."""
    num_seqs, table_cols = batch.block_tables.shape
    slots = batch.state_slots or []
    restores = [v for pair in batch.state_restores for v in pair]
    snapshots = [v for triple in batch.state_snapshots for v in triple]
    visual = batch.visual
    parts = [
        _host(batch.input_ids), _host(batch.positions), _host(batch.slot_mapping),
        np.asarray(batch.query_lens, dtype=np.int64), np.asarray(batch.context_lens, dtype=np.int64),
        _host(batch.block_tables), _host(batch.logits_indices),
        np.asarray(slots, dtype=np.int64), np.asarray(restores, dtype=np.int64), np.asarray(snapshots, dtype=np.int64),
    ]
    if batch.mrope_positions is not None:
        parts.append(_host(batch.mrope_positions))
    if visual is not None:
        parts += [_host(visual.rows), _float_bits(visual.embeds), *(_float_bits(d) for d in visual.deepstack)]
    num_tokens = len(parts[0])
    if batch.lora is not None:  # each token's adapter slot
        parts.append(_host(batch.lora.token_slots))
    rows, hidden = (0, 0) if visual is None else tuple(visual.embeds.shape)
    args = (num_tokens, num_seqs, table_cols, int(batch.state_slots is not None), len(batch.state_restores),
            len(batch.state_snapshots), int(batch.mrope_positions is not None), rows, hidden,
            0 if visual is None else len(visual.deepstack), int(batch.lora is not None))
    return args, np.concatenate(parts)


def unpack_batch(args: list[int], payload: np.ndarray, device: torch.device = torch.device("cpu")) -> ForwardBatch:
    """The batch pack_batch described (its adapters' token slots on `device`, as the model reads them)."""
    num_tokens, num_seqs, table_cols, has_slots, restores, snapshots, has_mrope, rows, hidden, deepstack, has_lora = (
        args[:11])
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs, num_seqs, num_seqs * table_cols, num_seqs,
             num_seqs if has_slots else 0, 2 * restores, 3 * snapshots, 3 * num_tokens if has_mrope else 0, rows,
             rows * hidden * (1 + deepstack), num_tokens if has_lora else 0]
    parts = np.split(payload, np.cumsum(sizes)[:-1])
    ids, positions, slots, query_lens, context_lens, tables, logits_indices, state_slots, rest, snaps = parts[:10]
    mrope, visual_rows, embeds, lora = parts[10:]
    visual = None
    if rows:
        floats = [_from_float_bits(part, (rows, hidden)) for part in np.split(embeds, 1 + deepstack)]
        visual = VisualRows(torch.from_numpy(visual_rows), floats[0], floats[1:])
    lora_batch = None
    if has_lora:
        from r3srv.lora.slots import LoraBatch

        lora_batch = LoraBatch.of_token_slots(torch.from_numpy(lora), device)
    return ForwardBatch(
        mrope_positions=torch.from_numpy(mrope.reshape(3, num_tokens)) if has_mrope else None, visual=visual,
        input_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions), slot_mapping=torch.from_numpy(slots),
        query_lens=query_lens.tolist(), context_lens=context_lens.tolist(),
        block_tables=torch.from_numpy(tables.reshape(num_seqs, table_cols)),
        logits_indices=torch.from_numpy(logits_indices),
        state_slots=state_slots.tolist() if has_slots else None,
        state_restores=[tuple(p) for p in rest.reshape(-1, 2).tolist()],
        state_snapshots=[tuple(t) for t in snaps.reshape(-1, 3).tolist()],
        lora=lora_batch,
    )


def encode_text(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode_text(payload: np.ndarray) -> str:
    return payload.astype(np.uint8).tobytes().decode("utf-8")

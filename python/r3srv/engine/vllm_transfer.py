"""vLLM's NCCL weight transfer, the receiving side, as vLLM's trainer opens it.

vLLM's trainer (`NCCLWeightTransferEngine.trainer_init`, used by SkyRL) is rank 0 of a
`StatelessProcessGroup`: it hosts a plain TCPStore at master_address:master_port, writes its NCCL
unique id there as a pickle (key `broadcast_from/0/0`), builds its NCCL communicator from it and
runs one warm-up all-reduce of a single float32. Its workers connect to the store, read the id,
join as rank `rank_offset + rank`, and answer the warm-up. Then each round broadcasts from rank 0
either one tensor per name ("unpacked") or, "packed", the names' bytes concatenated into uint8
chunks of a little over `packed_buffer_size_bytes` each (a chunk closes after the tensor that
takes it past the size), which both sides cut from the same names, dtypes and shapes.

r3srv never unpickles from the network: the id's pickle is checked opcode by opcode against the
one shape vLLM writes (ctypes' `_unpickle` of `ncclUniqueId` and its 128 bytes) and the bytes are
read out of it (`nccl_unique_id`). On CUDA the server joins the trainer's NCCL communicator with that
id (NcclCommunicator; not yet run on a GPU: it needs two, tests/test_vllm_transfer_gpu.py). On the
CPU the "NCCL" group is gloo, made over the same store (keys under gloo_group_name): the handshake,
the warm-up and the chunk layout are vLLM's, the transport is not.
"""

from __future__ import annotations

import datetime
import math
import pickletools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from r3srv.engine.process_groups import broadcast_from_trainer, group_on_store
from r3srv.errors import InvalidRequestError

UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj's first key from rank 0
UNIQUE_ID_BYTES = 128
GLOO_PREFIX = "r3srv-gloo"  # the CPU stand-in's keys in the trainer's store (gloo_group_name)
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's packed_tensor defaults
DEFAULT_PACKED_NUM_BUFFERS = 2

# What vLLM's pickle of an ncclUniqueId may hold: protocol framing, the two globals, an empty
# state dict, the id's bytes, and the reduce call that rebuilds it. Nothing else is accepted.
_ALLOWED_OPS = frozenset({
    "PROTO", "FRAME", "SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
    "LONG_BINGET", "STACK_GLOBAL", "GLOBAL", "EMPTY_DICT", "SHORT_BINBYTES", "BINBYTES", "TUPLE", "TUPLE2", "MARK",
    "REDUCE", "STOP",
})
_ALLOWED_NAMES = frozenset({"_ctypes", "_unpickle", "vllm.distributed.device_communicators.pynccl_wrapper",
                            "ncclUniqueId"})


def nccl_unique_id(pickled: bytes) -> bytes:
    """The 128 bytes of the ncclUniqueId in vLLM's pickle of it, read without unpickling; a
    ValueError for anything else (another class, another callable, more objects)."""
    strings: set[str] = set()
    payloads: list[bytes] = []
    try:
        for op, arg, _ in pickletools.genops(pickled):
            if op.name not in _ALLOWED_OPS:
                raise ValueError(f"opcode {op.name} is not part of an ncclUniqueId's pickle")
            if op.name == "GLOBAL":
                strings.update(str(arg).split(" "))
            elif isinstance(arg, str) and op.name.endswith("UNICODE"):
                strings.add(arg)
            elif isinstance(arg, bytes):
                payloads.append(arg)
    except (ValueError, TypeError) as exc:  # genops' own complaints about malformed input
        raise ValueError(f"not vLLM's pickle of an ncclUniqueId: {exc}") from None
    if not strings <= _ALLOWED_NAMES or {"_unpickle", "ncclUniqueId"} - strings:
        raise ValueError(f"not vLLM's pickle of an ncclUniqueId: it names {sorted(strings)}")
    if len(payloads) != 1 or len(payloads[0]) != UNIQUE_ID_BYTES:
        raise ValueError(f"not vLLM's pickle of an ncclUniqueId: expected one {UNIQUE_ID_BYTES}-byte id")
    return payloads[0]


@dataclass(frozen=True)
class Packing:
    """The packed wire layout both sides agree on (vLLM 0.33: init_info; vLLM 0.26: update_info)."""

    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS  # the sender's overlap only: no effect on the layout

    def __post_init__(self) -> None:
        if self.buffer_size_bytes < 1:
            raise InvalidRequestError(f"packed_buffer_size_bytes must be positive, got {self.buffer_size_bytes}",
                                      param="packed_buffer_size_bytes")
        if self.num_buffers < 1:
            raise InvalidRequestError(f"packed_num_buffers must be positive, got {self.num_buffers}",
                                      param="packed_num_buffers")

    def chunks(self, metas: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Iterator[list[tuple[str, int]]]:
        """(name, bytes) per tensor, grouped into the chunks vLLM's consumer cuts: a chunk closes
        after the tensor that takes it past buffer_size_bytes; the last holds the rest."""
        chunk: list[tuple[str, int]] = []
        total = 0
        for name, (shape, dtype) in metas.items():
            size = math.prod(shape) * dtype.itemsize
            chunk.append((name, size))
            total += size
            if total > self.buffer_size_bytes:
                yield chunk
                chunk, total = [], 0
        if chunk:
            yield chunk


def receive_packed(group, metas: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   packing: Packing, device: torch.device, on_chunk=None) -> dict[str, torch.Tensor]:
    """Every tensor of `metas`, received as vLLM's packed broadcasts from rank 0 (blocking)."""
    received: dict[str, torch.Tensor] = {}
    for chunk in packing.chunks(metas):
        packed = torch.empty(sum(size for _, size in chunk), dtype=torch.uint8, device=device)
        broadcast_from_trainer(group, [packed])
        for (name, size), part in zip(chunk, packed.split([size for _, size in chunk])):
            shape, dtype = metas[name]
            received[name] = part.view(dtype).view(shape)
        if on_chunk is not None:
            on_chunk(len(received))
    return received


def gloo_group_name(master_port: int) -> str:
    """The CPU stand-in's group, named alike by the trainer and every server rank (and apart from
    another trainer's group in the same server)."""
    return f"{GLOO_PREFIX}-{master_port}"


class NcclCommunicator:
    """CUDA: the NCCL communicator vLLM's trainer made, joined from its unique id through torch's
    own NCCL binding (vLLM's PyNcclCommunicator does the same through ctypes): ncclCommInitRank,
    then the one-float warm-up all-reduce; broadcasts from rank 0 on the current stream."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device) -> None:
        import torch.cuda.nccl as nccl

        self.device = device
        with torch.cuda.device(device):
            self.comm = nccl.init_rank(world_size, unique_id, rank)
            warm_up = torch.zeros(1, dtype=torch.float32, device=device)
            nccl.all_reduce([warm_up], comms=[self.comm])
            torch.cuda.synchronize(device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.cuda.nccl as nccl

        with torch.cuda.device(self.device):
            nccl.broadcast([tensor], root=0, comms=[self.comm])

    def destroy(self) -> None:
        self.comm = None  # torch destroys the communicator with its last reference


def join_vllm_group(*, master_address: str, master_port: int, rank: int, world_size: int, device: torch.device,
                    timeout: float):
    """Connect to the trainer's store, read its NCCL unique id, join the group as `rank`, answer
    the warm-up all-reduce: an NcclCommunicator on CUDA, gloo (the stand-in) on the CPU. Blocking;
    raises on a timeout or a store that is not vLLM's."""
    wait = datetime.timedelta(seconds=timeout)
    # a client counts itself in (wait_for_workers): the trainer's store waits for world_size members
    store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=wait)
    unique_id = nccl_unique_id(store.get(UNIQUE_ID_KEY))  # the trainer's handshake, checked
    if device.type == "cuda":
        return NcclCommunicator(unique_id, rank, world_size, device)
    group = group_on_store(store, rank=rank, world_size=world_size, group_name=gloo_group_name(master_port),
                           backend="gloo", timeout=timeout)
    warm_up = torch.zeros(1, dtype=torch.float32)
    dist.all_reduce(warm_up, group=group)  # PyNcclCommunicator's warm-up, answered
    return group

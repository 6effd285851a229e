"""vLLM's NCCL weight transfer on CUDA: a server rank joins the NCCL communicator a vLLM-style
trainer made (its unique id pickled in the trainer's store, as vLLM's StatelessProcessGroup
stores it) and receives packed and unpacked broadcasts. NCCL needs one GPU per rank: two GPUs."""

from __future__ import annotations

import datetime
import multiprocessing

import pytest
import torch

from r3srv.engine.weight_sync import WeightSync
from r3srv.models.loader import NamedTensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL takes one per rank: the trainer's and the server's)")]


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
            "c": torch.randint(0, 9, (4, 2), generator=g)}


def vllm_trainer(port: int, packed_bytes: int | None) -> None:
    """Rank 0 on cuda:0, as vLLM's trainer: a master store, its unique id pickled (vLLM's bytes
    with a real id in them), ncclCommInitRank, the warm-up all-reduce, then the broadcasts."""
    import torch.cuda.nccl as nccl
    import torch.distributed as dist
    import weight_sync_trainer as trainer

    from r3srv.engine.vllm_transfer import UNIQUE_ID_KEY, nccl_unique_id

    torch.cuda.set_device(0)
    unique_id = nccl.unique_id()
    pickled = trainer.VLLM_UNIQUE_ID.replace(nccl_unique_id(trainer.VLLM_UNIQUE_ID), unique_id)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=60))
    store.set(UNIQUE_ID_KEY, pickled)
    comm = nccl.init_rank(2, unique_id, 0)
    nccl.all_reduce([torch.zeros(1, device="cuda:0")], comms=[comm])
    sent = {n: t.cuda() for n, t in tensors().items()}
    chunks = sent.values() if packed_bytes is None else trainer.vllm_packed(sent, packed_bytes)
    for tensor in chunks:
        nccl.broadcast([tensor.contiguous()], root=0, comms=[comm])
    torch.cuda.synchronize()


@pytest.mark.parametrize("packed_bytes", [None, 40])
def test_a_server_rank_receives_from_a_vllm_trainer_over_nccl(packed_bytes):
    from server_fixture import free_port

    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=vllm_trainer, args=(port, packed_bytes), daemon=True)
    proc.start()
    sync = WeightSync(torch.device("cuda:1"), timeout=60)
    packing = None if packed_bytes is None else {"buffer_size_bytes": packed_bytes, "num_buffers": 2}
    sync.join(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="g",
              backend="nccl", rendezvous="vllm", packing=packing)
    want = tensors()
    sync.receive("g", NamedTensors.of(want))
    proc.join(60)
    assert proc.exitcode == 0
    for name, tensor in want.items():
        assert torch.equal(sync.staged[name].cpu(), tensor)
    sync.leave("g")

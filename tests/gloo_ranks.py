"""Two gloo ranks spawned by a test, meeting at a store the test process hosts.

The store listens (on a port it bound itself) before the ranks start: a port picked free,
released and bound again by rank 0 could be taken meanwhile by another test's process."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_TIMEOUT = timedelta(minutes=5)


def spawn_ranks(rank_main, nprocs: int = 2, **kwargs) -> None:
    """Run `rank_main(rank, store_port, **kwargs)` on `nprocs` processes; raises if a rank fails."""
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, timeout=_TIMEOUT, wait_for_workers=False)
    torch.multiprocessing.spawn(_rank, args=(rank_main, store.port, kwargs), nprocs=nprocs, join=True)


def _rank(rank: int, rank_main, store_port: int, kwargs: dict) -> None:
    rank_main(rank, store_port, **kwargs)


def join_gloo(rank: int, store_port: int, world_size: int = 2) -> None:
    """A spawned rank joins the test process's store as a gloo rank."""
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT)

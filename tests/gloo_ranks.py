"""Two gloo ranks spawned by a test, meeting as the engine's ranks meet: at a store listening
before they start (`host_store`, hosted here by the test process), each joining through the
engine's own `init_process_group`."""

from __future__ import annotations

import torch

from r3srv.engine.multiproc_executor import Rendezvous, host_store, init_process_group


def spawn_ranks(rank_main, nprocs: int = 2, **kwargs) -> None:
    """Run `rank_main(rank, store_port, **kwargs)` on `nprocs` processes; raises if a rank fails."""
    rendezvous, _store = host_store(Rendezvous(world_size=nprocs))  # held until the ranks are done
    torch.multiprocessing.spawn(_rank, args=(rank_main, rendezvous.master_port, kwargs), nprocs=nprocs, join=True)


def _rank(rank: int, rank_main, store_port: int, kwargs: dict) -> None:
    rank_main(rank, store_port, **kwargs)


def join_gloo(rank: int, store_port: int, world_size: int = 2) -> None:
    """A spawned rank joins the test process's store as a gloo rank."""
    init_process_group(rank, Rendezvous(world_size=world_size, master_port=store_port), torch.device("cpu"))

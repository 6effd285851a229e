"""The executor of tensor (and expert) parallelism: rank 0's shard in this process and the other
ranks in worker processes (engine/multiproc_executor.py's MultiprocExecutor, which drives them
as one model: every model call runs on each rank), with the in-process executor's runner,
sampling and routed-experts capture on rank 0, so tokens and rows need no hop back."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from r3srv.engine.executor import InProcessExecutor
from r3srv.engine.multiproc_executor import MultiprocExecutor, rank_setup

if TYPE_CHECKING:
    from r3srv.models.loader import NamedTensors

log = logging.getLogger(__name__)


def start_ranks(config) -> MultiprocExecutor:
    """The worker processes and rank 0's shard of an EngineConfig's model."""
    return MultiprocExecutor(*rank_setup(config))


class TensorParallelExecutor(InProcessExecutor):
    def __init__(self, ranks: MultiprocExecutor, *args, use_cuda_graphs: bool = False, **kwargs) -> None:
        if use_cuda_graphs:
            log.warning("CUDA graphs off: not under tensor parallelism yet")
        super().__init__(ranks, *args, use_cuda_graphs=False, **kwargs)
        self.ranks = ranks

    @property
    def shard(self):
        return self.ranks.model

    def load_weights(self, source: str | NamedTensors) -> None:
        self.ranks.load_weights(source)  # every rank's shard

    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        return self.ranks.unfilled_weights(named)

    def shutdown(self) -> None:
        self.ranks.shutdown()

"""The vision tower's share of a weight update: which tensors of an update (pushed by name, or
a checkpoint directory's by file) are the tower's, checked in full before any weight is copied,
and what is left for the language model. The tower's tensors come all or none (none: it keeps
its weights), so tensors of the tower alone are a complete update of it."""

from __future__ import annotations

import logging
import os

from torch import nn

from r3srv.errors import ConfigError
from r3srv.models.loader import NamedTensors
from r3srv.models.vision import PREFIX, check_tower_tensors, copy_tower_tensors, tower_tensors_in

log = logging.getLogger(__name__)


class TowerUpdates:
    """`tower`: the served vision tower (None: the model serves none). Under tensor parallelism
    (`tensor_parallel`) the tower is whole on rank 0 and updates from a checkpoint only."""

    def __init__(self, tower: nn.Module | None, *, tensor_parallel: bool) -> None:
        self.tower = tower
        self.tensor_parallel = tensor_parallel

    def split(self, source: NamedTensors | str | os.PathLike) -> tuple[dict, NamedTensors | str | os.PathLike]:
        """(the tower's tensors, checked; empty: it keeps its weights), and the rest of `source`."""
        if isinstance(source, NamedTensors):
            tower, rest = source.split(PREFIX)
            if tower.metas:
                check_tower_tensors(self._pushable(), {n: s for n, (s, _) in tower.metas.items()},
                                    where="the update", complete=True, strict=True)
            return tower.tensors, rest
        if self.tower is None:
            return {}, source
        found = tower_tensors_in(source) if os.path.isdir(source) else {}
        if found:
            check_tower_tensors(self.tower, {n: shape for n, (_, shape) in found.items()}, where=str(source), complete=True)
        elif os.path.isdir(source):
            log.warning("%s holds no %s* tensors: the vision tower keeps its weights", source, PREFIX)
        return found, source

    def copy(self, tensors: dict) -> None:
        """Copy split()'s tower tensors into the tower (nothing for none)."""
        if tensors:
            copy_tower_tensors(self.tower, tensors)

    def unfilled(self, tower: NamedTensors) -> list[str]:
        """The tower's tensors a push announced (by shape and dtype) still waiting for data;
        reads shapes only (any thread may ask)."""
        unfilled = check_tower_tensors(self._pushable(), {n: shape for n, (shape, _) in tower.metas.items()},
                                       where="the update", complete=False, strict=True)
        for name, (_, dtype) in tower.metas.items():
            if not dtype.is_floating_point:
                raise ConfigError(f"the update: tensor {name} is {dtype}, not a floating-point weight")
        return unfilled

    def _pushable(self) -> nn.Module:
        if self.tower is None:
            raise ConfigError(f"the served model has no tensor named {PREFIX}* (it serves no vision tower)")
        if self.tensor_parallel:
            raise ConfigError(f"{PREFIX}* tensors: under tensor parallelism the vision tower's weights update "
                              "from a checkpoint directory only (update_weights_from_disk)")
        return self.tower

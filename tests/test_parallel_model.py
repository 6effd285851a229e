"""The model built from the parallel layers, on two gloo ranks: each rank loads only its shards
of a tiny checkpoint, and a prefill gives the single-device logits (within float32 all-reduce
tolerance) and exactly its routed experts (logical ids), with tensor parallelism (experts split
by intermediate size) and with expert parallelism (experts split by id)."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import join_gloo, spawn_ranks
from model_testing import prefill
from tiny_checkpoints import write_tiny_checkpoint

from r3srv.models.loader import load_model
from r3srv.models.parallel import ParallelState

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)

TOKENS = [3, 17, 5, 9, 21, 4, 8, 30, 2, 11, 7, 13, 19, 23, 1, 6, 12, 14, 15, 16]
# each exercises a split the others do not
CASES = {
    "qwen3_moe": dict(num_key_value_heads=1),  # one KV head: replicated on both ranks
    "minimax_m2": {},  # q/k norm over every head: gathered across the ranks
    "gpt_oss": {},  # attention sinks, biased experts with interleaved gate/up rows
    "deepseek_v32": {},  # latent attention split by heads, a whole DSA indexer
    "qwen3_next": {},  # Gated DeltaNet heads; a gated attention output
    "granitemoehybrid": dict(mamba_n_groups=1),  # one Mamba-2 group split between the ranks
}


def _rank_main(rank: int, port: int, cases: dict) -> None:
    join_gloo(rank, port)
    try:
        torch.set_num_threads(1)
        for family, (path, want_logits, want_routing) in cases.items():
            for expert_parallel in (False, True):
                state = ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank if expert_parallel else 0,
                                      ep_size=2 if expert_parallel else 1, group=torch.distributed.group.WORLD)
                model, _ = load_model(path, parallel=state)
                logits, routing = prefill(model, TOKENS, all_logits=True)
                what = f"{family} {'EP' if expert_parallel else 'TP'}=2 rank {rank}"
                assert torch.equal(routing, want_routing), what
                torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4, msg=what)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_give_the_single_device_logits_and_routed_experts(tmp_path):
    cases = {}
    for family, overrides in CASES.items():
        path = write_tiny_checkpoint(tmp_path / family, family, **overrides)
        model, _ = load_model(path)
        cases[family] = (str(path), *prefill(model, TOKENS, all_logits=True))
    spawn_ranks(_rank_main, cases=cases)

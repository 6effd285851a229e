"""Expert parallelism on the CPU (float32, gloo, 2 ranks) against one device, for routers and
experts the built-in model does not have: a grouped router (DeepSeek-V3's n_group) with shared
experts and a top_k of 3 (the slots do not split evenly over the ranks), a sigmoid-gated shared
expert (Qwen2-MoE), and gpt-oss's biased experts.

- Each rank's expert pass runs exactly the (token, slot) pairs of its own experts, counted,
  under both combines (all-reduce of partial sums, all-to-all dispatch); logits within float32
  all-reduce tolerance and the same routed experts (logical ids) as one device.
- Through the engine, EP=2 gives one device's greedy tokens and routed-experts rows
  (test_tensor_parallel's check: near-tie flips reported as such).
"""

from __future__ import annotations

import re

import pytest
import torch
from gloo_ranks import join_gloo, spawn_ranks
from model_testing import prefill
from tiny_checkpoints import write_tiny_checkpoint

from engine_testing import GREEDY, one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv.models.loader import load_model
from r3srv.models.moe import SparseMoeBlock
from r3srv.models.parallel import EP_DISPATCHES, ParallelState
from test_tensor_parallel import assert_same_generation

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)

# 23 tokens: all-to-all shares of 11 and 12; one token (a one-sequence decode): one rank's share is empty
PROMPTS = ([3, 17, 5, 9, 21, 4, 8, 30, 2, 11, 7, 13, 19, 23, 1, 6, 12, 14, 15, 16, 40, 41, 27], [29])
CASES = {
    "deepseek_v3": dict(n_group=4, topk_group=2, top_k=3),  # grouped router, a shared expert, 3 slots over 2 ranks
    "qwen2_moe": dict(top_k=3),  # sigmoid-gated shared expert
    "gpt_oss": {},  # biased experts, interleaved gate/up rows
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-families")
    return {family: str(write_tiny_checkpoint(root / family, family, **overrides)) for family, overrides in CASES.items()}


def _count_pairs(model) -> list[tuple[int, torch.Tensor]]:
    """Wrap every MoE block's expert pass to record (layer, the logical expert ids of the pairs it ran)."""
    seen = []
    for name, block in model.named_modules():
        if isinstance(block, SparseMoeBlock):
            layer, run, first = int(re.search(r"layers\.(\d+)\.", name).group(1)), block.expert_pass, block.experts.first

            def recording(x, w13, w2, weights, ids, *, layer=layer, run=run, first=first, **kw):
                seen.append((layer, ids.reshape(-1) + first))
                return run(x, w13, w2, weights, ids, **kw)

            block.expert_pass = recording
    return seen


def _assert_own_pairs(seen, routing: torch.Tensor, rank: int, config, what: str) -> None:
    """The pairs this rank ran: exactly those routed to its experts, layer by layer."""
    half = config.num_experts // 2
    assert [layer for layer, _ in seen] == list(range(config.num_layers)), what  # one pass a layer
    for layer, ran in seen:
        ids = routing[:, layer].reshape(-1)
        own = ids[(ids >= rank * half) & (ids < (rank + 1) * half)]
        if len(routing) > 1:
            assert 0 < len(own) < len(ids), what  # both ranks have work, neither runs every pair
        assert torch.equal(torch.sort(ran).values, torch.sort(own.long()).values), f"{what} layer {layer}"


def _rank_main(rank: int, port: int, cases: dict) -> None:
    join_gloo(rank, port)
    try:
        torch.set_num_threads(1)
        for family, (path, wants) in cases.items():
            for dispatch in EP_DISPATCHES:
                state = ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2, ep_dispatch=dispatch,
                                      group=torch.distributed.group.WORLD)
                model, _ = load_model(path, parallel=state)
                seen = _count_pairs(model)
                for tokens, (want_logits, want_routing) in zip(PROMPTS, wants):
                    what = f"{family} EP=2 {dispatch} rank {rank}, {len(tokens)} tokens"
                    seen.clear()
                    logits, routing = prefill(model, tokens, all_logits=True)
                    assert torch.equal(routing, want_routing), what
                    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4, msg=what)
                    _assert_own_pairs(seen, want_routing, rank, model.config, what)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_each_rank_runs_its_own_pairs_and_gives_the_single_device_result(checkpoints):
    cases = {}
    for family, path in checkpoints.items():
        model, _ = load_model(path)
        cases[family] = (path, [prefill(model, tokens, all_logits=True) for tokens in PROMPTS])
    spawn_ranks(_rank_main, cases=cases)


@pytest.mark.parametrize("family", list(CASES))
def test_greedy_generation_at_ep2_equals_one_device(checkpoints, family):
    engine = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=64, max_model_len=256)
    prompts = [[1 + i * 5 % 200 for i in range(30)], [3 + i * 11 % 200 for i in range(17)], [7, 9, 2]]
    params = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    expected = LLM(checkpoints[family], **engine).generate(prompts, params)
    split = LLM(checkpoints[family], tensor_parallel_size=2, enable_expert_parallel=True, **engine)
    try:
        assert_same_generation(expected, split.generate(prompts, params))
    finally:
        split.shutdown()

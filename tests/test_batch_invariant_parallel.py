"""--batch-invariant under tensor and expert parallelism (2 and 4 CPU ranks, gloo; expert parallelism
with either combine, all-reduce or all-to-all dispatch): within one engine, a
request's tokens, logprobs and routed-experts rows are bitwise the ones it gets alone, in a batch
of generated prompts, and with prefill chunks of a few tokens, on the built-in model and a tiny
DeepSeek-V3 (MLA). Not compared with one device: a hidden state under TP is the ranks' partial
products summed by an all-reduce, in another order than one device's (docs/replay.md)."""

import random

import numpy as np
import pytest

from engine_testing import PARALLEL_MODES, one_torch_thread  # noqa: F401  (fixture)
from r3srv import LLM, SamplingParams, settings
from test_batch_invariant import TARGETS, assert_same, generated_prompts, greedy, mixed_in, sample

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)


# 4 ranks too (the built-in model only, this machine has 2 cores): 2 ranks' sums are one float
# addition, the same in either order; from 3 on, the collective's order would follow the batch
MODES = {**PARALLEL_MODES, "tp4": dict(tensor_parallel_size=4), "ep2-all_to_all": PARALLEL_MODES["ep2"]}
# runtime settings a mode changes: the dispatch combine sums a token's pairs on the rank that holds
# the token, and which rank that is follows the batch (its share of the step's tokens)
MODE_SETTINGS = {"ep2-all_to_all": dict(ep_dispatch="all_to_all")}
CASES = [("builtin", mode) for mode in MODES] + [("deepseek_v3", mode) for mode in PARALLEL_MODES]


@pytest.fixture(scope="module")
def mla_checkpoint(tmp_path_factory):
    from tiny_checkpoints import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("mla"), "deepseek_v3", num_layers=2))


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{mode}" for m, mode in CASES])
def split(request):
    """The built-in model (a plain MoE) or a tiny DeepSeek-V3 (MLA) over worker processes."""
    family, mode = request.param
    model = None if family == "builtin" else request.getfixturevalue("mla_checkpoint")
    previous = settings.configure(settings.current().replace(**MODE_SETTINGS.get(mode, {})))
    try:  # the ranks take rank 0's setting as they start
        llm = LLM(model, batch_invariant=True, enable_prefix_caching=False, max_num_seqs=16, **MODES[mode])
    finally:
        settings.configure(previous)
    for name, value in MODE_SETTINGS.get(mode, {}).items():  # what the ranks were started with
        assert getattr(llm.engine.core.executor.ranks.rendezvous, name) == value
    yield llm
    llm.shutdown()
    assert all(not w.is_alive() for w in llm.engine.core.executor.ranks.workers)


def test_same_alone_and_in_batches(split):
    alone = [sample(split.generate([prompt], greedy())[0]) for prompt in TARGETS]
    assert all(rows is not None and rows.size > 0 for _, _, rows in alone)
    rng = random.Random(9)
    prompts, params, slots = mixed_in(TARGETS, generated_prompts(rng, [rng.randint(1, 60) for _ in range(6)]), rng)
    outputs = split.generate(prompts, params)
    for i, at in enumerate(slots):
        assert_same(sample(outputs[at]), alone[i], f"target {i} in a batch of {len(prompts)}")
    # prompts in chunks of at most 3 tokens sharing steps with the others' chunks and decodes
    split.engine.core.scheduler.max_num_batched_tokens = 3
    try:
        outputs = split.generate(prompts, params)
    finally:
        split.engine.core.scheduler.max_num_batched_tokens = split.engine.core.config.max_num_batched_tokens
    for i, at in enumerate(slots):
        assert_same(sample(outputs[at]), alone[i], f"target {i} in chunks of 3")

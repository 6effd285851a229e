"""DeepSeek Sparse Attention's selections (--enable-return-indexer-topk) under tensor and expert
parallelism on the CPU (float32, gloo, 2 ranks) against one device, on the tiny DeepSeek-V3.2
checkpoint tests/test_indexer_topk.py checks against transformers (index_topk 5): the indexer is
whole on every rank and reads the all-reduced hidden state, so rank 0's capture is every rank's.
Its own module: a module-scoped engine under TP holds the process group until its module ends."""

import numpy as np
import pytest

from engine_testing import PARALLEL_MODES, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import SamplingParams

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)

DSA_ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
                  enable_return_indexer_topk=True)


@pytest.fixture(scope="module")
def dsa_checkpoint(tmp_path_factory):
    from tiny_checkpoints import write_tiny_checkpoint

    pytest.importorskip("transformers")
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("deepseek_v32"), "deepseek_v32", seed=11))


@pytest.fixture(scope="module", params=list(PARALLEL_MODES))
def dsa_split(request, dsa_checkpoint):
    from r3srv import LLM

    llm = LLM(dsa_checkpoint, **DSA_ENGINE, **PARALLEL_MODES[request.param])
    yield llm
    llm.shutdown()
    assert all(not w.is_alive() for w in llm.engine.core.executor.ranks.workers)


def assert_same_selections(one, many) -> None:
    for a, b in zip(one, many):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids, f"{a.request_id}: greedy tokens differ"
        assert cb.indexer_topk.dtype == np.int32 and cb.indexer_topk.shape == ca.indexer_topk.shape
        if not np.array_equal(ca.indexer_topk, cb.indexer_topk):
            token, layer = np.argwhere((ca.indexer_topk != cb.indexer_topk).any(axis=-1))[0]
            pytest.fail(f"{a.request_id}: selections differ at token {token}, layer {layer}: "
                        f"{ca.indexer_topk[token, layer]} vs {cb.indexer_topk[token, layer]}")
        assert (cb.indexer_topk[:, :, -1] > 4).any()  # sparse rows (5 keys of more than 5) were compared


def test_indexer_topk_equals_one_device(dsa_checkpoint, dsa_split):
    from r3srv import LLM

    prompts = [prompt_ids(9, base=1), prompt_ids(23, base=2), prompt_ids(31, base=3)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, indexer_topk_prompt_start=4 * i)
              for i in range(len(prompts))]
    want = LLM(dsa_checkpoint, **DSA_ENGINE).generate(prompts, params)
    dsa_split.engine.reset_prefix_cache()
    assert_same_selections(want, dsa_split.generate(prompts, params))
    cached = dsa_split.generate(prompts[1:], params[1:])  # the selections kept by KV slot on rank 0
    assert all(out.num_cached_tokens > 0 for out in cached)
    assert_same_selections(want[1:], cached)

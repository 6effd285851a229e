"""DeepSeek Sparse Attention's selections (--enable-return-indexer-topk) against transformers'
indexer modules on tiny DeepSeek-V3.2 and GLM-MoE-DSA checkpoints (index_topk 5): cold, over
the prefix cache and after preemption.

transformers' indexer returns each query's top-k key indices in torch.topk's order, over keys
that include the causally masked ones (at -inf) where fewer than k are visible: the oracle's
selection of token p is its set of indices <= p. The engine returns them ascending, -1 after,
so the two are compared as sets per token and layer."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch

from r3srv import LLM, SamplingParams
from r3srv.errors import ConfigError, InvalidRequestError
from tiny_checkpoints import build_hf_model, write_tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers oracles

pytest.importorskip("transformers")

FAMILIES = [
    ("deepseek_v32", {}),
    # full, shared, full: the engine returns the two indexer layers' selections
    ("glm_moe_dsa", {"num_layers": 3, "indexer_types": ["full", "shared", "full"], "first_k_dense_replace": 1}),
]


def hf_selections(hf, tokens: list[int]) -> list[list[list[int]]]:
    """Per token, per indexer layer (in layer order): the sorted key positions transformers'
    indexer selected among those the token sees."""
    indexers = [layer.self_attn.indexer for layer in hf.model.layers if layer.self_attn.indexer is not None]
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o[0])) for m in indexers]
    gaps: list[torch.Tensor] = []
    try:
        with torch.no_grad(), cut_gaps(hf.config.index_topk, gaps):
            hf(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(indexers)
    # no two keys score alike at the cut (where a tie is, either could be selected)
    assert gaps or len(tokens) <= hf.config.index_topk  # the scores were seen
    assert all(bool((g > 0).all()) for g in gaps), "a tie at the indexer's top-k cut"
    return [[sorted(k for k in layer[p].tolist() if k <= p) for layer in seen] for p in range(len(tokens))]


@contextlib.contextmanager
def cut_gaps(k: int, gaps: list[torch.Tensor]):
    """While open, each indexer's `index_scores.topk(k)` (transformers calls the method, its
    routers torch.topk) also records, per query that sees more than k keys, the gap between its
    k-th and (k+1)-th best score."""
    original = torch.Tensor.topk

    def topk(self, n, *args, **kwargs):
        if n == k and self.dim() == 3 and self.shape[-1] > k:
            best = original(self, k + 1, *args, **kwargs).values
            seen_more = torch.isfinite(best[..., k])
            gaps.append((best[..., k - 1] - best[..., k])[seen_more])
        return original(self, n, *args, **kwargs)

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def engine_selections(topk: np.ndarray) -> list[list[list[int]]]:
    """The engine's rows as lists, checking their form: ascending positions, then -1."""
    out = []
    for row in topk:
        layers = []
        for values in row.tolist():
            picked = [v for v in values if v >= 0]
            assert values == picked + [-1] * (len(values) - len(picked)) and picked == sorted(set(picked))
            layers.append(picked)
        out.append(layers)
    return out


def check(hf, prompt: list[int], c, start: int = 0) -> None:
    full = prompt + list(c.token_ids)
    want = hf_selections(hf, full[:-1])[start:]
    assert c.indexer_topk.dtype == np.int32 and c.indexer_topk.shape[0] == len(want)
    got = engine_selections(c.indexer_topk)
    assert got == want
    assert any(len(layer) == 5 and layer[-1] > 4 for row in got for layer in row)  # sparse rows were compared


@pytest.fixture(scope="module", params=FAMILIES, ids=[f for f, _ in FAMILIES])
def family(request, tmp_path_factory):
    name, kwargs = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(name), name, seed=11, **kwargs)
    return str(path), build_hf_model(name, seed=11, **kwargs)


def prompts_of(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(32, 256) for _ in range(n)] for n in lengths]


def test_cold_and_over_the_prefix_cache(family):
    path, hf = family
    llm = LLM(path, block_size=4, num_kv_blocks=64, max_model_len=128, enable_return_indexer_topk=True)
    prompts = prompts_of(random.Random(1), [19, 3])
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, indexer_topk_prompt_start=start)
              for start in (0, 2)]
    first = llm.generate(prompts, params)
    again = llm.generate(prompts[:1], params[:1])[0]  # its prompt's full blocks from the prefix cache
    assert again.num_cached_tokens > 0
    for prompt, param, out in zip(prompts + prompts[:1], params + params[:1], first + [again]):
        check(hf, prompt, out.outputs[0], param.indexer_topk_prompt_start)
    opted_out = llm.generate(prompts[:1], SamplingParams(max_tokens=2, return_indexer_topk=False))[0].outputs[0]
    assert opted_out.indexer_topk is None


def test_after_preemption(family):
    path, hf = family
    llm = LLM(path, block_size=4, num_kv_blocks=10, max_model_len=32, max_num_seqs=4,
              enable_return_indexer_topk=True)
    prompts = prompts_of(random.Random(2), [14, 17, 11, 15])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert llm.stats().num_preemptions > 0
    assert any(out.outputs[0].num_preempted > 0 for out in outputs)
    for prompt, out in zip(prompts, outputs):
        check(hf, prompt, out.outputs[0])


def test_refusals(family, tmp_path):
    path, _ = family
    llm = LLM(path, block_size=4, num_kv_blocks=32, max_model_len=64)
    ask = SamplingParams(max_tokens=2, return_indexer_topk=True)
    with pytest.raises(InvalidRequestError) as err:  # without the flag
        llm.generate([[40, 41, 42]], ask)
    assert err.value.param == "return_indexer_topk"
    assert llm.generate([[40, 41, 42]], SamplingParams(max_tokens=2))[0].outputs[0].indexer_topk is None
    # the cap: (prompt + max_tokens - 1) x indexer layers x index_topk values
    on = LLM(path, block_size=4, num_kv_blocks=32, max_model_len=64, enable_return_indexer_topk=True,
             indexer_topk_max_values=40)
    layers = len(on.model_config.attention.sparse.indexer_layers(on.model_config.num_layers))
    fits = 40 // (layers * 5) + 1  # tokens in all whose rows fit
    assert on.generate([[40, 41]], SamplingParams(max_tokens=fits - 2))[0].outputs[0].indexer_topk is not None
    with pytest.raises(InvalidRequestError) as err:
        on.generate([[40, 41]], SamplingParams(max_tokens=fits - 1))
    assert err.value.param == "indexer_topk_max_values"
    with pytest.raises(InvalidRequestError) as err:
        on.generate([[40, 41]], SamplingParams(max_tokens=1, indexer_topk_prompt_start=3))
    assert err.value.param == "indexer_topk_prompt_start"


def test_families_without_an_indexer_are_refused(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "q", "qwen3_moe", seed=5))
    with pytest.raises(ConfigError, match="no sparse-attention indexer"):
        LLM(path, block_size=4, num_kv_blocks=32, max_model_len=64, enable_return_indexer_topk=True)
    llm = LLM(path, block_size=4, num_kv_blocks=32, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="no sparse-attention indexer") as err:
        llm.generate([[40, 41]], SamplingParams(max_tokens=2, return_indexer_topk=True))
    assert err.value.param == "return_indexer_topk"


def test_the_host_buffer_is_sized_with_the_pool_and_checked_against_memory(family, monkeypatch):
    """On the CPU the automatic KV pool counts each slot's selections (host memory, the cache's
    own); a buffer larger than the host's available memory is a ConfigError at start-up, before
    the cache is allocated, not a process killed once its pages fill."""
    from r3srv.engine import core as core_module
    from r3srv.engine.indexer_topk import bytes_per_slot
    from r3srv.engine.routed_experts import row_bytes_per_slot

    path, _ = family
    monkeypatch.setattr(core_module, "available_bytes", lambda: 64 << 20)
    pools = {}
    for on in (False, True):
        llm = LLM(path, block_size=4, max_model_len=64, max_num_seqs=4096, kv_cache_memory_fraction=0.5,
                  enable_return_indexer_topk=on)
        core = llm.engine.core
        mc = core.model_config
        per_block = core.executor.kv_cache_bytes_per_block(4) + 4 * row_bytes_per_slot(mc.num_layers, mc.top_k,
                                                                                        mc.num_experts)
        if on:
            per_slot = bytes_per_slot(mc, 64)
            assert per_slot == core.indexer_topk.values_per_token * core.indexer_topk.values.itemsize > 0
            per_block += 4 * per_slot
        pools[on] = core.config.num_kv_blocks
        assert pools[on] == (32 << 20) // per_block  # the budget binds (useful: 4096 x 16 blocks)
    assert pools[True] < pools[False]
    monkeypatch.setattr(core_module, "available_bytes", lambda: 4 << 10)  # 4 KiB: no buffer of 64 blocks fits
    with pytest.raises(ConfigError, match="indexer top-k buffer .* more than the 0.00 GiB available") as err:
        LLM(path, block_size=4, num_kv_blocks=64, max_model_len=64, enable_return_indexer_topk=True)
    assert "num_kv_blocks" in str(err.value)
    assert LLM(path, block_size=4, num_kv_blocks=64, max_model_len=64).engine.core.indexer_topk is None  # off: no check


@pytest.mark.parametrize("max_model_len, dtype", [(32767, np.int16), (32768, np.int32)])
def test_buffer_keeps_positions_by_slot_compactly(max_model_len, dtype):
    """Stored in the narrowest type that holds every position and the -1 pad; read back as int32
    through a block table, from the prompt start on."""
    from r3srv.engine.indexer_topk import IndexerTopkBuffer

    buf = IndexerTopkBuffer(16, 2, 3, max_model_len)
    assert buf.values.dtype == dtype
    rng = np.random.default_rng(0)
    capture = torch.from_numpy(rng.integers(-1, max_model_len, (6, 2, 3)).astype(np.int32))
    slots = np.array([8, 9, 10, 11, 4, 5])  # blocks [2, 1] of 4 slots each
    buf.store(slots, capture)
    got = buf.sequence([2, 1], 4, num_tokens=7, prompt_start=1)  # rows 1..5
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, capture.numpy()[1:6])


def test_chunked_prefill(family):
    """Prompts computed in 6-token chunks beside decodes: each chunk selects over the keys of the
    chunks before it, read back from the cache."""
    path, hf = family
    llm = LLM(path, block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=6,
              enable_return_indexer_topk=True)
    prompts = prompts_of(random.Random(3), [23, 9])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        check(hf, prompt, out.outputs[0])


def test_overlapped_scheduling(family):
    """--async-scheduling: each step's capture is cloned before the next step, prepared meanwhile,
    reuses it."""
    path, hf = family
    llm = LLM(path, block_size=4, num_kv_blocks=64, max_model_len=64, async_scheduling=True,
              enable_return_indexer_topk=True)
    prompts = prompts_of(random.Random(4), [17, 8])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        check(hf, prompt, out.outputs[0])

"""Paged attention: chunked prefill, decode steps, prefix reuse and mixed batches equal a one-shot prefill."""

from __future__ import annotations

import pytest
import torch

from r3srv.models.batch import ForwardBatch
from r3srv.models.loader import load_model
from tiny_checkpoints import write_tiny_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 64


# deepseek_v3: multi-head latent attention, whose paged cache holds one latent per token;
# gpt_oss: sinks and a window of 4 on the first layer (chunks and decodes run past it);
# qwen3_next: Gated DeltaNet layers, whose per-sequence states continue across chunks and decodes;
# glm_moe_dsa: MLA whose queries attend only to the keys their indexer selects; nemotron_h: Mamba-2 states
LAYOUTS = {
    "qwen3_moe": dict(num_layers=3, mlp_only_layers=[1]),
    "deepseek_v3": dict(num_layers=3, first_k_dense_replace=1),
    "gpt_oss": dict(num_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"]),
    "qwen3_next": dict(num_layers=3, mlp_only_layers=[1]),
    # sparse attention (top-5 keys): selections over cached chunks, padded decode groups, a shared layer
    "glm_moe_dsa": dict(num_layers=3, indexer_types=["full", "shared", "full"]),
    # Mamba-2 layers beside attention without positions, one mixer per layer
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"]),
    # Kimi Delta Attention (per-channel decay) around MLA without positions
    "kimi_linear": dict(num_layers=3),
    # Mamba-2 in decoder layers (attention then MoE), muP-style scalars
    "granitemoehybrid": dict(num_layers=3),
    # windowed RoPE layers around a position-free full layer, sandwich norms
    "afmoe": dict(num_layers=3),
    # RoPE attention with muP-style scalars, experts beside a shared MLP
    "granitemoeshared": dict(num_layers=3),
    # gated short convolutions around attention (a convolution window, no recurrent state)
    "lfm2_moe": dict(num_layers=3),
    # windowed RoPE layers with sinks around position-free full layers
    "granitemoe_swa": dict(num_layers=5),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("paged"), request.param, seed=3, **LAYOUTS[request.param])
    model, _ = load_model(path)
    return model


def _tolerance(model) -> dict[str, float]:
    """Float32 noise: a hybrid's decodes take the recurrent form of the delta rule, its prefills
    the chunked form (equal in float64, tests/test_gated_deltanet.py), so their logits differ
    by rounding more than those of attention, which computes a token the same way either way."""
    tol = 1e-4 if model.config.is_hybrid else 1e-5
    return dict(atol=tol, rtol=tol)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _batch(model, seqs, all_logits: bool = False) -> ForwardBatch:
    """seqs: (new token ids, tokens already cached, block table) per sequence. A sequence's
    linear-attention state slot is its first block's id (distinct in every test here)."""
    ids, positions, slots, q_lens, ctx_lens, logit_rows = [], [], [], [], [], []
    width = max(len(table) for _, _, table in seqs)
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    row = 0
    for i, (new, start, table) in enumerate(seqs):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        pos = list(range(start, start + len(new)))
        ids += new
        positions += pos
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
        q_lens.append(len(new))
        ctx_lens.append(start + len(new))
        logit_rows += list(range(row, row + len(new))) if all_logits else [row + len(new) - 1]
        row += len(new)
    cfg = model.config
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_lens=q_lens,
        context_lens=ctx_lens,
        block_tables=tables,
        logits_indices=torch.tensor(logit_rows),
        routing_capture=torch.zeros(len(ids), cfg.num_layers, cfg.top_k, dtype=torch.uint8),
        state_slots=[table[0] for _, _, table in seqs],
    )


def _one_shot(model, tokens: list[int]):
    """Reference: the whole sequence in one prefill, logits at every position."""
    model.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_BLOCKS)
    table = list(range((len(tokens) + BLOCK_SIZE - 1) // BLOCK_SIZE))
    batch = _batch(model, [(tokens, 0, table)], all_logits=True)
    return model.forward(batch), batch.routing_capture


def test_chunked_prefill_and_decode_equal_one_shot(model):
    tokens = _tokens(14, seed=1)
    ref_logits, ref_capture = _one_shot(model, tokens)
    model.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_BLOCKS)
    table = [7, 2, 5, 11]  # scattered, out-of-order blocks
    logits, captures, start = [], [], 0
    for size in (5, 3, 1, 1, 4):
        batch = _batch(model, [(tokens[start : start + size], start, table)], all_logits=True)
        logits.append(model.forward(batch))
        captures.append(batch.routing_capture)
        start += size
    torch.testing.assert_close(torch.cat(logits), ref_logits, **_tolerance(model))
    assert torch.equal(torch.cat(captures), ref_capture)
    cfg = model.config
    dense = [layer for layer in range(cfg.num_layers) if layer not in cfg.moe_layers]
    assert all(not ref_capture[:, layer].any() for layer in dense)  # a dense layer leaves zero rows
    assert all(ref_capture[:, layer].any() for layer in cfg.moe_layers)


def test_mixed_batch_of_prefills_chunks_and_decodes(model):
    seqs = {name: _tokens(n, seed) for name, n, seed in (("a", 6, 2), ("b", 10, 3), ("c", 9, 4), ("d", 3, 5))}
    refs = {name: _one_shot(model, toks) for name, toks in seqs.items()}

    model.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_BLOCKS)
    tables = {"a": [20, 21], "b": [3, 9, 4], "c": [30, 1, 17], "d": [12]}
    # earlier steps: b has 9 tokens cached, c has 5, d has 2 (a is new)
    model.forward(_batch(model, [(seqs["b"][:9], 0, tables["b"]), (seqs["c"][:5], 0, tables["c"])]))
    model.forward(_batch(model, [(seqs["d"][:2], 0, tables["d"])]))
    step = [
        (seqs["b"][9:], 9, tables["b"]),  # decode, context 10
        (seqs["a"], 0, tables["a"]),  # full prefill
        (seqs["c"][5:], 5, tables["c"]),  # second prefill chunk after cached tokens
        (seqs["d"][2:], 2, tables["d"]),  # decode, context 3
    ]
    batch = _batch(model, step)
    logits = model.forward(batch)
    rows = torch.tensor(batch.query_lens).cumsum(0) - 1
    for i, name in enumerate(("b", "a", "c", "d")):
        ref_logits, ref_capture = refs[name]
        torch.testing.assert_close(logits[i], ref_logits[-1], **_tolerance(model))
        assert torch.equal(batch.routing_capture[rows[i]], ref_capture[-1])


def test_kv_cache_bytes_and_forward_without_cache(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", "mixtral", num_layers=2)
    model, _ = load_model(path)
    cfg = model.config
    # K and V, every layer, float32 on the CPU
    assert model.kv_cache_bytes_per_block(16) == 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    batch = _batch(model, [([1, 2, 3], 0, [0])])
    with pytest.raises(RuntimeError, match="init_kv_cache"):
        model.forward(batch)
    with pytest.raises(ValueError, match="positive"):
        model.init_kv_cache(0, 16)


def test_mla_caches_one_latent_per_token(tmp_path):
    model, _ = load_model(write_tiny_checkpoint(tmp_path / "mla", "deepseek_v3", num_layers=2))
    cfg = model.config
    latent = cfg.attention.mla.kv_lora_rank + cfg.head_dim  # head_dim is the rotary key's width under MLA
    assert model.kv_cache_bytes_per_block(16) == cfg.num_layers * 16 * latent * 4
    model.init_kv_cache(4, 16)
    attn = model.layers[0].attn
    assert attn.k_cache.shape == (64, 1, latent)
    assert attn.v_cache.data_ptr() == attn.k_cache.data_ptr() and attn.v_cache.shape[-1] == cfg.attention.mla.kv_lora_rank


def test_cpu_forwards_give_torch_the_threads_only_for_many_tokens(tmp_path, monkeypatch, r3srv_settings):
    """settings.cpu_threads for torch in a step of TORCH_PARALLEL_MIN_TOKENS tokens or more (a
    prefill), one thread below (decodes: the Rust kernels split their own work)."""
    from r3srv.errors import ConfigError
    from r3srv.ops.cpu import TORCH_PARALLEL_MIN_TOKENS
    from r3srv.settings import Settings

    assert Settings.from_environ({}).cpu_threads == 1  # default: one intra-op thread for CPU forwards
    before = torch.get_num_threads()
    try:
        r3srv_settings(cpu_threads=3)
        model, _ = load_model(write_tiny_checkpoint(tmp_path, "qwen3_moe", seed=3))
        seen = []
        original = model._forward
        monkeypatch.setattr(model, "_forward", lambda batch: seen.append(torch.get_num_threads()) or original(batch))
        model.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_BLOCKS)
        many = TORCH_PARALLEL_MIN_TOKENS
        blocks = list(range(-(-many // BLOCK_SIZE)))
        for tokens in (5, many, many - 1):
            model.forward(_batch(model, [(_tokens(tokens, seed=9), 0, blocks)]))
        assert seen == [1, 3, 1]
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="R3SRV_CPU_THREADS"):
        Settings.from_environ({"R3SRV_CPU_THREADS": "zero"})
    with pytest.raises(ConfigError, match="R3SRV_CPU_THREADS"):
        Settings.from_environ({"R3SRV_CPU_THREADS": "0"})


@pytest.mark.parametrize("budget", [1, 24, 1 << 16], ids=["one-per-group", "small-groups", "one-group"])
def test_decodes_in_gather_budgeted_groups_equal_one_shot(model, monkeypatch, budget):
    """Decode sequences of mixed lengths, split into groups by the gather budget however it
    falls, each give the one-shot prefill's logits and routing for their last token."""
    import r3srv.ops.attention as attention

    monkeypatch.setattr(attention, "DECODE_GROUP_TOKENS", budget)
    lengths = [3, 11, 5, 8, 2, 13]
    seqs = [_tokens(n, seed=20 + i) for i, n in enumerate(lengths)]
    refs = [_one_shot(model, toks) for toks in seqs]
    model.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_BLOCKS)
    tables, next_block = [], 0
    for toks in seqs:  # cache all but the last token of each
        need = -(-len(toks) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
        model.forward(_batch(model, [(toks[:-1], 0, tables[-1])]))
    batch = _batch(model, [(toks[-1:], len(toks) - 1, table) for toks, table in zip(seqs, tables)])
    groups = attention._decode_groups(batch.context_lens)
    assert sorted(j for g in groups for j in g) == list(range(len(seqs)))
    assert all(len(g) == 1 or len(g) * max(lengths[j] for j in g) <= budget for g in groups)
    assert len(groups) == {1: 6, 24: 3, 1 << 16: 1}[budget]  # 24: [2, 3, 5], [8, 11], [13]
    logits = model.forward(batch)
    for i, (ref_logits, ref_capture) in enumerate(refs):
        torch.testing.assert_close(logits[i], ref_logits[-1], **_tolerance(model))
        assert torch.equal(batch.routing_capture[i], ref_capture[-1])

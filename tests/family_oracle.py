"""The checks every family passes against transformers (the test-only oracle), on tiny random
checkpoints.

Logits, greedy continuation tokens and the captured routed experts must match what
transformers computes on the same prompt, its router's top-k read off the gate modules.

A family's test module, tests/families/test_<family>.py, holds its tiny transformers config
(`tiny_config`, which tiny_checkpoints.hf_config calls) and its `VARIANTS` (variant name ->
hf_config overrides, one tiny checkpoint each), and runs these checks on every variant with
`from family_oracle import *` (the two tests, the `case` fixture, the hook that
parametrizes it over the module's VARIANTS, and the module's slow marker).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from r3srv.models.batch import ForwardBatch
from r3srv.models.loader import load_model
from tiny_checkpoints import build_hf_model, hf_gate_modules, hf_router_ids, write_tiny_checkpoint

pytest.importorskip("transformers")

__all__ = [
    "case", "pytest_generate_tests", "pytestmark", "test_greedy_continuation_and_routing_match_transformers",
    "test_prefill_logits_and_routing_match_transformers",
]

pytestmark = pytest.mark.slow  # transformers oracles

BLOCK_SIZE = 4
NEW_TOKENS = 6


class Case:
    def __init__(self, path, family, kwargs, sharded):
        self.hf = build_hf_model(family, seed=1, **kwargs)
        write_tiny_checkpoint(path, family, seed=1, max_shard_size="40KB" if sharded else None, **kwargs)
        self.model, self.tokenizer = load_model(path)
        self.gates = hf_gate_modules(self.hf)


def pytest_generate_tests(metafunc):
    """Every check runs once per entry of the family module's VARIANTS (one checkpoint each)."""
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", list(metafunc.module.VARIANTS), indirect=True, scope="module")


@pytest.fixture(scope="module")
def case(request, tmp_path_factory):
    variants = request.module.VARIANTS
    family = Path(request.module.__file__).stem.removeprefix("test_")
    # the family's first variant, and every other one after it, is written as several shards
    # with an index (so every family loads from shards here at least once)
    sharded = list(variants).index(request.param) % 2 == 0
    return Case(tmp_path_factory.mktemp(request.param), family, variants[request.param], sharded)


def _hf_run(case: Case, ids: list[int], past=None):
    """transformers forward: (logits [T, V], router ids per MoE layer [T, k], past)."""
    picked: dict[int, torch.Tensor] = {}
    hooks = [
        gate.register_forward_hook(lambda m, inp, out, i=i: picked.__setitem__(i, hf_router_ids(m, inp, out).clone()))
        for i, gate in case.gates.items()
    ]
    try:
        with torch.no_grad():
            out = case.hf(torch.tensor([ids]), past_key_values=past, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float(), picked, out.past_key_values


def _step(model, ids: list[int], start: int, logits_all: bool = False, rows: list[int] | None = None):
    """One of our forward steps for a single sequence occupying blocks 0.. in order: the logits
    of its last token, of every token (logits_all), or of `rows`."""
    cfg = model.config
    t, ctx = len(ids), start + len(ids)
    positions = torch.arange(start, ctx)
    tables = torch.arange((ctx + BLOCK_SIZE - 1) // BLOCK_SIZE, dtype=torch.int32)[None]
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=positions,
        slot_mapping=positions.clone(),
        query_lens=[t],
        context_lens=[ctx],
        block_tables=tables,
        logits_indices=torch.arange(t) if logits_all else torch.tensor([t - 1] if rows is None else rows),
        routing_capture=torch.zeros(t, cfg.num_layers, cfg.top_k, dtype=torch.int32),
    )
    return model.forward(batch), batch.routing_capture


def _prompt(n: int = 11) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7)).tolist()


def test_prefill_logits_and_routing_match_transformers(case):
    model = case.model
    model.init_kv_cache(16, BLOCK_SIZE)
    prompt = _prompt()
    ref_logits, ref_ids, _ = _hf_run(case, prompt)
    logits, capture = _step(model, prompt, 0, logits_all=True)
    assert logits.dtype == torch.float32 and logits.shape == ref_logits.shape
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    cfg = model.config
    assert sorted(ref_ids) == cfg.moe_layers
    for layer in range(cfg.num_layers):
        if layer in ref_ids:
            assert torch.equal(capture[:, layer].long(), ref_ids[layer].long()), f"layer {layer}"
        else:  # a dense layer leaves its rows zero
            assert not capture[:, layer].any()
    # logits at some rows only: the last layer's MLP runs for those alone (models/model.py's
    # last_layer_rows), in any order, repeated; every row is still routed
    some = [len(prompt) - 1, 2, 5, 2]
    logits, some_capture = _step(model, prompt, 0, rows=some)
    torch.testing.assert_close(logits, ref_logits[some], atol=1e-4, rtol=1e-4)
    assert torch.equal(some_capture, capture)


def test_greedy_continuation_and_routing_match_transformers(case):
    model = case.model
    model.init_kv_cache(16, BLOCK_SIZE)
    prompt = _prompt()
    # transformers: prefill then one token at a time through its own KV cache
    ref_tokens, ref_rows = [], []
    logits, picked, past = _hf_run(case, prompt)
    ref_rows.append(picked)
    for _ in range(NEW_TOKENS):
        ref_tokens.append(int(logits[-1].argmax()))
        logits, picked, past = _hf_run(case, [ref_tokens[-1]], past)
        ref_rows.append(picked)
    # ours: prefill then decode steps through the paged cache (crossing block boundaries)
    tokens, rows = [], []
    logits, capture = _step(model, prompt, 0)
    rows.append(capture)
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits[0].argmax()))
        logits, capture = _step(model, [tokens[-1]], len(prompt) + len(tokens) - 1)
        rows.append(capture)
    assert tokens == ref_tokens
    ours = torch.cat(rows)
    for layer in model.config.moe_layers:
        ref = torch.cat([r[layer] for r in ref_rows])
        assert torch.equal(ours[:, layer].long(), ref.long()), f"layer {layer}"

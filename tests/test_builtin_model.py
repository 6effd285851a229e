"""The built-in model: deterministic, cached, race-safe, Qwen3-MoE-shaped, with spread routing.
(Its decode speed, >= 50 tokens/s for one sequence, is measured by benches/bench_engine.py:
tests never gate on an absolute time.)"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys

import pytest
import torch

from r3srv.models import builtin
from r3srv.models.batch import ForwardBatch
from r3srv.models.builtin import BUILTIN_MODEL_NAME, builtin_model_dir, write_builtin_checkpoint
from r3srv.models.loader import load_model

pytestmark = pytest.mark.slow  # transformers oracles

BLOCK_SIZE = 16


def _digests(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from r3srv import settings

    path = tmp_path_factory.mktemp("r3srv-cache")
    previous = settings.configure(settings.current().replace(cache_dir=path))
    yield path
    settings.configure(previous)


@pytest.fixture(scope="module")
def loaded(cache_dir):
    return load_model(None)


def test_two_builds_are_byte_identical(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    write_builtin_checkpoint(first)
    write_builtin_checkpoint(second)
    digests = _digests(first)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(digests)
    assert digests == _digests(second)


def test_cache_dir_is_built_once_and_reused(cache_dir):
    path = builtin_model_dir()
    assert path.parent.parent == cache_dir and BUILTIN_MODEL_NAME in path.name
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert builtin_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left behind


@pytest.mark.slow
def test_concurrent_first_use_is_safe(tmp_path):
    code = "from r3srv.models.builtin import builtin_model_dir; print(builtin_model_dir())"
    env = {**os.environ, "R3SRV_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    built = (tmp_path / "builtin").iterdir()
    assert [p.name for p in built] == [os.path.basename(outs[0])]
    load_model(outs[0])  # a complete checkpoint


def test_shape_and_random_weights_are_announced(loaded, caplog):
    model, tokenizer = loaded
    cfg = model.config
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.name == BUILTIN_MODEL_NAME
    assert cfg.num_experts >= 64 and cfg.top_k == 8 and cfg.num_layers >= 4
    assert cfg.moe_layers == list(range(cfg.num_layers))
    assert cfg.is_random_builtin and "random" in cfg.raw["r3srv_note"].lower()
    assert "random weights" in builtin.__doc__.lower() and "random weights" in builtin_model_dir.__doc__.lower()
    assert cfg.vocab_size == tokenizer.vocab_size == 259
    assert cfg.eos_token_ids == [tokenizer.eos_token_id] == [tokenizer.encode("<|im_end|>")[0]]
    with caplog.at_level(logging.WARNING, logger="r3srv.models.loader"):
        by_name, _ = load_model(BUILTIN_MODEL_NAME)  # its served name works as a path too
    assert "random weights" in caplog.text
    assert by_name.config.name == BUILTIN_MODEL_NAME


def _decode_step(model, token: int, context: int) -> ForwardBatch:
    pos = torch.tensor([context - 1])
    cfg = model.config
    return ForwardBatch(
        input_ids=torch.tensor([token]),
        positions=pos,
        slot_mapping=pos.clone(),
        query_lens=[1],
        context_lens=[context],
        block_tables=torch.arange(model.num_blocks, dtype=torch.int32)[None],
        logits_indices=torch.tensor([0]),
        routing_capture=torch.zeros(1, cfg.num_layers, cfg.top_k, dtype=torch.uint8),
    )


def _greedy(model, tokenizer, text: str, steps: int):
    cfg = model.config
    model.init_kv_cache(16, BLOCK_SIZE)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    t = len(prompt)
    batch = ForwardBatch(
        input_ids=torch.tensor(prompt),
        positions=torch.arange(t),
        slot_mapping=torch.arange(t),
        query_lens=[t],
        context_lens=[t],
        block_tables=torch.arange(16, dtype=torch.int32)[None],
        logits_indices=torch.tensor([t - 1]),
        routing_capture=torch.zeros(t, cfg.num_layers, cfg.top_k, dtype=torch.uint8),
    )
    logits = model.forward(batch)
    rows, out = [batch.routing_capture], []
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        step = _decode_step(model, out[-1], t + len(out))
        logits = model.forward(step)
        rows.append(step.routing_capture)
    return out, torch.cat(rows)


def test_greedy_text_and_routing_are_not_degenerate(loaded):
    model, tokenizer = loaded
    tokens, rows = _greedy(model, tokenizer, "Hello, routed experts!", steps=40)
    assert len(set(tokens)) >= 10, tokenizer.decode(tokens)
    for layer in range(model.config.num_layers):
        expert_sets = {tuple(sorted(r)) for r in rows[:, layer].tolist()}
        assert len(expert_sets) >= len(rows) // 2, f"layer {layer}: routing barely changes between tokens"
        assert rows[:, layer].unique().numel() >= 48  # most of the 64 experts get used
    # within a row, the top-k ids are distinct experts
    assert all(len(set(r)) == model.config.top_k for r in rows.reshape(-1, model.config.top_k).tolist())

"""Tiny random Hugging Face checkpoints, one per supported family, for tests.

Written with transformers' own config and model classes (`save_pretrained`, safetensors),
so the loader reads exactly what a real checkpoint of the family looks like; the
byte-level tokenizer of the built-in model is written next to them, so text prompts work.
Each family's config fields live in its oracle test module, tests/families/test_<family>.py
(`tiny_config`): adding a family touches no shared test file.

    from tiny_checkpoints import write_tiny_checkpoint
    path = write_tiny_checkpoint(tmp_path / "ckpt", "mixtral", num_experts=16)

Weights are re-drawn with a wide spread (transformers' std-0.02 init makes router scores
near-ties, so tiny float differences would flip the top-k): every family's routing and
greedy tokens are then well separated and comparable across implementations.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from r3srv.models.builtin import SPECIAL_TOKENS, write_byte_level_tokenizer

# one oracle test module per family, tests/families/test_<family>.py, holds its tiny config
FAMILIES = tuple(sorted(p.stem.removeprefix("test_") for p in (Path(__file__).parent / "families").glob("test_*.py")))
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte-level tokenizer
EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")


def hf_config(family: str, *, num_experts: int = 8, top_k: int = 2, num_layers: int = 2, **overrides: Any):
    """A tiny transformers config object of `family` (the shape every family shares, then the
    fields of its test module's `tiny_config`); `overrides` go straight into it."""
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        max_position_embeddings=512,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    config_class, extra = _family_test(family).tiny_config(
        transformers, num_experts=num_experts, top_k=top_k, num_layers=num_layers
    )
    return config_class(**{**common, **extra, **overrides})


def _family_test(family: str):
    """The family's test module: the name pytest imports it by (tests/ on sys.path, prepend
    mode), so that it is one module object."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return importlib.import_module(f"families.test_{family}")


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight: unit-scale activations, norms near one, spread-out router logits."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        else:
            fan_in = p.shape[-1]
            # router gates (mlp.gate / block_sparse_moe.gate / mlp.router) and the shared-expert gate: wide logits
            wide = name.endswith(("gate.weight", "router.weight"))
            std = 3.0 / math.sqrt(fan_in) if wide else 1.0 / math.sqrt(fan_in)
            p.copy_(std * torch.randn(p.shape, generator=g))
    for name, b in sorted(model.named_buffers()):
        if name.endswith(("e_score_correction_bias", "expert_bias")):  # a router bias that changes picks
            b.copy_(0.3 * torch.randn(b.shape, generator=g))


def build_hf_model(family: str, *, seed: int = 0, **config_kwargs: Any):
    """A transformers model of `family` (float32, eval mode) with randomized weights."""
    import transformers

    config = hf_config(family, **config_kwargs)
    torch.manual_seed(seed)
    family_test = _family_test(family)
    if hasattr(family_test, "hf_model"):  # a family without a causal-LM class says which model to build
        model = family_test.hf_model(transformers, config).to(torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def write_tiny_checkpoint(
    path: str | Path,
    family: str = "qwen3_moe",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    **config_kwargs: Any,
) -> Path:
    """Write a tiny random checkpoint of `family` to `path` and return the path.

    config_kwargs: num_experts, top_k, num_layers, or any transformers config field
    (e.g. mlp_only_layers=[1] for a Qwen3-MoE with a dense layer). max_shard_size (e.g.
    "20KB") writes several shards plus model.safetensors.index.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(family, seed=seed, **config_kwargs)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        write_byte_level_tokenizer(path)
    return path


def hf_gate_modules(hf) -> dict[int, torch.nn.Module]:
    """Layer index -> router gate of a transformers MoE model built by `build_hf_model`."""
    gates = {}
    decoder = getattr(hf.model, "language_model", hf.model)  # Qwen3-VL nests its language model
    for i, layer in enumerate(decoder.layers):
        moe = (getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
               or getattr(layer, "feed_forward", None) or layer.mixer)  # LFM2: feed_forward; Nemotron-H: mixer
        if hasattr(moe, "experts") and (hasattr(moe, "gate") or hasattr(moe, "router")):
            gates[i] = getattr(moe, "gate", None) or moe.router
    return gates


def hf_router_ids(gate: torch.nn.Module, inputs: tuple, output: tuple) -> torch.Tensor:
    """The [T, k] expert ids a transformers router module returned (a forward hook's
    arguments), in router order.

    Most routers return them sorted by score; sigmoid routers with a correction bias
    (GLM-4.5, MiniMax-M2, DeepSeek-V3) and DeepSeek-V2's return an unsorted top-k, which is
    put in r3srv's order here: descending score (+ bias), ties to the lower id.
    """
    ids = output[2]
    bias = getattr(gate, "e_score_correction_bias", None)  # GLM-4.5: the router holds it
    if bias is None and len(inputs) > 1:  # MiniMax-M2: the MoE block passes it in
        bias = inputs[1]
    if bias is not None:
        keys = (output[0].float().sigmoid() + bias).gather(1, ids)
    elif getattr(gate, "topk_method", None) is not None:  # DeepSeek-V2: softmax, ranked by its logits
        keys = output[0].float().gather(1, ids)
    else:
        return ids
    by_id = torch.sort(ids, dim=1).indices  # ties keep ascending ids through the stable sort
    ids, keys = ids.gather(1, by_id), keys.gather(1, by_id)
    return ids.gather(1, torch.sort(keys, dim=1, descending=True, stable=True).indices)


def hf_forward_with_gate_hook(hf, tokens: list[int], hook):
    """One transformers forward over `tokens` (its output returned), `hook(layer, gate, inputs,
    output)` called on each MoE layer's router module."""
    hooks = [gate.register_forward_hook(lambda m, i, o, layer=layer: hook(layer, m, i, o))
             for layer, gate in hf_gate_modules(hf).items()]
    try:
        with torch.no_grad():
            return hf(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()


def hf_logprobs_and_rows(hf, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """log-softmax [T, V] and router top-k rows [T, layers, k] (r3srv's order) of one transformers
    forward over `tokens`."""
    picked: dict[int, torch.Tensor] = {}
    out = hf_forward_with_gate_hook(hf, tokens, lambda layer, m, i, o: picked.__setitem__(layer, hf_router_ids(m, i, o)))
    rows = torch.stack([picked[layer] for layer in sorted(picked)], dim=1).numpy()
    return torch.log_softmax(out.logits[0].float(), dim=-1), rows


def hf_router_weights(hf, tokens: list[int], num_layers: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, layers, k] in r3srv's order, each id's router weight: the router module's
    second output) of one transformers forward over `tokens`; dense layers' zero."""
    ids = np.zeros((len(tokens), num_layers, top_k), dtype=np.int64)
    weights = np.zeros((len(tokens), num_layers, top_k), dtype=np.float32)

    def hook(layer, gate, inp, out):
        ordered = hf_router_ids(gate, inp, out)  # the router's top-k put in r3srv's order
        for t in range(len(tokens)):
            by_id = dict(zip(out[2][t].tolist(), out[1][t].float().tolist()))
            weights[t, layer] = [by_id[e] for e in ordered[t].tolist()]
        ids[:, layer] = ordered.numpy()

    hf_forward_with_gate_hook(hf, tokens, hook)
    return ids, weights


BOS_TEMPLATE_ID = 256  # <|endoftext|> of the byte-level tokenizer


def make_bos_adding_chat_checkpoint(path: Path) -> Path:
    """A tiny Mixtral whose tokenizer adds a BOS to every encode AND whose chat template
    writes `{{ bos_token }}` itself (as Mixtral's does): the case where encoding a rendered
    chat with the tokenizer's specials would double the BOS."""
    import json

    from tokenizers import processors

    from r3srv.models.builtin import byte_level_tokenizer

    path = write_tiny_checkpoint(path, "mixtral")
    tok = byte_level_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS_TEMPLATE_ID)]
    )
    (path / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(
        bos_token="<|endoftext|>",
        chat_template="{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path

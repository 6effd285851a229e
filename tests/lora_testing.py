"""Shared pieces of the LoRA tests: tiny checkpoints with PEFT adapters saved beside them, and
PEFT + transformers as the oracle of a greedy continuation (tokens, their logprobs, the router's
picks at every layer)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import build_hf_model, hf_gate_modules, hf_router_ids, write_tiny_checkpoint

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# per family: the modules an adapter targets (attention, dense or shared-expert MLPs, MLA's
# projections, a hybrid's linear-attention projections) beside the routed experts
TARGETS = {
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2_moe": ["q_proj", "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                  "shared_expert.down_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj",
                    "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"],
    "qwen3_next": ["q_proj", "k_proj", "v_proj", "o_proj", "out_proj"],
}


def write_checkpoint(path: Path, family: str) -> Path:
    return write_tiny_checkpoint(path, family, seed=0)


def checkpoint_and_two_adapters(root: Path, family: str) -> tuple[Path, Path, Path]:
    """The family's tiny checkpoint and two PEFT adapters of it (seeds 1 and 2) under `root`."""
    return write_checkpoint(root / "ckpt", family), write_adapter(root / "a1", family, seed=1), \
        write_adapter(root / "a2", family, seed=2)


def write_adapter(path: Path, family: str, seed: int, *, rank: int = 4, alpha: int = 8, experts: bool = True,
                  targets: list[str] | None = None, parameters: list[str] | None = None,
                  shared_outer: bool = False) -> Path:
    """A PEFT adapter of the family's tiny model (random A and B, large enough to change the
    tokens), saved by PEFT into `path`. parameters: PEFT's target_parameters beside the routed
    experts' (or alone, experts=False). shared_outer: the experts' gate_up A and down B made
    equal across experts (SGLang's shared-outer form, still a valid PEFT adapter)."""
    from peft import LoraConfig, get_peft_model

    hf = build_hf_model(family, seed=0)
    wrapped = (EXPERT_PARAMETERS if experts else []) + (parameters or [])
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS[family] if targets is None else targets,
                        target_parameters=wrapped or None, init_lora_weights=False)
    peft = get_peft_model(hf, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(peft.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)
        if shared_outer:
            for module in peft.modules():
                if type(module).__name__ == "ParamWrapper" and module.num_experts > 1:
                    _share_outer(module)
    peft.save_pretrained(path)
    return path


def _share_outer(wrapper) -> None:
    """gate_up's A (inner wrapper) or down's B (outer) equal for every expert."""
    name = wrapper.parameter_name
    for adapter in wrapper.lora_A:
        e = wrapper.num_experts
        if name == "gate_up_proj":
            a = wrapper.lora_A[adapter].weight  # [E r, in]
            a.copy_(a.view(e, -1, a.shape[-1])[:1].expand(e, -1, -1).reshape(a.shape))
        elif name == "down_proj":
            b = wrapper.lora_B[adapter].weight  # [out, r E]: column r * E + e
            view = b.view(b.shape[0], -1, e)
            b.copy_(view[:, :, :1].expand(-1, -1, e).reshape(b.shape))


@dataclass
class Reference:
    tokens: list[int]
    logprobs: list[float]
    rows: np.ndarray  # [num_tokens - 1, layers, k]


def peft_reference(family: str, adapter: Path | None, prompt: list[int], max_tokens: int) -> Reference:
    """The greedy continuation of PEFT's model (the base one when adapter is None)."""
    from peft import PeftModel

    hf = build_hf_model(family, seed=0)
    gates = hf_gate_modules(hf)
    model = hf if adapter is None else PeftModel.from_pretrained(hf, str(adapter)).eval()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
        picked: dict[int, torch.Tensor] = {}
        hooks = [g.register_forward_hook(lambda m, i, o, n=n: picked.__setitem__(n, hf_router_ids(m, i, o).clone()))
                 for n, g in gates.items()]
        try:
            model(torch.tensor([ids[:-1]]))
        finally:
            for h in hooks:
                h.remove()
    num_layers = hf.config.num_hidden_layers
    k = next(iter(picked.values())).shape[-1]
    rows = np.zeros((len(ids) - 1, num_layers, k), dtype=np.int64)
    for layer, chosen in picked.items():
        rows[:, layer] = chosen.numpy()
    return Reference(ids[len(prompt):], logprobs, rows)


def assert_matches(output, ref: Reference) -> None:
    """r3srv's choice against the oracle: tokens and rows equal, logprobs to float tolerance."""
    got = output.outputs[0]
    assert got.token_ids == ref.tokens
    served = [getattr(lp[t], "logprob", lp[t]) for lp, t in zip(got.logprobs, got.token_ids)]
    np.testing.assert_allclose(served, ref.logprobs, atol=2e-4, rtol=0)
    np.testing.assert_array_equal(got.routed_experts.astype(np.int64), ref.rows)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- other layouts of one adapter -----------------------------------------------------------
def _peft_tensors(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((path / "adapter_config.json").read_text()), load_file(str(path / "adapter_model.safetensors"))


def _expert_pairs(tensors: dict, config: dict):
    """PEFT's parameter-wrapper tensors as {(layer prefix, "gate_up_proj"|"down_proj"): (A [E, r, in], B [E, out, r])}."""
    r = config["r"]
    out = {}
    for key, a in tensors.items():
        if ".experts." not in key or not key.endswith("lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        name = "gate_up_proj" if module.endswith(".base_layer") else "down_proj"  # the first declared is inner
        prefix = module.removesuffix(".base_layer").removesuffix(".experts")
        b = tensors[module + ".lora_B.weight"]
        e = a.shape[0] // r
        out[(prefix, name)] = (a.reshape(e, r, -1), b.reshape(b.shape[0], r, e).permute(2, 0, 1))
    return out


def write_layout(src: Path, dst: Path, layout: str) -> Path:
    """The PEFT adapter at src rewritten in another layout trainers export:
    "per_expert" (transformers 4's per-expert modules, as PEFT saved them then) or "stacked"
    (SGLang's 3-D tensors, an expert dimension of 1 where every expert shares the tensor)."""
    config, tensors = _peft_tensors(src)
    pairs = _expert_pairs(tensors, config)
    kept = {k: v for k, v in tensors.items() if ".experts." not in k}
    for (prefix, name), (a, b) in pairs.items():
        if layout == "per_expert":
            halves = [("gate_proj", "up_proj")] if name == "gate_up_proj" else [("down_proj",)]
            inter = b.shape[1] // 2
            for e in range(a.shape[0]):
                if name == "down_proj":
                    kept[f"{prefix}.experts.{e}.down_proj.lora_A.weight"] = a[e].clone()
                    kept[f"{prefix}.experts.{e}.down_proj.lora_B.weight"] = b[e].clone()
                    continue
                for piece, proj in enumerate(halves[0]):  # gate rows then up rows: each its own pair
                    kept[f"{prefix}.experts.{e}.{proj}.lora_A.weight"] = a[e].clone()
                    kept[f"{prefix}.experts.{e}.{proj}.lora_B.weight"] = b[e, piece * inter:(piece + 1) * inter].clone()
        else:
            a_out = a[:1] if torch.equal(a, a[:1].expand_as(a)) else a
            b_out = b[:1] if torch.equal(b, b[:1].expand_as(b)) else b
            kept[f"{prefix}.experts.{name}.lora_A.weight"] = a_out.contiguous()
            kept[f"{prefix}.experts.{name}.lora_B.weight"] = b_out.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    config = dict(config, target_parameters=None)
    if layout == "per_expert":
        config["target_modules"] = sorted(set(config["target_modules"]) | {"gate_proj", "up_proj", "down_proj"})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(kept, str(dst / "adapter_model.safetensors"))
    return dst

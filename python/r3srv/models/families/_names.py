"""Checkpoint tensor names shared by several families: a Llama-style decoder's, and the MoE
block's in its per-expert (released) and fused (transformers 5 in memory) forms.

Every function returns {Hugging Face tensor name: the view of our (stacked) parameter it
fills}; the views come from the layers (`part()`, models/parallel.py), which mark the slice of
the checkpoint tensor a rank holds; the loader checks shapes and that every parameter is filled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from r3srv.models.model import MoeForCausalLM
    from r3srv.models.moe import Mlp, SparseMoeBlock

Targets = dict[str, "torch.Tensor"]

# our norm attribute -> its checkpoint name, in a decoder layer with norms before each branch
PRE_NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}


@dataclass(frozen=True)
class MoeNames:
    """Where a family's MoE block keeps its tensors (relative to the layer's prefix)."""

    module: str = "mlp."  # the released per-expert names' module (Mixtral's: "block_sparse_moe.")
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral's: w1, w3, w2
    correction_bias: tuple[str, ...] = ()  # e_score_correction_bias's names
    shared: str = "mlp.shared_expert."  # the shared expert's gate / up / down projections


def model_targets(model: MoeForCausalLM, embed: str = "model.embed_tokens.weight",
                  norm: str = "model.norm.weight") -> Targets:
    """The embedding, the final norm and (unless tied) the LM head."""
    targets = {embed: model.embed.part(), norm: model.final_norm}
    if not model.config.tie_word_embeddings:
        targets["lm_head.weight"] = model.lm_head.part()
    return targets


def decoder_targets(model: MoeForCausalLM, moe: Callable[[str, SparseMoeBlock], Targets],
                    norms: dict[str, str] = PRE_NORMS, dense: str = "mlp.") -> Targets:
    """A decoder of attention (or linear-attention) then MLP layers under model.layers.<i>.:
    `norms` names the layer's norms, `moe` names a MoE block's tensors, dense MLPs sit under `dense`."""
    targets = model_targets(model)
    for layer in model.layers:
        p = f"model.layers.{layer.index}."
        targets |= {p + name + ".weight": getattr(layer, attr) for attr, name in norms.items()
                    if getattr(layer, attr) is not None}
        targets |= (layer.linear_attn or layer.attn).weight_targets(p)
        targets |= moe(p, layer.mlp) if layer.is_moe else gated_mlp_targets(p + dense, *mlp_parts(layer.mlp))
    return targets


def mlp_parts(mlp: Mlp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A SwiGLU MLP's gate, up and down projections as checkpoint targets."""
    return mlp.gate_up.part(0), mlp.gate_up.part(1), mlp.down.part()


def gated_mlp_targets(p: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                      names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Targets:
    """A SwiGLU MLP's gate, up and down projections under their names."""
    return {p + f"{names[0]}.weight": gate, p + f"{names[1]}.weight": up, p + f"{names[2]}.weight": down}


def fused_expert_targets(p: str, mlp: SparseMoeBlock) -> Targets:
    """transformers 5's in-memory names of the router and the stacked experts (under "mlp." in every family)."""
    experts = mlp.experts
    return {p + "mlp.gate.weight": mlp.gate, p + "mlp.experts.gate_up_proj": experts.w13_part(),
            p + "mlp.experts.down_proj": experts.w2_part()}


def moe_targets(p: str, mlp: SparseMoeBlock, names: MoeNames = MoeNames()) -> Targets:
    """A SwiGLU MoE block's released per-expert names and transformers 5's fused ones."""
    module = p + names.module
    targets = {module + "gate.weight": mlp.gate}
    if mlp.correction_bias is not None:
        targets |= {p + name: mlp.correction_bias for name in names.correction_bias}
    experts = mlp.experts
    for e in experts.local_ids:  # logical ids: another rank's experts are not targets here
        targets |= gated_mlp_targets(f"{module}experts.{e}.", experts.w13_part(e, 0), experts.w13_part(e, 1),
                                     experts.w2_part(e), names.projections)
    targets |= fused_expert_targets(p, mlp)
    if mlp.shared is not None:
        targets |= gated_mlp_targets(p + names.shared, *mlp_parts(mlp.shared))
        if mlp.shared_gate is not None:
            targets[p + "mlp.shared_expert_gate.weight"] = mlp.shared_gate
    return targets


def in_language_model(targets: Targets) -> Targets:
    """targets and their names in a multimodal checkpoint, which nests the language model."""
    return targets | {"model.language_model." + k.removeprefix("model."): v for k, v in targets.items()
                      if k.startswith("model.")}

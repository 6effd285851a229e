"""An adapter's tensors, from a PEFT save or from tensors a trainer pushes, normalized to one
low-rank pair per base checkpoint tensor.

Layouts read (keys with or without PEFT's `base_model.model.` prefix):

- a module (`...q_proj.lora_A.weight` [r, in], `.lora_B.weight` [out, r]): attention, dense MLPs,
  shared experts, the router gate, and per-expert modules (`...experts.3.gate_proj`) as PEFT saves
  them for transformers 4's expert modules; the target is `<module>.weight`;
- PEFT's parameter wrappers (`target_parameters=["mlp.experts.gate_up_proj", ...]`): A [E * r, in],
  B [out, E * r] under `...experts[.base_layer]*.lora_A.weight`, the nesting depth telling which
  of the module's targeted parameters (the first the module declares is the innermost); on a
  plain weight (transformers 5's router gate, `target_parameters=["gate.weight"]`) a stack of one
  expert, read as the plain pair it is;
- stacked 3-D tensors (`...experts.gate_up_proj.lora_A.weight` [E, r, in], `.lora_B.weight`
  [E, out, r]), with SGLang's shared-outer form: an expert dimension of 1 is one tensor shared by
  every expert (gate_up's A, down's B).

Each pair is `LoraPair(a, b)`: delta W = b @ a (per expert for 3-D pairs), the scaling
(lora_alpha / r, or / sqrt(r) with use_rslora; PEFT's rank and alpha patterns) folded into b.
Whatever PEFT would compute differently (DoRA, biases, fan_in_fan_out, modules_to_save, ...) is
refused naming the key, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from r3srv.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?P<module>.+?)\.(?P<kind>lora_A|lora_B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
_PREFIX = "base_model.model."
# config keys whose non-default value changes what PEFT computes (r3srv would silently differ)
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
            "layer_replication": None, "use_qalora": False, "trainable_token_indices": None, "alora_invocation_tokens": None}


@dataclass(frozen=True)
class LoraPair:
    """delta W = b @ a: a [r, in] and b [out, r] (scaled), or per expert a [E, r, in] and
    b [E, out, r] (an expert dimension of 1: shared by every expert)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[-2]

    @property
    def experts(self) -> bool:
        return self.a.dim() == 3


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: its pairs by the base checkpoint tensor they adapt."""

    pairs: dict[str, LoraPair]
    rank: int  # the largest rank of its pairs
    config: dict[str, Any]

    @property
    def targets(self) -> list[str]:
        return sorted(self.pairs)


def read_dir(path: str | os.PathLike, param: str = "lora_path") -> LoraAdapter:
    """The adapter a PEFT `save_pretrained` wrote into `path`; InvalidRequestError naming
    `param` for a missing or unreadable save."""
    root = Path(path)
    if not root.is_dir():
        raise InvalidRequestError(f"{param}={str(path)!r} is not a directory holding a PEFT adapter", param=param)
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise InvalidRequestError(f"{param}={str(path)!r} has no {CONFIG_FILE}", param=param) from None
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"{param}={str(path)!r}: cannot read {CONFIG_FILE}: {exc}", param=param) from None
    tensors = _read_tensors(root, param)
    return from_tensors(config, tensors, param=param)


def _read_tensors(root: Path, param: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = root / name
        if not file.exists():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(str(file), map_location="cpu", weights_only=True)  # tensors only, no code
        except Exception as exc:  # a truncated or corrupt file
            raise InvalidRequestError(f"{param}: cannot read {file.name}: {exc}", param=param) from None
    raise InvalidRequestError(f"{param}={str(root)!r} has none of {', '.join(WEIGHT_FILES)}", param=param)


def from_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor], param: str = "lora_path") -> LoraAdapter:
    """An adapter from PEFT's config (adapter_config.json as a dict) and its saved tensors."""
    if not isinstance(config, dict):
        raise InvalidRequestError("the adapter's config must be a JSON object", param=param)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequestError(f"peft_type={config.get('peft_type')!r} is not LORA", param=param)
    for key, neutral in _REFUSED.items():
        value = config.get(key, neutral)
        if value not in (neutral, [], {}, None) and value != neutral:
            raise InvalidRequestError(f"the adapter's {key}={value!r} is not supported (it would change what "
                                      "the adapter computes)", param=param)
    try:
        r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError):
        raise InvalidRequestError("the adapter's config needs an integer r and a number lora_alpha", param=param) from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key.removeprefix(_PREFIX))
        if match is None or not isinstance(tensor, torch.Tensor):
            raise InvalidRequestError(f"tensor {key!r} is not a LoRA A or B weight this server reads", param=param)
        halves.setdefault(match["module"], {})[match["kind"]] = tensor
    if not halves:
        raise InvalidRequestError("the adapter holds no LoRA tensors", param=param)
    pairs: dict[str, LoraPair] = {}
    wrapped = _wrapped_parameters(config)
    for module, half in sorted(halves.items()):
        if set(half) != {"lora_A", "lora_B"}:
            raise InvalidRequestError(f"{module} has {', '.join(sorted(half))} but not both lora_A and lora_B",
                                      param=param)
        target, a, b = _pair_of(module, half["lora_A"], half["lora_B"], r, config, wrapped, param)
        rank = a.shape[-2]
        if rank < 1:
            raise InvalidRequestError(f"{target}: a pair of rank 0", param=param)
        scale = _pattern(config.get("alpha_pattern"), target, alpha) / (
            math.sqrt(rank) if config.get("use_rslora") else rank)
        if target in pairs:
            raise InvalidRequestError(f"{target} is adapted twice", param=param)
        pairs[target] = LoraPair(a.float().contiguous(), (b.float() * scale).contiguous())
    return LoraAdapter(pairs, max(p.rank for p in pairs.values()), dict(config))


def _pair_of(module: str, a: torch.Tensor, b: torch.Tensor, r: int, config: dict, wrapped: dict[str, list[str]],
             param: str) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(target name, a, b) of one module's halves, in the pair's layout."""
    owner, depth = module, 0
    while owner.endswith(".base_layer"):
        owner, depth = owner.removesuffix(".base_layer"), depth + 1
    wrappers = next((names for suffix, names in wrapped.items() if owner == suffix or owner.endswith("." + suffix)), None)
    if wrappers is not None and a.dim() == 2:  # PEFT's parameter wrapper: A [E r, in], B [out, E r]
        if depth >= len(wrappers):
            raise InvalidRequestError(f"{module}: nested deeper than its {len(wrappers)} target_parameters", param=param)
        name = wrappers[len(wrappers) - 1 - depth]  # the first listed is the innermost wrapper
        target = f"{owner}.{name}"
        rank = _pattern(config.get("rank_pattern"), target, r)
        rows = a.shape[0]
        if rank < 1 or rows % rank or b.dim() != 2 or b.shape[1] != rows:
            raise InvalidRequestError(f"{target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                                      f"a rank-{rank} expert stack", param=param)
        experts = rows // rank
        if experts == 1 and name == "weight":  # the router gate's plain weight: a plain pair, not a stack of one
            return target, a, b
        return target, a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)
    if a.dim() == 3 and b.dim() == 3:  # stacked per expert (an expert dim of 1: shared)
        if a.shape[1] != b.shape[2] or (a.shape[0] != b.shape[0] and 1 not in (a.shape[0], b.shape[0])):
            raise InvalidRequestError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                      "make an expert stack", param=param)
        return module, a, b
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise InvalidRequestError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a "
                                  "low-rank pair", param=param)
    return module + ".weight", a, b


# PEFT wraps a module's targeted parameters in the order the module declares them (the first
# innermost), whatever order its saved config lists them in (a set's); transformers' expert
# modules declare these in this order
_DECLARED = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


def _wrapped_parameters(config: dict) -> dict[str, list[str]]:
    """PEFT's target_parameters by their module, innermost first: {"mlp.experts": ["gate_up_proj", "down_proj"]}."""
    wrapped: dict[str, list[str]] = {}
    for name in config.get("target_parameters") or ():
        module, _, parameter = str(name).rpartition(".")
        wrapped.setdefault(module, []).append(parameter)
    rank = {name: i for i, name in enumerate(_DECLARED)}
    return {m: sorted(names, key=lambda n: rank.get(n, len(rank))) for m, names in wrapped.items()}


def _pattern(patterns: dict | None, name: str, default: float) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key the name ends with
    (as a dotted suffix or a regular expression over the whole name), else the default."""
    stem = name.removesuffix(".weight")
    for key, value in (patterns or {}).items():
        if stem == key or stem.endswith("." + key):
            return value
        try:
            if re.fullmatch(rf"(.*\.)?(?:{key})", stem):
                return value
        except re.error:
            continue
    return default


def state_dict(adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """The adapter's pairs as tensors (the in-memory form a replacement or a worker receives)."""
    out = {}
    for target, pair in adapter.pairs.items():
        out[f"{target}::a"], out[f"{target}::b"] = pair.a, pair.b
    return out


def from_state_dict(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> LoraAdapter:
    """state_dict's inverse."""
    pairs = {}
    for key in tensors:
        target, _, half = key.rpartition("::")
        if half == "a":
            pairs[target] = LoraPair(tensors[key], tensors[f"{target}::b"])
    return LoraAdapter(pairs, max(p.rank for p in pairs.values()), config)

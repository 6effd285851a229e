"""Load a Hugging Face MoE checkpoint directory (or the built-in model) into an `MoeForCausalLM`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from r3srv.errors import ConfigError
from r3srv.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, parse_dtype
from r3srv.models.model import MoeForCausalLM
from r3srv.tokenizer import Tokenizer

__all__ = ["SUPPORTED_ARCHITECTURES", "load_model", "load_weights_from_dir", "resolve_dtype", "safetensors_files"]

logger = logging.getLogger(__name__)

# checkpoint tensors that carry no weights we need (recomputed or unused at inference)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: torch.dtype | str | None, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """None / "auto": the checkpoint's dtype on CUDA, float32 on the CPU."""
    if dtype is None or dtype == "auto":
        return checkpoint_dtype if device.type == "cuda" else torch.float32
    return parse_dtype(dtype)


def safetensors_files(path: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"cannot read the shard index {index}: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{path}: shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def load_model(
    path: str | os.PathLike | None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> tuple[MoeForCausalLM, Tokenizer | None]:
    """Load a checkpoint directory; `path=None` (or the name BUILTIN_MODEL_NAME) loads the built-in
    model (random weights).

    Returns (model, tokenizer). The tokenizer is None when the directory has no
    tokenizer.json (token-id prompts only). Raises ConfigError for an unsupported
    architecture, a missing or malformed file, or missing weights.
    """
    from r3srv.models.builtin import BUILTIN_MODEL_NAME, builtin_model_dir

    if path is None or (str(path) == BUILTIN_MODEL_NAME and not Path(path).is_dir()):
        path = builtin_model_dir()
        logger.warning(
            "loading the built-in model %s: random weights (for plumbing and benchmarks, its text is meaningless)",
            BUILTIN_MODEL_NAME,
        )
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(
            f"model path {str(path)!r} is not a directory (r3srv never downloads: pass a local checkpoint "
            f"directory, or no model / {BUILTIN_MODEL_NAME!r} for the built-in model)"
        )
    cfg = ModelConfig.from_dir(path)
    device = torch.device(device)
    model_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
    model = MoeForCausalLM(cfg, dtype=model_dtype, device=device)
    _load_weights(model, safetensors_files(path))
    model.eval()

    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    if tokenizer is None:
        logger.warning("%s has no tokenizer.json: only token-id prompts will work", path)
    else:
        if tokenizer.eos_token_id is None and cfg.eos_token_ids:
            tokenizer.eos_token_id = cfg.eos_token_ids[0]
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in cfg.eos_token_ids:
            cfg.eos_token_ids.append(tokenizer.eos_token_id)
        if cfg.bos_token_id is None:
            cfg.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


# ModelConfig fields two checkpoints may differ in and still swap weights (an RL policy update).
_UPDATE_MAY_CHANGE = frozenset({"name", "torch_dtype", "raw", "eos_token_ids", "bos_token_id"})


def load_weights_from_dir(model: MoeForCausalLM, path: str | os.PathLike) -> None:
    """Overwrite `model`'s weights with those of a checkpoint of the same architecture.

    The checkpoint's config.json must describe the served model (same shapes, same routing:
    experts, top_k, MoE layers, scoring); it and every shard header are checked before any
    weight is copied, so a ConfigError leaves the model as it was. Weights are cast to the
    served dtype.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{str(path)!r} is not a checkpoint directory with a config.json")
    new, served = ModelConfig.from_dir(path), model.config
    changed = [
        f"{f.name}={getattr(new, f.name)!r} (served: {getattr(served, f.name)!r})"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _UPDATE_MAY_CHANGE and getattr(new, f.name) != getattr(served, f.name)
    ]
    if changed:
        raise ConfigError(f"{path} is not the served model's architecture: {'; '.join(changed[:6])}")
    _load_weights(model, safetensors_files(path))


def _load_weights(model: MoeForCausalLM, files: list[Path]) -> None:
    _copy_weights(model, _plan_weights(model, files))


def _plan_weights(model: MoeForCausalLM, files: list[Path]) -> list[tuple[Path, list[str]]]:
    """Which tensors of which shard fill the model, checked from the shard headers alone:
    every shape matches and every parameter is filled, before a single weight is copied."""
    targets = model.weight_targets()
    # elements filled per parameter, to report anything the checkpoint left empty
    filled: dict[str, int] = {}
    named = dict(model.named_parameters(remove_duplicate=True))
    by_storage = {p.untyped_storage().data_ptr(): name for name, p in named.items()}
    # a target is a view of one parameter: they share its storage
    owners = {name: by_storage[t.untyped_storage().data_ptr()] for name, t in targets.items()}
    unexpected: list[str] = []
    plan: list[tuple[Path, list[str]]] = []
    for file in files:
        used: list[str] = []
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise ConfigError(f"cannot read {file}: {exc}") from exc
        for name, shape in shapes.items():
            target = targets.get(name)
            if target is None:
                if not name.endswith(_IGNORED_SUFFIXES) and not (name == "lm_head.weight" and model.config.tie_word_embeddings):
                    unexpected.append(name)
                continue
            if shape != tuple(target.shape):
                raise ConfigError(f"{file.name}: tensor {name} has shape {shape}, the config implies {tuple(target.shape)}")
            owner = owners[name]
            filled[owner] = filled.get(owner, 0) + target.numel()
            used.append(name)
        plan.append((file, used))
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use, e.g. %s", len(unexpected), unexpected[:5])
    missing = [name for name, p in named.items() if filled.get(name, 0) != p.numel()]
    if missing:
        raise ConfigError(f"the checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:8]}")
    return plan


@torch.no_grad()
def _copy_weights(model: MoeForCausalLM, plan: list[tuple[Path, list[str]]]) -> None:
    targets = model.weight_targets()
    for file, names in tqdm(plan, desc="Loading safetensors shards", unit="shard"):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                targets[name].copy_(f.get_tensor(name))

"""Load a Hugging Face MoE checkpoint directory (or the built-in model) into an `MoeForCausalLM`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from r3srv import huge_pages
from r3srv.errors import ConfigError
from r3srv.models import quantization as quant
from r3srv.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, parse_dtype
from r3srv.models.model import MoeForCausalLM
from r3srv.models.parallel import SINGLE, ParallelState, checkpoint_shape, loaded_numel, shard_of, transposed
from r3srv.models.shard_reader import read_fp8, read_mxfp4, read_tensor
from r3srv.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "NamedTensors",
    "load_model",
    "load_named_tensors",
    "load_weights_from_dir",
    "plan_named_tensors",
    "planned_reads",
    "resolve_dtype",
    "safetensors_files",
]

logger = logging.getLogger(__name__)

# checkpoint tensors that carry no weights we need (recomputed or unused at inference)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors' names of the dtypes a weight may arrive in (cast to the served dtype at the copy)
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", *quant.FP8_DTYPES})


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
    parallel: ParallelState = SINGLE,
    batch_invariant: bool = False,
) -> tuple[MoeForCausalLM, Tokenizer | None]:
    """Load a checkpoint directory; `path=None` (or the name BUILTIN_MODEL_NAME) loads the built-in
    model (random weights).

    parallel: this rank's place; the model holds, and reads, only its shard of each weight.
    batch_invariant: the backend's batch-invariant ops (r3srv.ops.ops_for; ConfigError where the
    device has none).
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
    try:
        model = MoeForCausalLM(cfg, dtype=model_dtype, device=device, parallel=parallel,
                               batch_invariant=batch_invariant)
    except ConfigError:  # an option the model cannot take (--batch-invariant's gaps): its own message
        raise
    except (ValueError, NotImplementedError) as exc:  # heads or experts that do not split over the ranks
        raise ConfigError(f"{cfg.name} cannot be split that way: {exc}") from exc
    huge_pages.advise(itertools.chain(model.parameters(), model.buffers()))  # before the copies write them
    _load_weights(model, safetensors_files(path), cfg)
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
_UPDATE_MAY_CHANGE = frozenset({"name", "torch_dtype", "raw", "eos_token_ids", "bos_token_id", "fp8_block", "mxfp4"})


def load_weights_from_dir(model: MoeForCausalLM, path: str | os.PathLike) -> None:
    """Overwrite `model`'s weights with those of a checkpoint of the same architecture.

    The checkpoint's config.json must describe the served model (same shapes, same routing:
    experts, top_k, MoE layers, scoring); it and every shard header are checked before any
    weight is copied, so a ConfigError leaves the model as it was. Weights are cast to the
    served dtype. A directory of shards alone (what prime-rl's trainer writes: safetensors
    and their index, no config.json) is read as the served architecture's.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{str(path)!r} is not a checkpoint directory")
    served = model.config
    if not (path / "config.json").is_file():
        if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
            raise ConfigError(f"{str(path)!r} has neither a config.json nor *.safetensors weights")
        _load_weights(model, safetensors_files(path), served)
        return
    new = ModelConfig.from_dir(path)
    changed = [
        f"{f.name}={getattr(new, f.name)!r} (served: {getattr(served, f.name)!r})"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _UPDATE_MAY_CHANGE and getattr(new, f.name) != getattr(served, f.name)
    ]
    if changed:
        raise ConfigError(f"{path} is not the served model's architecture: {'; '.join(changed[:6])}")
    _load_weights(model, safetensors_files(path), new)


def _load_weights(model: MoeForCausalLM, files: list[Path], checkpoint: ModelConfig) -> None:
    plan = _plan_weights(model, _read_headers(files), checkpoint.fp8_block, checkpoint.mxfp4)
    if plan.unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use, e.g. %s", len(plan.unexpected),
                       plan.unexpected[:5])
    if plan.missing:
        raise ConfigError(f"the checkpoint lacks weights for {len(plan.missing)} parameters, e.g. {plan.missing[:8]}")
    _copy_weights(model, plan)


class NamedTensors:
    """Tensors that arrive by name (a trainer's broadcast), read like a safetensors shard; their
    metadata (shape, dtype) is known, and checked, before the tensors themselves arrive."""

    name = "the update"  # how errors name this "shard"

    def __init__(self, metas: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.metas = {name: (tuple(shape), dtype) for name, (shape, dtype) in metas.items()}
        self.tensors: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "NamedTensors":
        named = cls({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
        named.tensors = dict(tensors)
        return named

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def split(self, prefix: str) -> tuple["NamedTensors", "NamedTensors"]:
        """(those whose names start with `prefix`, the others)."""
        parts = (NamedTensors({}), NamedTensors({}))
        for name, meta in self.metas.items():
            part = parts[0 if name.startswith(prefix) else 1]
            part.metas[name] = meta
            if name in self.tensors:
                part.tensors[name] = self.tensors[name]
        return parts

    def get_slice(self, name: str) -> "_InMemorySlice":
        return _InMemorySlice(self.tensors[name])

    def header(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (shape, safetensors_dtype(dtype)) for name, (shape, dtype) in self.metas.items()}


class _InMemorySlice:
    """A tensor read as safetensors' get_slice reads one (a rank's shard, models/shard_reader.py)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype (what a shard header says), as the planner reads it."""
    return _SAFETENSORS_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def plan_named_tensors(model: MoeForCausalLM, named: NamedTensors, *, complete: bool) -> WeightPlan:
    """Check tensors that are to arrive by name (checkpoint names, shapes, dtypes) as a shard
    header is checked, before any of them arrives: a name the model does not use, a shape or
    a dtype that cannot fill its target is a ConfigError naming it; so, with `complete`, is a
    parameter they leave unfilled."""
    plan = _plan_weights(model, {named: named.header()}, model.config.fp8_block, model.config.mxfp4)
    if plan.unexpected:
        raise ConfigError(f"the served model has no tensor named {', '.join(plan.unexpected[:8])}")
    if complete and plan.missing:
        raise ConfigError(f"no weights arrived for {len(plan.missing)} parameters, e.g. {', '.join(plan.missing[:8])}")
    return plan


def load_named_tensors(model: MoeForCausalLM, named: NamedTensors) -> None:
    """Overwrite every weight of `model` with tensors named as in its checkpoint (fused,
    stacked, transposed and cast as at load); checked in full before a single one is copied,
    so a ConfigError leaves the model as it was."""
    _copy_weights(model, plan_named_tensors(model, named, complete=True))


@dataclasses.dataclass
class WeightPlan:
    """What to copy: per shard, the tensor names that fill the model; for FP8 weights, where
    their block scales are, and for MXFP4 ones where their blocks and scales are (any of
    them may sit in another shard)."""

    shards: list[tuple[Path, list[str]]]
    scales: dict[str, tuple[Path, str]]
    fp8_block: tuple[int, int] | None = None
    packed: dict[str, tuple[tuple[Path, str], tuple[Path, str]]] = dataclasses.field(default_factory=dict)
    transposed: set[str] = dataclasses.field(default_factory=set)  # stored transposed in their last two dims
    unexpected: list[str] = dataclasses.field(default_factory=list)  # tensors the model does not use
    missing: list[str] = dataclasses.field(default_factory=list)  # parameters left (partly) unfilled


def _read_headers(files: list[Path]) -> dict[Path, dict[str, tuple[tuple[int, ...], str]]]:
    headers = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                headers[file] = {
                    name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()
                }
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise ConfigError(f"cannot read {file}: {exc}") from exc
    return headers


def _plan_weights(
    model: MoeForCausalLM,
    headers: dict[Path, dict[str, tuple[tuple[int, ...], str]]],
    fp8_block: tuple[int, int] | None = None,
    mxfp4: bool = False,
) -> WeightPlan:
    """Which tensors of which shard fill the model, checked from the shard headers alone:
    every shape and dtype fits, every FP8 weight has its block scales; what no parameter
    takes and what is left unfilled are listed in the plan, before a single weight is copied."""
    targets = model.weight_targets()
    # elements filled per parameter, to report anything the checkpoint left empty
    filled: dict[str, int] = {}
    named = dict(model.named_parameters(remove_duplicate=True))
    by_storage = {p.untyped_storage().data_ptr(): name for name, p in named.items()}
    # a target is a view of one parameter: they share its storage
    owners = {name: by_storage[t.untyped_storage().data_ptr()] for name, t in targets.items()}
    transposable = model.transposed_layouts()
    located = {name: (file, name) for file, header in headers.items() for name in header}
    scale_of = {name.removesuffix(quant.SCALE_SUFFIX): at for name, at in located.items() if name.endswith(quant.SCALE_SUFFIX)}
    unexpected: list[str] = []
    plan = WeightPlan(shards=[], scales={}, fp8_block=fp8_block)
    for file, header in headers.items():
        used: list[str] = []
        for name, (shape, dtype) in header.items():
            target = targets.get(name)
            if target is None and name.endswith(quant.BLOCKS_SUFFIX) and name.removesuffix(quant.BLOCKS_SUFFIX) in targets:
                base = name.removesuffix(quant.BLOCKS_SUFFIX)
                plan.packed[base] = _check_mxfp4_weight(file, name, shape, targets[base], located, headers, mxfp4)
                filled[owners[base]] = filled.get(owners[base], 0) + targets[base].numel()
                continue
            if target is None:
                # FP8 and MXFP4 scales are read with their weights
                scales_of = (name.removesuffix(quant.SCALE_SUFFIX), name.removesuffix(quant.SCALES_SUFFIX))
                if not (name.endswith(_IGNORED_SUFFIXES) or any(base in targets for base in scales_of)
                        or (name == "lm_head.weight" and model.config.tie_word_embeddings)):
                    unexpected.append(name)
                continue
            # a sharded target holds a slice: the checkpoint has the whole tensor
            if shape != checkpoint_shape(target):
                if name in transposable and shape == checkpoint_shape(transposed(target)):
                    plan.transposed.add(name)
                else:
                    raise ConfigError(f"{file.name}: tensor {name} has shape {shape}, the config implies "
                                      f"{checkpoint_shape(target)}")
            if dtype not in _FLOAT_DTYPES:
                raise ConfigError(f"{file.name}: tensor {name} has dtype {dtype}, a weight needs a floating-point one")
            if dtype in quant.FP8_DTYPES:
                plan.scales[name] = _check_fp8_weight(file, name, shape, scale_of, headers, fp8_block)
            owner = owners[name]
            filled[owner] = filled.get(owner, 0) + target.numel()
            used.append(name)
        plan.shards.append((file, used))
    if model.parallel.ep_size > 1:  # the other ranks' experts, per-expert named
        unexpected = [name for name in unexpected if ".experts." not in name]
    plan.unexpected = unexpected
    plan.missing = [name for name, p in named.items() if filled.get(name, 0) != loaded_numel(p)]
    return plan


def _check_fp8_weight(file, name, shape, scale_of, headers, fp8_block) -> tuple[Path, str]:
    if fp8_block is None:
        raise ConfigError(f"{file.name}: tensor {name} is float8 but config.json has no block-FP8 quantization_config")
    if len(shape) != 2 or name not in scale_of:
        raise ConfigError(f"{file.name}: float8 tensor {name} needs a 2-D shape and a {name}{quant.SCALE_SUFFIX} tensor")
    scale_file, scale_name = scale_of[name]
    scale_shape = headers[scale_file][scale_name][0]
    if scale_shape != quant.scale_shape(shape, fp8_block):
        raise ConfigError(
            f"{scale_file.name}: {scale_name} has shape {scale_shape}; {shape} in {fp8_block} blocks needs "
            f"{quant.scale_shape(shape, fp8_block)}"
        )
    return scale_file, scale_name


def _check_mxfp4_weight(file, name, shape, target, located, headers, mxfp4):
    base = name.removesuffix(quant.BLOCKS_SUFFIX)
    if not mxfp4:
        raise ConfigError(f"{file.name}: {name} is MXFP4-packed but config.json has no mxfp4 quantization_config")
    scales = located.get(base + quant.SCALES_SUFFIX)
    if scales is None:
        raise ConfigError(f"{file.name}: {name} has no {base}{quant.SCALES_SUFFIX} tensor")
    scales_shape = headers[scales[0]][scales[1]][0]
    if len(shape) < 3 or shape[-1] != 16 or scales_shape != shape[:-1] or quant.mxfp4_shape(shape) != checkpoint_shape(target):
        raise ConfigError(
            f"{file.name}: MXFP4 {name} {shape} with scales {scales_shape} does not unpack to {base}'s "
            f"{checkpoint_shape(target)}"
        )
    return (file, name), scales


@torch.no_grad()
def _copy_weights(model: MoeForCausalLM, plan: WeightPlan) -> None:
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def shard(file: Path | NamedTensors):
            if isinstance(file, NamedTensors):  # already in memory
                return file
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            return opened[file]

        for target, tensor in planned_reads(model, plan, shard):
            target.copy_(tensor)


def planned_reads(model: MoeForCausalLM, plan: WeightPlan, shard: Callable[[Any], Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(target, the tensor this rank reads for it) of every planned weight; `shard` opens a plan's file."""
    targets = model.weight_targets()
    # each target reads only its shard of the tensor (all of it at size 1)
    for file, names in tqdm(plan.shards, desc="Loading safetensors shards", unit="shard"):
        for name in names:
            target = targets[name]
            splits = shard_of(transposed(target) if name in plan.transposed else target)
            if name in plan.scales:
                scale_file, scale_name = plan.scales[name]
                tensor = read_fp8(shard(file), name, shard(scale_file), scale_name, plan.fp8_block, splits)
            else:
                tensor = read_tensor(shard(file), name, splits)
            yield target, (tensor.transpose(-1, -2) if name in plan.transposed else tensor)
    for base, ((blocks_file, blocks), (scales_file, scales)) in plan.packed.items():
        target = targets[base]
        yield target, read_mxfp4(shard(blocks_file), blocks, shard(scales_file), scales, shard_of(target))

"""Quantized checkpoints as released: block FP8 (MiniMax-M2, DeepSeek-V3) and MXFP4 (gpt-oss),
dequantized at load exactly, or refused clearly."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from r3srv.errors import ConfigError
from r3srv.models.loader import load_model
from model_testing import prefill
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers oracles

pytest.importorskip("transformers")

PROMPT = [72, 101, 108, 108, 111, 33, 10, 200, 7, 9]
FP8_MAX = 448.0  # largest finite float8 e4m3fn


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    """What released FP8 checkpoints quantize: attention and expert projections (not norms,
    embeddings, lm_head or the router)."""
    return tensor.dim() == 2 and name.endswith("weight") and ("_proj" in name or ".experts." in name)


def _quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    scales = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (tile / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def _dequantize_by_tiles(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The definition, tile by tile (the loader does it with broadcasting)."""
    out = torch.empty(q.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].float() * scales[i, j]
    return out


def _write_fp8(src, dst, block, *, split_scales=False, edit=None):
    """Copy checkpoint `src` to `dst` with its projections block-quantized; returns the
    dequantized float32 tensors (the weights an exact loader must end up with)."""
    dst.mkdir()
    for extra in src.iterdir():
        if extra.suffix != ".safetensors":
            (dst / extra.name).write_bytes(extra.read_bytes())
    weights, scales, expected = {}, {}, {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _quantizable(name, tensor):
            q, s = _quantize(tensor, block)
            weights[name], scales[name + "_scale_inv"] = q, s
            expected[name] = _dequantize_by_tiles(q, s, block)
        else:
            weights[name] = expected[name] = tensor
    if edit:
        edit(weights, scales)
    if split_scales:  # scales in a shard of their own, found through the index
        save_file(weights, str(dst / "model-00001-of-00002.safetensors"))
        save_file(scales, str(dst / "model-00002-of-00002.safetensors"))
        weight_map = {n: "model-00001-of-00002.safetensors" for n in weights}
        weight_map.update({n: "model-00002-of-00002.safetensors" for n in scales})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file({**weights, **scales}, str(dst / "model.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(raw))
    return expected


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src") / "minimax", "minimax_m2", seed=6)


# (8, 8) divides every tiny shape; (8, 12) and (5, 7) leave partial tiles at the edges
@pytest.mark.parametrize("block", [(8, 8), (8, 12), (5, 7)])
@pytest.mark.parametrize("split_scales", [False, True])
def test_fp8_weights_are_dequantized_exactly(source, tmp_path, block, split_scales):
    expected = _write_fp8(source, tmp_path / "fp8", block, split_scales=split_scales)
    model, _ = load_model(tmp_path / "fp8")
    assert model.config.fp8_block == block
    targets = model.weight_targets()
    quantized = [n for n in expected if n + "_scale_inv" in load_file_names(tmp_path / "fp8")]
    assert len(quantized) > 20  # attention and every expert's projections
    for name, want in expected.items():
        if name in targets:
            assert torch.equal(targets[name], want.to(targets[name].dtype)), name
    # and the forward equals one of an unquantized checkpoint holding the same values
    plain = tmp_path / "plain"
    plain.mkdir()
    for extra in (tmp_path / "fp8").iterdir():
        if extra.suffix == ".json" and extra.name != "model.safetensors.index.json":
            (plain / extra.name).write_bytes(extra.read_bytes())
    raw = json.loads((plain / "config.json").read_text())
    del raw["quantization_config"]
    (plain / "config.json").write_text(json.dumps(raw))
    (plain / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    save_file(expected, str(plain / "model.safetensors"))
    logits, rows = prefill(model, PROMPT, all_logits=True)
    want_logits, want_rows = prefill(load_model(plain)[0], PROMPT, all_logits=True)
    assert torch.equal(logits, want_logits) and torch.equal(rows, want_rows)


def load_file_names(path) -> set[str]:
    names = set()
    for file in path.glob("*.safetensors"):
        names |= set(load_file(str(file)))
    return names


def test_a_missing_scale_is_a_config_error(source, tmp_path):
    def drop_one(weights, scales):
        scales.pop(next(iter(scales)))

    _write_fp8(source, tmp_path / "fp8", (8, 8), edit=drop_one)
    with pytest.raises(ConfigError, match="_scale_inv"):
        load_model(tmp_path / "fp8")


def test_a_misshapen_scale_is_a_config_error(source, tmp_path):
    def widen(weights, scales):
        name = next(iter(scales))
        scales[name] = torch.ones(scales[name].shape[0], scales[name].shape[1] + 1)

    _write_fp8(source, tmp_path / "fp8", (8, 8), edit=widen)
    with pytest.raises(ConfigError, match="blocks needs"):
        load_model(tmp_path / "fp8")


def test_fp8_tensors_without_a_quantization_config_are_refused(source, tmp_path):
    _write_fp8(source, tmp_path / "fp8", (8, 8))
    raw = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del raw["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="no block-FP8 quantization_config"):
        load_model(tmp_path / "fp8")


@pytest.mark.parametrize(
    "quant",
    [{"quant_method": "awq", "bits": 4}, {"quant_method": "fp8"}, {"quant_method": "fp8", "fmt": "e5m2",
                                                                   "weight_block_size": [128, 128]}],
)
def test_other_quantizations_are_refused_at_start_up(source, tmp_path, quant):
    _write_fp8(source, tmp_path / "fp8", (8, 8))
    raw = json.loads((tmp_path / "fp8" / "config.json").read_text())
    raw["quantization_config"] = quant
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="not supported"):
        load_model(tmp_path / "fp8")


# ---------------------------------------------------------------- MXFP4 (gpt-oss)


def _write_mxfp4(tmp_path, *, drop_scales=False, quant_config=True):
    """A tiny gpt-oss whose experts are random MXFP4 blocks and scales; returns (path, the
    float32 expert tensors transformers' own dequantization gives, by parameter name)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = write_tiny_checkpoint(tmp_path / "src", "gpt_oss", seed=8, intermediate_size=32)  # 32-value groups
    dst = tmp_path / "mxfp4"
    dst.mkdir()
    for extra in src.iterdir():
        if extra.suffix != ".safetensors":
            (dst / extra.name).write_bytes(extra.read_bytes())
    gen = torch.Generator().manual_seed(8)
    tensors, expected = {}, {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor
            continue
        experts, cols, rows = tensor.shape  # transformers keeps x @ W: [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 130, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
        tensors[name + "_blocks"] = blocks
        if not drop_scales:
            tensors[name + "_scales"] = scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert expected[name].shape == tensor.shape
    save_file(tensors, str(dst / "model.safetensors"))
    if quant_config:
        raw = json.loads((dst / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
        (dst / "config.json").write_text(json.dumps(raw))
    return dst, tensors, expected


def test_mxfp4_experts_match_transformers_dequantization(tmp_path):
    path, tensors, expected = _write_mxfp4(tmp_path)
    model, _ = load_model(path)
    assert model.config.mxfp4
    targets = model.weight_targets()
    assert len(expected) == 2 * model.config.num_layers
    for name, want in expected.items():
        assert torch.equal(targets[name], want), name
    # and the forward equals one of an unquantized checkpoint holding the same values
    plain = tmp_path / "plain"
    plain.mkdir()
    for extra in path.iterdir():
        if extra.suffix != ".safetensors":
            (plain / extra.name).write_bytes(extra.read_bytes())
    raw = json.loads((plain / "config.json").read_text())
    del raw["quantization_config"]
    (plain / "config.json").write_text(json.dumps(raw))
    dense = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    save_file({**dense, **{k: v.contiguous() for k, v in expected.items()}}, str(plain / "model.safetensors"))
    logits, rows = prefill(model, PROMPT, all_logits=True)
    want_logits, want_rows = prefill(load_model(plain)[0], PROMPT, all_logits=True)
    assert torch.equal(logits, want_logits) and torch.equal(rows, want_rows)


def test_mxfp4_without_scales_or_config_is_a_config_error(tmp_path):
    path, _, _ = _write_mxfp4(tmp_path / "a", drop_scales=True)
    with pytest.raises(ConfigError, match="_scales"):
        load_model(path)
    path, _, _ = _write_mxfp4(tmp_path / "b", quant_config=False)
    with pytest.raises(ConfigError, match="no mxfp4 quantization_config"):
        load_model(path)

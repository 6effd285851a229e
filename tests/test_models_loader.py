"""Loader and config parsing: key spellings, shards, fused expert names, dtypes and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from r3srv.errors import ConfigError
from r3srv.models.config import ModelConfig
from r3srv.models.loader import SUPPORTED_ARCHITECTURES, load_model
from model_testing import prefill
from tiny_checkpoints import FAMILIES, build_hf_model, write_tiny_checkpoint

PROMPT = [72, 101, 108, 108, 111, 33, 10, 200]


def prefill_logits(model) -> torch.Tensor:
    return prefill(model, PROMPT)[0]


def _edit_config(path, edit) -> None:
    file = path / "config.json"
    raw = json.loads(file.read_text())
    edit(raw)
    file.write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    return {family: write_tiny_checkpoint(root / family, family, seed=5) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_old_and_new_config_keys_give_the_same_model(family, checkpoints, tmp_path):
    new_style = checkpoints[family]
    old_style = tmp_path / "old"
    shutil.copytree(new_style, old_style)

    def to_old_keys(outer):
        raw = outer.get("text_config", outer)  # Qwen3-VL: the language model's keys are nested
        if family == "nemotron_h":  # no positions; the layer list as the released pattern letters
            letters = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
            raw["hybrid_override_pattern"] = "".join(letters[k] for k in raw.pop("layers_block_type"))
            raw["mamba_n_groups"], raw["mamba_d_conv"] = raw.pop("n_groups"), raw.pop("conv_kernel")
            raw["rope_parameters"] = {"rope_theta": 10000.0}
        if family == "kimi_linear":  # no positions; the released linear_attn_config (1-indexed layers)
            kinds = raw.pop("layer_types")
            raw["linear_attn_config"] = {
                "kda_layers": [i + 1 for i, t in enumerate(kinds) if t == "linear_attention"],
                "full_attn_layers": [i + 1 for i, t in enumerate(kinds) if t == "full_attention"],
                "num_heads": raw.pop("linear_num_heads"), "head_dim": raw.pop("linear_head_dim"),
                "short_conv_kernel_size": raw.pop("linear_conv_kernel_dim")}
            raw["rope_parameters"] = {"rope_theta": 10000.0}
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:  # GLM-4.5's released config.json keeps it top level
            raw["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        if rope.get("rope_type", "default") != "default":  # YaRN (gpt-oss): the old rope_scaling dict
            raw["rope_scaling"] = rope
        if "num_local_experts" in raw:  # swap whichever spelling transformers wrote
            raw["num_experts"] = raw.pop("num_local_experts")
        elif "n_routed_experts" in raw:  # GLM-4.5 / DeepSeek spelling
            raw["num_local_experts"] = raw.pop("n_routed_experts")
        elif "moe_num_experts" in raw:  # ERNIE-4.5 spelling
            raw["num_local_experts"] = raw.pop("moe_num_experts")
        else:
            raw["num_local_experts"] = raw.pop("num_experts")
        outer["torch_dtype"] = outer.pop("dtype")

    _edit_config(old_style, to_old_keys)
    new_cfg, old_cfg = ModelConfig.from_dir(new_style), ModelConfig.from_dir(old_style)
    assert new_cfg.rope.theta == old_cfg.rope.theta and new_cfg.rope.theta > 0
    assert new_cfg.num_experts == old_cfg.num_experts == 8
    assert new_cfg.torch_dtype == old_cfg.torch_dtype == torch.float32
    assert new_cfg.model_type == family and new_cfg.moe_layers == old_cfg.moe_layers
    assert new_cfg.moe_layers == ([1, 3] if family == "nemotron_h" else [0, 1])
    assert new_cfg.layer_kinds == old_cfg.layer_kinds and new_cfg.linear == old_cfg.linear  # Mamba-2 groups, head dims
    assert new_cfg.linear_attention_layers == old_cfg.linear_attention_layers
    assert new_cfg.eos_token_ids == [258]
    torch.testing.assert_close(prefill_logits(load_model(old_style)[0]), prefill_logits(load_model(new_style)[0]))


def test_top_level_partial_rotary_factor_is_read(checkpoints, tmp_path):
    # GLM-4.5's released configs: partial_rotary_factor next to rope_theta, no rope_parameters
    base = ModelConfig.from_dir(checkpoints["glm4_moe"])
    assert base.rope.partial_factor == 0.5 and base.rotary_dim == base.head_dim // 2
    full = tmp_path / "full_rotary"
    shutil.copytree(checkpoints["glm4_moe"], full)

    def to_full_rotary(raw):
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
        raw["partial_rotary_factor"] = 1.0

    _edit_config(full, to_full_rotary)
    assert ModelConfig.from_dir(full).rotary_dim == base.head_dim
    logits = prefill_logits(load_model(checkpoints["glm4_moe"])[0])
    assert not torch.allclose(prefill_logits(load_model(full)[0]), logits, atol=1e-3)


def test_rope_theta_changes_the_model(checkpoints, tmp_path):
    # guards the previous test: the key it moves is really read
    other = tmp_path / "theta"
    shutil.copytree(checkpoints["qwen3_moe"], other)
    _edit_config(other, lambda raw: raw.__setitem__("rope_parameters", {"rope_theta": 3.0, "rope_type": "default"}))
    base = prefill_logits(load_model(checkpoints["qwen3_moe"])[0])
    assert not torch.allclose(prefill_logits(load_model(other)[0]), base, atol=1e-3)


def test_sharded_and_single_file_checkpoints_load_identically(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "single", "qwen2_moe", seed=2)
    sharded = write_tiny_checkpoint(tmp_path / "sharded", "qwen2_moe", seed=2, max_shard_size="30KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    torch.testing.assert_close(prefill_logits(load_model(sharded)[0]), prefill_logits(load_model(single)[0]))


def test_fused_expert_tensor_names_load_like_per_expert_names(checkpoints, tmp_path):
    # transformers 5 keeps experts fused in memory ([E, 2I, H] gate_up_proj); accept that layout too
    hf = build_hf_model("mixtral", seed=5)
    fused = tmp_path / "fused"
    shutil.copytree(checkpoints["mixtral"], fused)
    (fused / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    keys = load_file(str(fused / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    torch.testing.assert_close(prefill_logits(load_model(fused)[0]), prefill_logits(load_model(checkpoints["mixtral"])[0]))


def test_unsupported_architecture_lists_the_supported_ones(checkpoints, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(checkpoints["qwen3_moe"], path)
    _edit_config(path, lambda raw: raw.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(ConfigError) as err:
        load_model(path)
    message = str(err.value)
    assert "LlamaForCausalLM" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    assert set(SUPPORTED_ARCHITECTURES) == {
        "Glm4vMoeForConditionalGeneration",  # GLM-4.5V's language model (images: docs/vision.md)
        "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Glm4MoeForCausalLM",
        "MiniMaxM2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "GptOssForCausalLM",
        "Ernie4_5_MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Dots1ForCausalLM", "Qwen3NextForCausalLM",
        "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
        "NemotronHForCausalLM", "KimiLinearForCausalLM", "GraniteMoeHybridForCausalLM",
        "AfmoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "Lfm2MoeForCausalLM",
        "Qwen3VLMoeForConditionalGeneration", "GraniteMoeSWAForCausalLM", "FlexOlmoForCausalLM",
    }


def test_missing_and_misshapen_weights_are_config_errors(checkpoints, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(checkpoints["olmoe"], path)
    tensors = load_file(str(path / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match="lacks weights"):
        load_model(path)
    misshapen = dict(tensors)
    misshapen["model.layers.0.self_attn.q_norm.weight"] = torch.ones(5)
    save_file(misshapen, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"q_norm.weight has shape \(5,\)"):
        load_model(path)


def test_bad_paths_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a directory.*never downloads"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)


def test_dtype_choice_and_missing_tokenizer(tmp_path, capfd):
    path = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_moe", tokenizer=False)
    capfd.readouterr()
    model, tokenizer = load_model(path)
    assert "Loading safetensors shards" in capfd.readouterr().err  # the progress bar
    assert tokenizer is None and model.dtype == torch.float32  # "auto" is float32 on the CPU
    model, _ = load_model(path, dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    assert prefill_logits(model).dtype == torch.float32
    with pytest.raises(ConfigError, match="unsupported dtype"):
        load_model(path, dtype="int8")


def test_generation_config_eos_ids_are_merged(checkpoints, tmp_path):
    path = tmp_path / "eos"
    shutil.copytree(checkpoints["qwen2_moe"], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))
    model, tokenizer = load_model(path)
    assert model.config.eos_token_ids == [258, 256]
    assert tokenizer.eos_token_id == 258


def test_sliding_windows_follow_each_familys_rule(checkpoints, tmp_path):
    """The window no longer caps the context: it masks, by transformers' rule per family
    (logits against transformers: the *_sliding_window variants in tests/families/)."""
    path = tmp_path / "swa"
    shutil.copytree(checkpoints["mixtral"], path)
    _edit_config(path, lambda raw: raw.update(sliding_window=64, max_position_embeddings=512))
    cfg = ModelConfig.from_dir(path)
    assert cfg.max_position_embeddings == 512 and cfg.attention.sliding_windows == [64, 64]  # Mixtral: every layer
    _edit_config(path, lambda raw: raw.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                                              num_experts=8, moe_intermediate_size=16, use_sliding_window=False))
    assert ModelConfig.from_dir(path).attention.sliding_windows is None  # a window that is switched off
    _edit_config(path, lambda raw: raw.update(use_sliding_window=True, max_window_layers=2, num_hidden_layers=2,
                                              layer_types=None))
    assert ModelConfig.from_dir(path).attention.sliding_windows == [64, None]  # Qwen2-MoE: even layers below max_window_layers
    # the rule for configs without layer_types, against transformers' own
    transformers = pytest.importorskip("transformers")
    raw = json.loads((path / "config.json").read_text())
    for layers, start in ((5, 3), (6, 6), (4, 0)):
        hf = transformers.Qwen2MoeConfig(num_hidden_layers=layers, use_sliding_window=True, sliding_window=64,
                                         max_window_layers=start)
        want = [64 if kind == "sliding_attention" else None for kind in hf.layer_types]
        ours = ModelConfig.from_dict({**raw, "num_hidden_layers": layers, "max_window_layers": start, "layer_types": None})
        assert (ours.attention.sliding_windows or [None] * layers) == want, (layers, start)

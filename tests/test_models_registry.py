"""The family registry (models/families/): every architecture maps to one module, each module
has its oracle test module (tests/families/), shared code never switches on a family's name, and
docs/models.md's templates are a working family and a test module of the expected shape."""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import torch

import family_oracle
import tiny_checkpoints
from r3srv.models import families
from r3srv.models.config import ModelConfig
from r3srv.models.model import MoeForCausalLM

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "python" / "r3srv"
BUILDER_SHAPE = ("num_experts", "top_k", "num_layers")


def test_each_module_is_one_family_and_each_architecture_has_one():
    modules = sorted(p.stem for p in (MODELS / "models" / "families").glob("*.py") if not p.stem.startswith("_"))
    assert sorted(families.FAMILIES) == modules and len(modules) == 26
    listed = [arch for family in families.FAMILIES.values() for arch in family.architectures]
    assert len(listed) == len(set(listed)) == len(families.SUPPORTED_ARCHITECTURES)


def test_each_family_has_one_oracle_test_module_and_each_test_module_a_family():
    tested = sorted(p.stem.removeprefix("test_") for p in (ROOT / "tests" / "families").glob("test_*.py"))
    assert tested == sorted(families.FAMILIES) == list(tiny_checkpoints.FAMILIES)
    for name in tested:
        _assert_is_a_family_test(importlib.import_module(f"families.test_{name}"))


def _assert_is_a_family_test(module):
    """A tiny config builder as tiny_checkpoints.hf_config calls it, at least one variant, and
    the shared oracle checks run on them."""
    assert list(inspect.signature(module.tiny_config).parameters) == ["transformers", *BUILDER_SHAPE], module.__name__
    assert module.VARIANTS and all(isinstance(overrides, dict) for overrides in module.VARIANTS.values())
    for check in family_oracle.__all__:
        assert getattr(module, check) is getattr(family_oracle, check), (module.__name__, check)


def test_no_family_name_outside_the_family_modules():
    names = "|".join(map(re.escape, families.FAMILIES))
    quoted = re.compile(rf"[\"']({names})[\"']")
    offenders = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in MODELS.rglob("*.py")
        # the built-in model writes a config.json; tool-call and reasoning parsers are named as vLLM names
        # them, and some of those names are spelled like a family ("deepseek_v3")
        if "families" not in path.parts and "tool_calls" not in path.parts and path.name != "builtin.py"
        for match in quoted.finditer(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def _docs_template(block: int, name: str) -> types.ModuleType:
    """docs/models.md's `block`-th python block (0: the family template, 1: its test module), run as `name`."""
    code = (ROOT / "docs" / "models.md").read_text(encoding="utf-8").split("```python\n")[1 + block].split("```")[0]
    module = types.ModuleType(name)
    exec(compile(code, "docs/models.md", "exec"), module.__dict__)
    return module


def test_the_docs_test_template_is_a_family_test_module():
    _assert_is_a_family_test(_docs_template(1, "test_foo_moe"))


def test_the_docs_template_is_a_working_family(monkeypatch):
    family = _docs_template(0, "foo_moe").FAMILY
    raw = {"architectures": ["FooMoeForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
           "moe_intermediate_size": 16, "vocab_size": 64}
    monkeypatch.setitem(families.FAMILIES, family.name, family)  # as the registry would find it
    monkeypatch.setitem(families._BY_ARCHITECTURE, "FooMoeForCausalLM", family)
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.model_type, cfg.router.scoring, cfg.router.correction_bias, cfg.attention.qk_norm) == (
        "foo_moe", "sigmoid", True, "head")
    targets = MoeForCausalLM(cfg, dtype=torch.float32).weight_targets()
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in targets
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in targets

"""LoRA adapters against PEFT + transformers on tiny checkpoints of several families (a plain
MoE, one with a shared expert, MLA, a hybrid): adapters on attention, dense and shared-expert
projections and the routed experts, alone and mixed in one batch with other adapters and the
base model; every layout trainers export; more adapters than slots; replacement in memory; the
prefix cache per adapter; bad adapters refused with the previous one kept."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_testing import fused_calls, model_of  # noqa: F401 (a fixture)
from lora_testing import (
    assert_matches,
    peft_reference,
    prompt,
    write_adapter,
    write_checkpoint,
    write_layout,
)

from r3srv import LLM, SamplingParams
from r3srv.errors import InvalidRequestError
from r3srv.lora import adapter as adapters

pytestmark = pytest.mark.slow  # transformers + PEFT oracles, engines on tiny checkpoints

MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)


def engine(ckpt, **options) -> LLM:
    return LLM(str(ckpt), enable_lora=True, max_model_len=96, num_kv_blocks=64, block_size=8, **options)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "qwen3_next"])
def test_adapters_alone_and_mixed_match_peft(family, tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    a1 = write_adapter(tmp_path / "a1", family, seed=1)
    a2 = write_adapter(tmp_path / "a2", family, seed=2, rank=8, alpha=4)
    llm = engine(ckpt, max_loras=2)
    llm.load_lora_adapter("a1", str(a1))
    llm.load_lora_adapter("a2", str(a2))
    prompts = [prompt(11, 7), prompt(11, 7), prompt(9, 8), prompt(13, 9)]
    names = ["a1", None, "a2", "a1"]
    paths = {"a1": a1, "a2": a2, None: None}
    refs = [peft_reference(family, paths[n], p, MAX_TOKENS) for p, n in zip(prompts, names)]
    assert refs[0].tokens != refs[1].tokens  # the adapter changes what the model says
    mixed = llm.generate(prompts, GREEDY, lora_name=names)  # one batch: both adapters and the base
    for out, ref in zip(mixed, refs):
        assert_matches(out, ref)
    alone = llm.generate([prompts[2]], GREEDY, lora_name="a2")
    assert_matches(alone[0], refs[2])


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_expert_layouts_match_the_peft_adapter(layout, tmp_path):
    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    src = write_adapter(tmp_path / "peft", family, seed=3)
    llm = engine(ckpt, max_loras=1, max_lora_rank=8)
    llm.load_lora_adapter("x", str(write_layout(src, tmp_path / layout, layout)))
    p = prompt(10, 11)
    assert_matches(llm.generate([p], GREEDY, lora_name="x")[0], peft_reference(family, src, p, MAX_TOKENS))


def test_shared_outer_expert_lora(tmp_path):
    """SGLang's shared-outer form: gate_up's A and down's B one tensor for every expert."""
    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    src = write_adapter(tmp_path / "peft", family, seed=4, shared_outer=True)
    stacked = write_layout(src, tmp_path / "stacked", "stacked")
    a = adapters.read_dir(stacked)
    shared = {t: (p.a.shape[0], p.b.shape[0]) for t, p in a.pairs.items() if "experts" in t}
    assert shared["model.layers.0.mlp.experts.gate_up_proj"][0] == 1  # A shared
    assert shared["model.layers.0.mlp.experts.down_proj"][1] == 1  # B shared
    llm = engine(ckpt)
    llm.load_lora_adapter("s", str(stacked))
    p = prompt(10, 12)
    assert_matches(llm.generate([p], GREEDY, lora_name="s")[0], peft_reference(family, src, p, MAX_TOKENS))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "overlapped"])
def test_more_adapters_than_slots_swap_by_use(tmp_path, async_scheduling):
    """One slot for three adapters (and the base) in one generate call: slots swap between steps,
    from host memory or the directory again. Overlapped, a slot is swapped while the previous
    step may still run on the device thread: the step keeps its adapters' slots until done."""
    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    paths = {f"a{i}": write_adapter(tmp_path / f"a{i}", family, seed=10 + i) for i in range(3)}
    llm = engine(ckpt, max_loras=1, max_cpu_loras=2, async_scheduling=async_scheduling)
    for name, path in paths.items():
        llm.load_lora_adapter(name, str(path))
    manager = llm.engine.core.lora
    assert sum(e.adapter is not None for e in manager.entries.values()) == 2  # one given back to its directory
    names = ["a0", "a1", "a2", None, "a1", "a0"]
    prompts = [prompt(9, 20 + i) for i in range(len(names))]
    outs = llm.generate(prompts, GREEDY, lora_name=names)  # one slot: the scheduler runs one adapter at a time
    for out, p, name in zip(outs, prompts, names):
        assert_matches(out, peft_reference(family, paths.get(name), p, MAX_TOKENS))
    assert len(manager.resident()) == 1


def test_a_step_in_flight_keeps_its_adapters_slots(tmp_path):
    """Overlapped scheduling's rule in the manager: an adapter of the step still on the device is
    not evicted under it; a free slot is taken instead, and with none the step is waited for."""
    from types import SimpleNamespace

    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    llm = engine(ckpt, max_loras=2)
    for i in range(3):
        llm.load_lora_adapter(f"a{i}", str(write_adapter(tmp_path / f"a{i}", family, seed=20 + i)))
    manager = llm.engine.core.lora
    seq = {name: SimpleNamespace(lora=manager.ref(name), lora_slot=-1) for name in ("a0", "a1", "a2")}
    waits = []
    manager.assign([seq["a0"]])
    manager.assign([seq["a1"]], in_flight=[seq["a0"]], wait=lambda: waits.append(1))
    assert manager.resident() == {"a0": seq["a0"].lora_slot, "a1": seq["a1"].lora_slot} and waits == []
    # a2 needs a slot; a0's is the least recently used, but a0 runs in the step in flight
    manager.assign([seq["a2"]], in_flight=[seq["a0"]], wait=lambda: waits.append(manager.resident()))
    assert manager.resident() == {"a0": seq["a0"].lora_slot, "a2": seq["a2"].lora_slot} and waits == []
    # both slots held by the step in flight: it is waited for before one is rewritten
    manager.assign([seq["a1"]], in_flight=[seq["a0"], seq["a2"]], wait=lambda: waits.append(dict(manager.resident())))
    assert waits == [{"a0": seq["a0"].lora_slot, "a2": seq["a2"].lora_slot}]
    assert "a1" in manager.resident()


def test_replacing_an_adapter_in_memory_and_the_prefix_cache(tmp_path):
    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    a1, a2 = write_adapter(tmp_path / "a1", family, seed=1), write_adapter(tmp_path / "a2", family, seed=2)
    llm = engine(ckpt, max_loras=2)
    llm.load_lora_adapter("p", str(a1))
    llm.load_lora_adapter("q", str(a2))
    core = llm.engine.core
    long = prompt(33, 5)  # four full blocks of 8

    def hits(name):
        before = core.block_manager.prefix_cache_hits
        out = llm.generate([long], GREEDY, lora_name=name)[0]
        return core.block_manager.prefix_cache_hits - before, out

    assert hits("p")[0] == 0
    assert hits("p")[0] == 32  # the same adapter: its own blocks
    assert hits("q")[0] == 0  # never another adapter's
    assert hits(None)[0] == 0  # nor the base model's
    assert hits(None)[0] == 32
    # the trainer's push: the adapter "p" replaced in memory by a2's tensors (PEFT's config and save)
    config, tensors = adapters.read_dir(a2).config, _peft_tensors(a2)
    pushed = adapters.from_tensors(config, tensors, param="serialized_named_tensors")
    ref = llm.load_lora_adapter("p", adapter=pushed)
    assert ref.version == 2
    dropped, out = hits("p")
    assert dropped == 0  # version 1's blocks are gone
    assert_matches(out, peft_reference(family, a2, long, MAX_TOKENS))
    assert hits("p")[0] == 32
    assert hits(None)[0] == 32  # the base model's blocks stayed


def _peft_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_bad_adapters_are_refused_and_the_previous_one_kept(tmp_path):
    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    good = write_adapter(tmp_path / "good", family, seed=1)
    llm = engine(ckpt, max_loras=1, max_lora_rank=8)
    llm.load_lora_adapter("a", str(good))
    p = prompt(9, 3)
    before = llm.generate([p], GREEDY, lora_name="a")[0].outputs[0].token_ids

    def refused(path, param="lora_path", match=None):
        with pytest.raises(InvalidRequestError, match=match) as info:
            llm.load_lora_adapter("a", str(path))
        assert info.value.param == param
        assert llm.generate([p], GREEDY, lora_name="a")[0].outputs[0].token_ids == before

    refused(write_adapter(tmp_path / "big", family, seed=2, rank=16), match="rank 16 exceeds")
    lacking = shutil.copytree(good, tmp_path / "lacking")
    from safetensors.torch import load_file, save_file

    t = load_file(str(lacking / "adapter_model.safetensors"))
    t = {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}
    save_file(t, str(lacking / "adapter_model.safetensors"))
    refused(lacking, match="layers.7.*does not have")
    wrong = shutil.copytree(good, tmp_path / "wrong")
    t = load_file(str(wrong / "adapter_model.safetensors"))
    key = next(k for k in t if k.endswith("q_proj.lora_B.weight"))
    t[key] = torch.zeros(t[key].shape[0] + 2, t[key].shape[1])
    save_file(t, str(wrong / "adapter_model.safetensors"))
    refused(wrong, match="do not fit")
    corrupt = shutil.copytree(good, tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(corrupt, match="cannot read")
    refused(tmp_path / "missing", match="not a directory")
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([p], GREEDY, lora_name="nope")
    assert info.value.param == "lora_name"
    assert llm.engine.core.block_manager.num_used_blocks == 0  # nothing leaked


def test_lora_needs_the_flag_and_refuses_what_it_cannot_do(tmp_path):
    from r3srv.errors import ConfigError

    ckpt = write_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    llm = LLM(str(ckpt), max_model_len=64, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        llm.generate([prompt(5, 1)], GREEDY, lora_name="a")
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LLM(str(ckpt), enable_lora=True, max_loras=3, max_cpu_loras=2)


def test_decode_steps_take_the_fused_decode_step_with_and_without_adapters(tmp_path, fused_calls):
    """--enable-lora keeps the CPU backend's fused decode step (ops/cpu_decode.py) for every layer:
    every decode step takes it, those in which no token has an adapter and those mixing an
    adapter (on attention and the experts) with the base model: PEFT's tokens, logprobs and rows
    either way."""
    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    path = write_adapter(tmp_path / "a", family, seed=5)
    llm = engine(ckpt, max_loras=1, enable_prefix_caching=False)
    model = model_of(llm)
    assert model.fused_layers and all(layer.fused is not None for layer in model.layers)
    llm.load_lora_adapter("a", str(path))
    p = prompt(9, 30)
    base = peft_reference(family, None, p, MAX_TOKENS)
    assert_matches(llm.generate([p], GREEDY)[0], base)
    assert len(fused_calls) == (MAX_TOKENS - 1) * len(model.layers)  # every decode step, every layer
    fused_calls.clear()
    adapted, plain = llm.generate([p, p], GREEDY, lora_name=["a", None])  # every step has an adapter
    assert len(fused_calls) == (MAX_TOKENS - 1) * len(model.layers)
    ref = peft_reference(family, path, p, MAX_TOKENS)
    assert ref.tokens != base.tokens
    assert_matches(adapted, ref)
    assert_matches(plain, base)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("form", ["module", "parameter"])
def test_an_adapter_on_the_router_gate_moves_the_rows_as_peft_does(family, form, tmp_path):
    """An adapter on the router gate alone (PEFT's target_modules=["gate"], or its parameter
    wrapper target_parameters=["mlp.gate.weight"]): the adapted router picks other experts than
    the base's, and r3srv's rows are PEFT's, alone and beside the base model in one batch."""
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    targeting = dict(targets=["gate"]) if form == "module" else dict(targets=[], parameters=["mlp.gate.weight"])
    path = write_adapter(tmp_path / "g", family, seed=6, experts=False, **targeting)
    assert {t.rpartition(".")[0].rpartition(".")[2] for t in adapters.read_dir(path).targets} == {"gate"}
    llm = engine(ckpt, max_loras=1)
    llm.load_lora_adapter("g", str(path))
    p = prompt(12, 40)
    ref, base = peft_reference(family, path, p, MAX_TOKENS), peft_reference(family, None, p, MAX_TOKENS)
    assert (ref.rows != base.rows).any()  # the adapted router routes otherwise
    adapted, plain = llm.generate([p, p], GREEDY, lora_name=["g", None])
    assert_matches(adapted, ref)
    assert_matches(plain, base)

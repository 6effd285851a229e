"""The CPU backend's fused decode step (r3srv.ops.cpu_decode): a plain MoE layer's decode step as
straight kernel calls gives the modules' tokens, logprobs and routed experts bit for bit, on
generated prompts, greedy and sampled, at one and two threads, in float32 and bfloat16; it runs at decode steps only,
only where the settings turn every kernel it calls on, and only for layers whose parts it
computes: anything else a layer hands it (a window, a part of a projection it does not know)
makes it decline when the model is built, naming the part. Adapter slots it computes as the
modules do: steps mixing adapters on attention, the router gate and the experts (per expert and
shared-outer) with the base model give the modules' bits too (PEFT as the oracle of both:
tests/test_lora.py)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_testing import fused_calls, model_of, one_torch_thread, rebound  # noqa: F401 (fixtures)
from lora_testing import write_adapter, write_checkpoint
from r3srv import LLM, SamplingParams, settings
from r3srv.kernels import linear_cpu
from r3srv.kernels.packed_weights import packs
from r3srv.models.moe import Mlp
from r3srv.models.parallel import ColumnParallelLinear, Piece
from r3srv.ops import cpu_decode, ops_for
from r3srv.ops.cpu_decode import DecodeStep
from r3srv.ops.parts import LinearParts


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8, enable_return_routed_experts=True)


def generated_requests(seed: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts of 1-120 random byte tokens, half greedy and half sampled with their own seeds,
    all with logprobs."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, int(rng.integers(1, 121))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(2, 24)), ignore_eos=True, logprobs=3,
                             temperature=0.0 if i % 2 == 0 else 0.9, seed=None if i % 2 == 0 else int(rng.integers(1 << 30)))
              for i in range(n)]
    return prompts, params


def outputs(llm, prompts, params, lora_names=None) -> list:
    results = llm.generate(prompts, params, lora_name=lora_names)
    return [(o.outputs[0].token_ids, o.outputs[0].routed_experts,
             list(o.outputs[0].logprobs))
            for o in results]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_bits_as_the_modules(llm, fused_calls, threads, seed):
    assert_the_modules_bits(llm, fused_calls, threads, seed, 10)


def assert_the_modules_bits(llm, fused_calls, threads: int, seed: int, n: int, lora_names=None,
                            layout=(4, 8)) -> None:
    """n generated requests (under `lora_names`, one adapter name or None each) give the same
    tokens, rows and logprobs with the fused step (which runs whole steps, every layer) as with
    the modules."""
    prompts, params = generated_requests(seed, n)
    model = model_of(llm)
    with rebound(model, cpu_threads=threads, fast_cpu_decode=True):
        assert all(layer.fused is not None for layer in model.layers)
        fused = outputs(llm, prompts, params, lora_names)
    assert fused_calls and len(fused_calls) % len(model.layers) == 0  # whole steps, every layer
    fused_calls.clear()
    with rebound(model, cpu_threads=threads, fast_cpu_decode=False):
        modules = outputs(llm, prompts, params, lora_names)
    assert not fused_calls
    for (tokens, rows, logprobs), (want_tokens, want_rows, want_logprobs) in zip(fused, modules):
        assert tokens == want_tokens
        assert rows is not None and rows.shape[1:] == want_rows.shape[1:] == layout
        np.testing.assert_array_equal(rows, want_rows)
        assert logprobs == want_logprobs  # the same logits, bit for bit


@pytest.mark.parametrize("float32_gate", [False, True])
def test_bfloat16_the_same_bits_as_the_modules(fused_calls, float32_gate):
    """A bfloat16 model (weights, activations, KV cache) takes the fused step too, with its router
    gate in bfloat16 or in float32 (whose input the modules cast, and the fused step alike)."""
    bf16 = LLM(dtype="bfloat16", max_model_len=512, enable_prefix_caching=False, max_num_seqs=8,
               enable_return_routed_experts=True)
    model = model_of(bf16)
    assert model.layers[0].attn.k_cache.dtype == torch.bfloat16
    if float32_gate:
        for layer in model.layers:
            layer.mlp.gate = torch.nn.Parameter(layer.mlp.gate.float(), requires_grad=False)
    assert_the_modules_bits(bf16, fused_calls, 2, 3, 8)


@pytest.fixture
def taken(monkeypatch):
    """The fused layers' calls, True for each that computed its layer (False: declined)."""
    calls = []
    run = cpu_decode.FusedDecoderLayer.__call__

    def counted(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_decode.FusedDecoderLayer, "__call__", counted)
    return calls


def steps_of_many_sequences(llm, num_seqs: int, taken: list, **switches):
    """Each sequence's (tokens, rows, logprobs) of `num_seqs` 8-token prompts (one prefill step,
    then decode steps of num_seqs rows) with the fused layers on and with the modules (which
    call no fused layer: `taken` holds the first run's calls), `switches` the other settings."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 8).tolist() for _ in range(num_seqs)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    with rebound(model_of(llm), fast_cpu_decode=True, **switches):
        fused = outputs(llm, prompts, params)
    calls = len(taken)
    with rebound(model_of(llm), fast_cpu_decode=False, **switches):
        modules = outputs(llm, prompts, params)
    assert len(taken) == calls
    return fused, modules


def assert_the_same_outputs(fused, modules):
    for (tokens, rows, logprobs), (want_tokens, want_rows, want_logprobs) in zip(fused, modules, strict=True):
        assert tokens == want_tokens and logprobs == want_logprobs
        np.testing.assert_array_equal(rows, want_rows)


@pytest.mark.parametrize("packed_linear", [True, False])
def test_bfloat16_steps_past_32_sequences(taken, packed_linear):
    """A bfloat16 step of 33-63 sequences takes the fused layers where the projections are read
    packed (the Rust linear takes them up to PACKED_MAX_ROWS rows), with the modules' bits, and
    the modules where they are not (torch takes those rows)."""
    bf16 = LLM(dtype="bfloat16", max_model_len=256, enable_prefix_caching=False, max_num_seqs=48,
               enable_return_routed_experts=True)
    fused, modules = steps_of_many_sequences(bf16, 40, taken, packed_linear=packed_linear)
    assert taken and all(taken) == (packed_linear and packs(torch.bfloat16)) and (any(taken) == all(taken))
    assert_the_same_outputs(fused, modules)
    bf16.engine.shutdown()


@pytest.mark.parametrize("num_seqs", [linear_cpu.FLOAT32_MAX_ROWS, linear_cpu.FLOAT32_MAX_ROWS + 1])
def test_float32_steps_up_to_the_float32_row_limit(taken, num_seqs):
    """A float32 step of up to FLOAT32_MAX_ROWS sequences takes the fused layers (the Rust linear
    reads float32 weights in place up to there), with the modules' bits; one more row takes the
    modules (torch's GEMM then)."""
    f32 = LLM(dtype="float32", max_model_len=256, enable_prefix_caching=False, max_num_seqs=64,
              enable_return_routed_experts=True)
    fused, modules = steps_of_many_sequences(f32, num_seqs, taken)
    assert taken and all(taken) == (num_seqs <= linear_cpu.FLOAT32_MAX_ROWS) and (any(taken) == all(taken))
    assert_the_same_outputs(fused, modules)
    f32.engine.shutdown()


@pytest.fixture(scope="module")
def adapted_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint and three PEFT adapters of it: on q/k/v/o and the routed
    experts; on q and o and the router gate (rank 8); on the experts alone in SGLang's
    shared-outer form."""
    family, root = "qwen3_moe", tmp_path_factory.mktemp("adapted")
    adapters = {
        "attention_experts": write_adapter(root / "a", family, seed=1),
        "gate": write_adapter(root / "g", family, seed=2, rank=8, alpha=4, experts=False,
                              targets=["q_proj", "o_proj"], parameters=["mlp.gate.weight"]),
        "shared_outer": write_adapter(root / "s", family, seed=3, targets=[], shared_outer=True),
    }
    return write_checkpoint(root / "ckpt", family), adapters


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "threads", "seed"), [("float32", 1, 0), ("float32", 2, 1), ("bfloat16", 2, 2)])
def test_adapters_the_same_bits_as_the_modules(adapted_checkpoint, fused_calls, dtype, threads, seed):
    """Steps mixing the three adapters and the base model in every proportion (names drawn per
    request) take the fused step and give the modules' bits."""
    ckpt, adapters = adapted_checkpoint
    llm = LLM(str(ckpt), dtype=dtype, enable_lora=True, max_loras=3, max_lora_rank=8, max_model_len=256,
              enable_prefix_caching=False, max_num_seqs=8, enable_return_routed_experts=True)
    for name, path in adapters.items():
        llm.load_lora_adapter(name, str(path))
    rng = np.random.default_rng(seed)
    names = [[None, *adapters][i] for i in rng.integers(0, len(adapters) + 1, 12)]
    model = model_of(llm)
    layout = (len(model.layers), model.config.top_k)
    assert_the_modules_bits(llm, fused_calls, threads, seed, 12, names, layout)
    # and each adapter changes what the model says, so the test cannot pass without computing them
    prompts, params = generated_requests(seed, 1)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=0)
    base = outputs(llm, prompts, greedy)[0]
    for name in adapters:
        tokens, rows, _ = outputs(llm, prompts, greedy, name)[0]
        assert tokens != base[0] or not np.array_equal(rows, base[1]), name


def test_prefill_steps_keep_the_modules(llm, fused_calls):
    assert all(layer.fused is not None for layer in model_of(llm).layers)  # the default settings fuse them
    llm.generate([[1, 2, 3] * 20, [7] * 45], SamplingParams(max_tokens=1, ignore_eos=True))  # prefill steps only
    assert not fused_calls
    llm.generate([[1, 2, 3] * 20, [7] * 45], SamplingParams(max_tokens=3, ignore_eos=True))
    assert fused_calls  # the two decode steps after it


def test_without_routed_experts_too(fused_calls):
    prompts, params = generated_requests(2, 6)
    plain = LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8, enable_return_routed_experts=False)
    fused = outputs(plain, prompts, params)
    assert fused_calls
    with rebound(model_of(plain), fast_cpu_decode=False):
        modules = outputs(plain, prompts, params)
    assert [(t, lp) for t, _, lp in fused] == [(t, lp) for t, _, lp in modules]
    assert all(rows is None for _, rows, _ in fused)


@dataclasses.dataclass(frozen=True)
class AdaptedLinearParts(LinearParts):
    """A projection with a part the fused op does not know (a LoRA adapter, say)."""

    adapter: object = None


def _unlike(case: str, layer) -> str:
    """Changes one part of `layer` to something the fused op does not compute; returns the part
    its refusal names."""
    attn, moe = layer.attn, layer.mlp
    hidden = layer.input_norm.shape[0]
    changes = {
        "window": lambda: setattr(attn, "window", 8),
        "sinks": lambda: setattr(attn, "sinks", SimpleNamespace(weight=torch.zeros(attn.num_heads))),
        "output gate": lambda: setattr(attn, "q_rows", 2 * attn.q_size),
        "gate projection": lambda: setattr(attn, "gate", ColumnParallelLinear(hidden, Piece(attn.q_size),
                                                                              dtype=torch.float32, device="cpu")),
        "q/k norm over all heads": lambda: setattr(attn, "qk_norm", "full"),
        "qkv bias": lambda: setattr(attn.qkv_proj, "bias", torch.zeros(attn.qkv_proj.weight.shape[0])),
        "an adapter": lambda: setattr(attn.qkv_proj, "parts",
                                      lambda: AdaptedLinearParts(attn.qkv_proj.weight, adapter=object())),
        "shared expert": lambda: setattr(moe, "shared", Mlp(hidden, 8, gated=True, dtype=torch.float32, device="cpu")),
        "correction bias": lambda: setattr(moe, "correction_bias", torch.zeros(moe.gate.shape[0])),
        "expert groups": lambda: setattr(moe, "num_groups", 2),
        "expert biases": lambda: setattr(moe.experts, "b2", torch.zeros(moe.experts.w2.shape[:2])),
        "residual multiplier": lambda: setattr(layer, "residual_multiplier", 0.5),
        "no pre-norm": lambda: setattr(layer, "input_norm", None),
        "sandwich norm": lambda: setattr(layer, "attn_out_norm", layer.post_attention_norm),
        "bfloat16 experts": lambda: setattr(moe.experts.w13, "data", moe.experts.w13.data.to(torch.bfloat16)),
    }
    changes[case]()
    return {"window": "mixer.window", "sinks": "mixer.sinks", "output gate": "mixer.output_gate",
            "gate projection": "mixer.gate", "q/k norm over all heads": "mixer.norm_over_heads",
            "qkv bias": "mixer.qkv.bias", "an adapter": "mixer.qkv.adapter", "shared expert": "mlp.shared",
            "correction bias": "mlp.router.correction_bias", "expert groups": "mlp.router.num_groups",
            "expert biases": "mlp.experts.b2", "residual multiplier": "residual_multiplier",
            "no pre-norm": "input_norm", "sandwich norm": "attn_out_norm",
            "bfloat16 experts": "not of one dtype"}[case]


CASES = ["window", "sinks", "output gate", "gate projection", "q/k norm over all heads", "qkv bias", "an adapter",
         "shared expert", "correction bias", "expert groups", "expert biases", "residual multiplier", "no pre-norm",
         "sandwich norm", "bfloat16 experts"]


@pytest.mark.parametrize("case", CASES)
def test_a_layer_it_does_not_cover_declines_naming_the_part(llm, case):
    model = model_of(llm)
    layer = copy.deepcopy(model.layers[0])
    layer.use_ops(model.ops)
    assert layer.fused is not None and layer.fused_declined is None
    part = _unlike(case, layer)
    layer.use_ops(model.ops)
    assert layer.fused is None and part in layer.fused_declined


def test_the_model_says_which_layers_decline_and_why(llm, caplog):
    model = copy.deepcopy(model_of(llm))
    model.layers[2].attn.window = 8
    with caplog.at_level(logging.INFO, logger="r3srv.models.model"):
        model.select_ops(model.ops)
    assert [layer.fused is None for layer in model.layers] == [False, False, True, False]
    assert "no fused decode step for layers [2] (mixer.window)" in caplog.text


@pytest.mark.parametrize("switch", ["fast_cpu_decode", "rust_linear", "rust_rms_norm", "rust_rope", "rust_decode",
                                    "cpu_expert_kernel", "rust_router"])
def test_any_kernel_it_calls_turned_off_turns_it_off(switch):
    with settings.overridden(**{switch: False}):
        assert ops_for("cpu", torch.float32).fuse_decoder_layer is None
    with settings.overridden(force_torch_router=True):
        assert ops_for("cpu", torch.float32).fuse_decoder_layer is None
    fuse = ops_for("cpu", torch.float32).fuse_decoder_layer
    assert fuse.func is cpu_decode.fuse_decoder_layer and fuse.keywords == {"pack": True, "pack_linear": True}
    # the layers read the experts and the linear weights as the backend's ops do
    with settings.overridden(packed_experts=False):
        assert ops_for("cpu", torch.float32).fuse_decoder_layer.keywords == {"pack": False, "pack_linear": True}
    with settings.overridden(packed_linear=False):
        assert ops_for("cpu", torch.float32).fuse_decoder_layer.keywords == {"pack": True, "pack_linear": False}


def test_the_step_plan_declines_what_the_kernels_would():
    """plan() is None for a prefill, for more rows than the Rust linear takes of packed weights,
    for cos/sin of another dtype than the rows, for float16."""
    meta = type("Meta", (), dict(prefills=[], decode_seqs=[0], graph=False, block_size=16,
                                 slot_mapping=torch.zeros(1, dtype=torch.int64),
                                 decode_kernel_args=lambda self: (torch.zeros(1, 2, dtype=torch.int64),
                                                                  torch.ones(1, dtype=torch.int64),
                                                                  torch.zeros(1, dtype=torch.int64), 1)))()
    x, cos = torch.zeros(1, 256), torch.zeros(1, 64)
    assert DecodeStep.plan(x, meta, cos, cos, None, 64, 1) is not None
    meta.prefills = [object()]
    assert DecodeStep.plan(x, meta, cos, cos, None, 64, 1) is None
    meta.prefills = []
    rows = linear_cpu.PACKED_MAX_ROWS + 1
    meta.decode_seqs = list(range(rows))
    assert DecodeStep.plan(torch.zeros(rows, 256), meta, torch.zeros(rows, 64), torch.zeros(rows, 64), None, 64,
                           1) is None
    meta.decode_seqs = [0]
    assert DecodeStep.plan(x.to(torch.bfloat16), meta, cos, cos, None, 64, 1) is None  # cos of another dtype
    half = cos.to(torch.bfloat16)
    assert DecodeStep.plan(x.to(torch.bfloat16), meta, half, half, None, 64, 1) is not None
    assert DecodeStep.plan(x.half(), meta, cos.half(), cos.half(), None, 64, 1) is None
    narrow = torch.zeros(1, 2, 8, dtype=torch.uint8)[:, :, 0]  # ids 8 bytes apart: the router cannot write it
    assert DecodeStep.plan(x, meta, cos, cos, narrow, 64, 1) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_lands_rows_in_their_slots_and_refuses_bad_ones(dtype):
    """The fused layer's cache write (r3srv._core.write_kv_cache): each new key and value row in
    its slot, as index_copy_ puts it; a slot outside the cache or caches that overlap are
    ValueErrors that write nothing."""
    from r3srv.kernels.paged_decode_cpu import write_kv_cache_entry as write
    from r3srv.kernels.rust_core import RUST_DTYPES

    assert write is not None, "r3srv._core lacks write_kv_cache: rebuild the extension (make install)"
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 2, 8, generator=g).to(dtype), torch.randn(3, 2, 8, generator=g).to(dtype)
    k_cache, v_cache = torch.zeros(10, 2, 8, dtype=dtype), torch.zeros(10, 2, 8, dtype=dtype)
    slots = torch.tensor([7, 0, 3])
    code = RUST_DTYPES[dtype]
    write(code, k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), 3, 16, 10)
    want_k, want_v = torch.zeros_like(k_cache).index_copy_(0, slots, k), torch.zeros_like(v_cache).index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    bad = torch.tensor([1, 10, 2])
    with pytest.raises(ValueError, match="slot 10"):
        write(code, k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bad.data_ptr(), 3, 16, 10)
    with pytest.raises(ValueError, match="overlap"):
        write(code, k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), k_cache.data_ptr(), slots.data_ptr(), 3, 16, 10)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

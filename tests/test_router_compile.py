"""The interpreter cannot show that the kernel compiles for a GPU: compile it ahead of time
for Hopper (sm_90, the H100/H200 the benchmark targets) with the ptxas bundled in triton,
which needs no GPU, and check that no variant spills registers to local memory."""

from __future__ import annotations

import re
import subprocess
import tempfile

import pytest

pytestmark = pytest.mark.slow  # kernel compiles and timings

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from r3srv.kernels import router_triton  # noqa: E402

if router_triton.interpreter_enabled():
    pytest.skip("this process imported triton with TRITON_INTERPRET=1: nothing to compile", allow_module_level=True)

POINTER_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "u8": "*u8", "u16": "*u16", "i32": "*i32"}

# (experts, top_k, scoring, bias, renormalize, logits dtype, capture dtype[, groups, top
# groups, group score top]): the engine's shapes (bf16 logits, uint8 capture), the extremes
# (k=1, 512/1024 experts, float64 keys) and expert groups (DeepSeek-V3, DeepSeek-V2, 32 groups).
VARIANTS = [
    (128, 8, "softmax", False, True, "bf16", "u8"),
    (60, 1, "sigmoid", False, False, "fp16", "u16"),
    (256, 8, "sigmoid", True, True, "bf16", "u8"),
    (512, 8, "sigmoid", True, True, "fp32", "i32"),
    (1024, 8, "softmax", True, False, "fp32", "i32"),
    (256, 8, "sigmoid", True, True, "bf16", "u8", 8, 4, 2),
    (160, 6, "softmax", False, False, "bf16", "u8", 8, 3, 1),
    (384, 8, "sigmoid", True, True, "bf16", "u16", 32, 4, 2),
    (512, 10, "softmax", False, True, "bf16", "u16"),  # Qwen3-Next
    (1024, 16, "sigmoid", True, True, "fp32", "i32"),  # the largest top-k
]


def compile_for_hopper(experts, top_k, scoring, bias, renormalize, logits_dtype, capture_dtype,
                       groups=1, top_groups=1, group_top=2):
    constants, num_warps = router_triton.kernel_constants(
        experts, top_k, scoring=scoring, has_bias=bias, renormalize=renormalize, has_capture=True,
        num_groups=groups, topk_groups=top_groups, group_score_top=group_top,
    )
    logits = POINTER_TYPES[logits_dtype]
    signature = {
        "logits_ptr": logits, "bias_ptr": "*fp32" if bias else logits, "weights_ptr": "*fp32", "ids_ptr": "*i32",
        "capture_ptr": POINTER_TYPES[capture_dtype], "num_tokens": "i32", "num_experts": "i32", "group_size": "i32",
        "stride_lt": "i32", "stride_le": "i32", "stride_ct": "i32", "stride_ck": "i32", "scaling": "fp32",
    } | {name: "constexpr" for name in constants}
    assert list(signature) == router_triton._route_kernel.arg_names  # the test tracks the kernel's signature
    source = ASTSource(fn=router_triton._route_kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


def assert_no_spills(kernel) -> None:
    assert kernel.asm["cubin"], "no cubin produced"
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    local = re.search(r"LOCAL:(\d+)", usage)
    assert local is not None, usage
    assert int(local.group(1)) == 0, f"register spills to local memory: {usage}"


def assert_compiles_without_spills(kernel, types: dict[str, str], constants: dict, *, num_warps: int = 4,
                                   fp_fusion: bool = False) -> None:
    """Compile `kernel` for sm_90 and check that it spills nothing. types: its pointer (and
    float) arguments' types, the other runtime arguments being i32; constants: its constexprs."""
    assert set(types) | set(constants) <= set(kernel.arg_names)  # the test tracks the kernel's signature
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    assert_no_spills(triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": num_warps, "enable_fp_fusion": fp_fusion}))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_compiles_for_sm90_without_spills(variant):
    assert_no_spills(compile_for_hopper(*variant))


@pytest.mark.slow
@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_delta_rule_step_compiles_for_sm90_without_spills(block_k):
    """kernels/recurrent_triton.py at the key widths the delta-rule models use (Qwen3-Next,
    Qwen3.5 and Kimi-Linear: 128)."""
    from r3srv.kernels import recurrent_triton

    kernel = recurrent_triton._delta_rule_step_kernel
    pointers = {"state_ptr": "*fp32", "slots_ptr": "*i64", "keep_ptr": "*fp32", "q_ptr": "*fp32", "k_ptr": "*fp32",
                "v_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*fp32", "out_ptr": "*fp32"}
    assert_compiles_without_spills(kernel, pointers, {"BLOCK_K": block_k, "BLOCK_V": recurrent_triton.BLOCK_V})


@pytest.mark.slow
@pytest.mark.parametrize("state_size", [64, 128, 256])
def test_ssm_step_compiles_for_sm90_without_spills(state_size):
    """kernels/recurrent_triton.py's Mamba-2 step at the state sizes Nemotron-H and Granite-4.0-H use (128)."""
    from r3srv.kernels import recurrent_triton

    kernel = recurrent_triton._ssm_step_kernel
    pointers = {"state_ptr": "*fp32", "slots_ptr": "*i64", "keep_ptr": "*fp32", "x_ptr": "*fp32", "dt_ptr": "*fp32",
                "a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "out_ptr": "*fp32"}
    assert_compiles_without_spills(kernel, pointers, {"BLOCK_P": recurrent_triton.BLOCK_P, "BLOCK_N": state_size})


@pytest.mark.slow
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, dtype, sinks, window",
    [(32, 8, 128, "bf16", False, False),  # Qwen3-MoE, GLM-4.5: GQA groups of 4 to 12, 128-wide heads
     (64, 8, 64, "bf16", True, True),  # gpt-oss: sinks, sliding windows, 64-wide heads
     (16, 4, 256, "fp16", False, True),  # the widest heads
     (8, 2, 64, "fp32", False, False),  # float32 models: IEEE products
     (128, 1, (576, 512), "bf16", False, False)],  # DeepSeek-V3's latent decodes: 576-wide keys, 512-wide values
)
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_paged_decode_compiles_for_sm90_without_spills(heads, kv_heads, head_dim, dtype, sinks, window, split):
    """kernels/paged_decode_triton.py at the shapes the attention families decode with, whole
    contexts and parts of split ones."""
    import torch

    from r3srv.kernels import paged_decode_triton

    kernel = paged_decode_triton._paged_decode_kernel
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    head_dim, v_dim = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    constants = paged_decode_triton.kernel_constants(heads, kv_heads, head_dim, v_dim, 16, sinks=sinks,
                                                     window=window, dtype=torch_dtype, split=split)
    data = "*" + dtype
    pointers = {"q_ptr": data, "k_ptr": data, "v_ptr": data, "tables_ptr": "*i64", "lens_ptr": "*i64",
                "rows_ptr": "*i64", "sinks_ptr": data, "out_ptr": data, "part_ptr": "*fp32", "part_acc_ptr": "*fp32"}
    assert_compiles_without_spills(kernel, pointers | {"scale": "fp32"}, constants,
                                   num_warps=paged_decode_triton.launch_warps(constants), fp_fusion=True)


@pytest.mark.slow
@pytest.mark.parametrize("v_dim, dtype, sinks", [(128, "bf16", False), (64, "bf16", True), (512, "bf16", False),
                                                 (64, "fp32", False)])
def test_split_combine_compiles_for_sm90_without_spills(v_dim, dtype, sinks):
    """The combine of split contexts, up to MLA's 512-wide values and the most parts."""
    from r3srv.kernels import paged_decode_triton
    from r3srv.kernels.launch import next_power_of_2

    kernel = paged_decode_triton._combine_splits_kernel
    constants = {"V_DIM": v_dim, "BLOCK_DV": next_power_of_2(v_dim),
                 "BLOCK_S": next_power_of_2(paged_decode_triton.MAX_SPLITS), "HAS_SINKS": sinks}
    pointers = {"part_ptr": "*fp32", "part_acc_ptr": "*fp32", "rows_ptr": "*i64", "sinks_ptr": "*" + dtype,
                "out_ptr": "*" + dtype}
    assert_compiles_without_spills(kernel, pointers, constants, fp_fusion=True)

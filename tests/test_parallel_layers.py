"""The parallel-aware building blocks (models/parallel.py): exact at size 1, and across two gloo
ranks the shards reassemble the single-device result; each rank reads only its slice of a
safetensors tensor (plain, FP8 with block scales, MXFP4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import join_gloo, spawn_ranks
from safetensors import safe_open
from safetensors.torch import save_file

from r3srv.models import quantization as quant
from r3srv.models.moe import Mlp
from r3srv.ops.experts import SILU_AND_MUL, TorchExperts, silu_and_mul

grouped_experts = TorchExperts(SILU_AND_MUL)  # the torch expert pass
from r3srv.models.parallel import (SINGLE, ColumnParallelLinear, ExpertSlice, ParallelLMHead, ParallelState,
                                   RowParallelLinear, VocabParallelEmbedding, checkpoint_shape, head_pieces, shard_of,
                                   split_evenly, transposed)
from r3srv.models.shard_reader import read_fp8, read_mxfp4, read_tensor

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)

CPU = dict(dtype=torch.float32, device=torch.device("cpu"))
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EXPERTS, TOP_K = 16, 24, 4, 1, 4, 11, 4, 2


def _full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Whole tensors as a checkpoint holds them (one seed: every rank draws the same)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "q": normal(HEADS * HEAD_DIM, HIDDEN), "k": normal(KV_HEADS * HEAD_DIM, HIDDEN),
        "v": normal(KV_HEADS * HEAD_DIM, HIDDEN), "q_bias": normal(HEADS * HEAD_DIM),
        "k_bias": normal(KV_HEADS * HEAD_DIM), "v_bias": normal(KV_HEADS * HEAD_DIM),
        "gate": normal(INTER, HIDDEN), "up": normal(INTER, HIDDEN), "down": normal(HIDDEN, INTER),
        "down_bias": normal(HIDDEN), "embed": normal(VOCAB, HIDDEN),
        "w13": normal(EXPERTS, 2 * INTER, HIDDEN), "w2": normal(EXPERTS, HIDDEN, INTER),
    }


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(5)])
    weights = torch.rand(5, TOP_K, generator=g)
    tokens = torch.randint(0, VOCAB, (7,), generator=g)
    return x, ids, weights, tokens


def _blocks(state: ParallelState):
    """The blocks under test, built for one rank (state)."""
    q = head_pieces(HEADS, HEAD_DIM, state)
    kv = head_pieces(KV_HEADS, HEAD_DIM, state)  # one KV head: replicated on both ranks
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, state=state, **CPU)
    return dict(
        qkv=ColumnParallelLinear(HIDDEN, (q, kv, kv), bias=True, **CPU),
        mlp=Mlp(HIDDEN, INTER, gated=True, parallel=state, **CPU),
        row=RowParallelLinear(split_evenly(INTER, state.tp_rank, state.tp_size), HIDDEN, bias=True, state=state, **CPU),
        embed=embed, head=ParallelLMHead(embed, tied=True, **CPU),
        experts=ExpertSlice(EXPERTS, HIDDEN, INTER, gated=True, state=state, **CPU),
    )


def _targets(blocks) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the view of a block it fills (as a model's weight_targets gives)."""
    qkv, mlp, row, experts = blocks["qkv"], blocks["mlp"], blocks["row"], blocks["experts"]
    return {"q": qkv.part(0), "k": qkv.part(1), "v": qkv.part(2), "q_bias": qkv.bias_part(0),
            "k_bias": qkv.bias_part(1), "v_bias": qkv.bias_part(2),
            "gate": mlp.gate_up.part(0), "up": mlp.gate_up.part(1), "down": mlp.down.part(), "down_bias": row.bias,
            "embed": blocks["embed"].part(), "w13": experts.w13_part(), "w2": experts.w2_part()}


class _Recording:
    """A safetensors file that counts the elements each read returns (get_tensor: the whole)."""

    def __init__(self, f):
        self.f, self.read = f, 0

    def get_tensor(self, name):
        tensor = self.f.get_tensor(name)
        self.read += tensor.numel()
        return tensor

    def get_slice(self, name):
        handle, recording = self.f.get_slice(name), self

        class Slice:
            def get_shape(self):
                return handle.get_shape()

            def __getitem__(self, index):
                tensor = handle[index]
                recording.read += tensor.numel()
                return tensor

        return Slice()


def _load(blocks, path) -> None:
    """Fill the blocks from a safetensors file, each target reading only its slice."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name, target in _targets(blocks).items():
            recording = _Recording(f)
            tensor = read_tensor(recording, name, shard_of(target))
            assert recording.read == target.numel(), name  # nothing beyond the slice was read
            target.copy_(tensor)
    # the MLP's row-parallel down projection shares the standalone row layer's weight values
    blocks["row"].weight.copy_(blocks["mlp"].down.weight)


def _single_device(full, x, ids, weights, tokens) -> dict[str, torch.Tensor]:
    """Every block's output computed with plain torch on the whole weights."""
    qkv = F.linear(x, torch.cat((full["q"], full["k"], full["v"])),
                   torch.cat((full["q_bias"], full["k_bias"], full["v_bias"])))
    h = silu_and_mul(F.linear(x, torch.cat((full["gate"], full["up"]))))
    return dict(qkv=qkv, mlp=F.linear(h, full["down"]), row=F.linear(h, full["down"], full["down_bias"]),
                embed=F.embedding(tokens, full["embed"]), head=F.linear(x, full["embed"]),
                experts=grouped_experts(x, full["w13"], full["w2"], weights, ids))


def _outputs(blocks, x, ids, weights, tokens) -> dict[str, torch.Tensor]:
    gate_up = blocks["mlp"].gate_up(x)
    return dict(qkv=blocks["qkv"](x), mlp=blocks["mlp"](x), row=blocks["row"](silu_and_mul(gate_up)),
                embed=blocks["embed"](tokens), head=blocks["head"](x),
                experts=blocks["experts"](x, weights, ids, grouped_experts))


@pytest.fixture
def checkpoint(tmp_path):
    full = _full_weights()
    save_file({k: v.contiguous() for k, v in full.items()}, str(tmp_path / "blocks.safetensors"))
    return full, tmp_path / "blocks.safetensors"


# ---- size 1 -----------------------------------------------------------------------------
def test_size_one_blocks_equal_plain_torch_bit_for_bit(checkpoint, r3srv_settings):
    r3srv_settings(rust_linear=False)  # F.linear's own bits (tests/test_linear_cpu.py checks the Rust kernel)
    full, path = checkpoint
    blocks = _blocks(SINGLE)
    assert all(shard_of(t) == () for t in _targets(blocks).values())  # whole tensors: nothing to cut
    _load(blocks, path)
    x, ids, weights, tokens = _inputs()
    want = _single_device(full, x, ids, weights, tokens)
    got = _outputs(blocks, x, ids, weights, tokens)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_size_one_linear_and_embedding_are_the_plain_calls(r3srv_settings):
    r3srv_settings(rust_linear=False)  # F.linear's own bits (tests/test_linear_cpu.py checks the Rust kernel)
    g = torch.Generator().manual_seed(3)
    linear = ColumnParallelLinear(8, (split_evenly(6, 0, 1), split_evenly(4, 0, 1)), bias=True, **CPU)
    row = RowParallelLinear(split_evenly(10, 0, 1), 8, bias=True, **CPU)
    embed = VocabParallelEmbedding(13, 8, **CPU)
    for p in (linear.weight, linear.bias, row.weight, row.bias, embed.weight):
        p.copy_(torch.randn(p.shape, generator=g))
    x, h, ids = torch.randn(3, 8, generator=g), torch.randn(3, 10, generator=g), torch.tensor([0, 12, 5])
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    assert torch.equal(row(h), F.linear(h, row.weight, row.bias))
    assert torch.equal(embed(ids), F.embedding(ids, embed.weight))
    assert torch.equal(ParallelLMHead(embed, tied=True, **CPU)(x), F.linear(x, embed.weight))


# ---- two ranks: every rank's slice, read alone -------------------------------------------
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_reads_exactly_its_slice(checkpoint, rank, expert_parallel):
    full, path = checkpoint
    state = ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank if expert_parallel else 0,
                          ep_size=2 if expert_parallel else 1)
    blocks = _blocks(state)
    _load(blocks, path)
    targets = _targets(blocks)
    q_rows, kv = HEADS * HEAD_DIM // 2, slice(0, HEAD_DIM)  # one KV head, replicated
    half = INTER // 2
    want = {"q": full["q"][rank * q_rows : (rank + 1) * q_rows], "k": full["k"][kv], "v": full["v"][kv],
            "q_bias": full["q_bias"][rank * q_rows : (rank + 1) * q_rows], "k_bias": full["k_bias"], "v_bias": full["v_bias"],
            "gate": full["gate"][rank * half : (rank + 1) * half], "up": full["up"][rank * half : (rank + 1) * half],
            "down": full["down"][:, rank * half : (rank + 1) * half], "down_bias": full["down_bias"],
            "embed": full["embed"][rank * 6 : (rank + 1) * 6]}  # 11 rows: 6 and 5 (padded)
    if expert_parallel:  # whole experts, a contiguous slice of the logical ids
        want["w13"], want["w2"] = full["w13"][rank * 2 : rank * 2 + 2], full["w2"][rank * 2 : rank * 2 + 2]
        assert blocks["experts"].local_ids == range(rank * 2, rank * 2 + 2)
    else:  # every expert, a slice of its gate rows, its up rows and its down columns
        w13 = full["w13"].view(EXPERTS, 2, INTER, HIDDEN)[:, :, rank * half : (rank + 1) * half]
        want["w13"], want["w2"] = w13.reshape(EXPERTS, INTER, HIDDEN), full["w2"][..., rank * half : (rank + 1) * half]
    for name, tensor in want.items():
        assert torch.equal(targets[name], tensor), name
        assert checkpoint_shape(targets[name]) == tuple(full[name].shape), name
    if rank == 1:  # the padded vocabulary slice: its last row holds nothing
        assert blocks["embed"].weight.shape[0] == 6 and targets["embed"].shape[0] == 5


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("block", [(8, 8), (5, 7)])  # (5, 7): tiles straddle the ranks' boundaries
def test_fp8_shards_dequantize_as_slices_of_the_whole(tmp_path, rank, block):
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(2 * INTER, HIDDEN, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(quant.scale_shape(tuple(weight.shape), block), generator=g) + 0.5
    save_file({"w": weight, "w_scale_inv": scale}, str(tmp_path / "fp8.safetensors"))
    state = ParallelState(tp_rank=rank, tp_size=2)
    gate_up = ColumnParallelLinear(HIDDEN, (split_evenly(INTER, rank, 2),) * 2, **CPU)
    down = RowParallelLinear(split_evenly(HIDDEN, rank, 2), 2 * INTER, state=state, **CPU)  # columns cut
    whole = quant.dequantize(weight, scale, block)
    half = INTER // 2
    with safe_open(str(tmp_path / "fp8.safetensors"), framework="pt", device="cpu") as f:
        rows = read_fp8(f, "w", f, "w_scale_inv", block, shard_of(gate_up.part()))
        cols = read_fp8(f, "w", f, "w_scale_inv", block, shard_of(down.part()))
    want_rows = torch.cat((whole[rank * half : (rank + 1) * half], whole[INTER + rank * half : INTER + (rank + 1) * half]))
    assert torch.equal(rows, want_rows)
    assert torch.equal(cols, whole[:, rank * HIDDEN // 2 : (rank + 1) * HIDDEN // 2])


@pytest.mark.parametrize("rank", [0, 1])
def test_mxfp4_expert_shards_are_slices_of_the_whole(tmp_path, rank):
    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (EXPERTS, 2 * INTER, 2, 16), dtype=torch.uint8, generator=g)  # [E, rows, groups, 16]
    scales = torch.randint(120, 130, (EXPERTS, 2 * INTER, 2), dtype=torch.uint8, generator=g)
    save_file({"x_blocks": blocks, "x_scales": scales}, str(tmp_path / "mx.safetensors"))
    whole = quant.dequantize_mxfp4(blocks, scales)  # [E, 64, 2I]: transformers' x @ W layout
    expert_parallel = ExpertSlice(EXPERTS, 64, INTER, gated=True, interleaved=True, biased=True,
                                  state=ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2), **CPU)
    split_inter = ExpertSlice(EXPERTS, 64, INTER, gated=True, interleaved=True, biased=True,
                              state=ParallelState(tp_rank=rank, tp_size=2), **CPU)
    with safe_open(str(tmp_path / "mx.safetensors"), framework="pt", device="cpu") as f:
        ep = read_mxfp4(f, "x_blocks", f, "x_scales", shard_of(transposed(expert_parallel.w13_part())))
        tp = read_mxfp4(f, "x_blocks", f, "x_scales", shard_of(transposed(split_inter.w13_part())))
    assert torch.equal(ep, whole[rank * 2 : rank * 2 + 2])
    assert torch.equal(tp, whole[..., rank * INTER : (rank + 1) * INTER])  # interleaved gate/up pairs stay whole


# ---- two gloo ranks: the shards reassemble the single-device result ----------------------
def _rank_main(rank: int, port: int, path: str, expert_parallel: bool) -> None:
    join_gloo(rank, port)
    try:
        torch.set_num_threads(1)
        state = ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank if expert_parallel else 0,
                              ep_size=2 if expert_parallel else 1, group=torch.distributed.group.WORLD)
        blocks = _blocks(state)
        _load(blocks, path)
        x, ids, weights, tokens = _inputs()
        want = _single_device(_full_weights(), x, ids, weights, tokens)
        got = _outputs(blocks, x, ids, weights, tokens)
        # column-parallel: this rank's q heads and the replicated KV head
        q_rows = HEADS * HEAD_DIM // 2
        mine = torch.cat((want["qkv"][:, rank * q_rows : (rank + 1) * q_rows], want["qkv"][:, HEADS * HEAD_DIM :]), -1)
        torch.testing.assert_close(got.pop("qkv"), mine, rtol=1e-5, atol=1e-5)
        # reduced or gathered: the whole result on every rank (rtol: a rank's few-row products
        # run through the Rust linear kernel, the reference through F.linear: other rounding)
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_gloo_ranks_reassemble_the_single_device_result(checkpoint, expert_parallel):
    _, path = checkpoint
    spawn_ranks(_rank_main, path=str(path), expert_parallel=expert_parallel)

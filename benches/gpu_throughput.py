"""Decode throughput of a Qwen3-30B-A3B-shaped model against the memory-bandwidth roofline.

    python benches/gpu_throughput.py [--batches 1 8 64 256] [--prompt-len 1024] [--steps 16]
                                     [--layers 48] [--out table.md] [--require-gpu]

Builds, on the GPU, a model of Qwen3-30B-A3B's configuration (48 layers, 128 experts, top-8,
hidden 2048, moe_intermediate 768, 32 query / 4 KV heads of 128, vocab 151936, bfloat16) with
random weights written straight into it (nothing downloaded, no checkpoint on disk), then for
each batch size decodes `--steps` steps after 1,024-token prompts (random token ids, so no
prefix is shared), with routed experts on and off, eagerly and from CUDA graphs (the same
engine: its graphs are set aside for the eager steps; the two alternate in rounds).

Each decode step is set against its roofline: the bytes it must read from HBM (every
non-expert weight, the lm_head, the experts actually routed to in that step, layer by layer,
counted from the routed-experts rows, and every sequence's K/V) over the bandwidth a
device-to-device copy measures in the same run. Printed beside: the targets the GPU
decode path is held to (batch 1 >= 50% of the roofline, batch 64 >= 60%, routed experts on/off
within 1%).

Without CUDA it says why and exits 0 (1 with --require-gpu).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
TARGETS = {1: 0.50, 64: 0.60}  # share of the roofline a decode step should reach
ON_OFF_BUDGET = 0.01  # routed experts on vs off, step time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per mode and batch (default 16)")
    p.add_argument("--layers", type=int, default=48, help="fewer layers for a quick run (default: the model's 48)")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 without CUDA")
    p.add_argument("--smoke", action="store_true",
                   help="check the script itself on the CPU with a toy model (its numbers mean nothing)")
    return p.parse_args(argv)


# --smoke: the same code on the CPU, the model shrunk to a toy
SMOKE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64, vocab_size=512)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device) -> float:
    """Bytes per second a device-to-device copy of 2 GiB moves (read + write), best of 5."""
    if device.type != "cuda":  # --smoke: a 64 MiB copy, wall clock
        src = torch.empty(32 << 20, dtype=torch.int16)
        start = time.perf_counter()
        src.clone()
        return 2 * (64 << 20) / (time.perf_counter() - start)
    src = torch.empty(1 << 30, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / best


def random_model(config: dict, device):
    """The model of `config` with random bf16 weights written in place (norms 1, the rest
    N(0, 0.02): the router spreads tokens over the experts)."""
    from r3srv.models.config import ModelConfig
    from r3srv.models.model import MoeForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        cfg = ModelConfig.from_dir(Path(tmp))
    model = MoeForCausalLM(cfg, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    return model.eval()


class Bytes:
    """What a decode step must read: the weights every step reads, one expert's bytes, the K/V of a token."""

    def __init__(self, model) -> None:
        cfg = model.config
        expert_params = {id(layer.mlp.experts.w13) for layer in model.layers if layer.is_moe} | {
            id(layer.mlp.experts.w2) for layer in model.layers if layer.is_moe}
        self.dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
        embed = model.embed.weight
        self.dense -= embed.numel() * embed.element_size()  # a step reads B rows of it, counted per step
        if model.lm_head.weight is embed:
            self.dense += embed.numel() * embed.element_size()
        experts = next(layer.mlp.experts for layer in model.layers if layer.is_moe)
        self.expert = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
        self.embed_row = cfg.hidden_size * embed.element_size()
        self.kv_token = model.kv_cache_bytes_per_block(1)
        self.moe_layers = sorted(cfg.moe_layers)

    def step(self, batch: int, context: int, active_experts: float) -> float:
        """A step of `batch` sequences of `context` tokens (the new one included), with
        `active_experts` distinct experts summed over the MoE layers."""
        return self.dense + batch * self.embed_row + active_experts * self.expert + batch * context * self.kv_token


def active_experts(engine, seqs, firsts: list[int], steps: int) -> list[int]:
    """Distinct experts routed to in each of `steps` decode steps (sequence i's tokens at
    positions firsts[i], firsts[i] + 1, ...), summed over the layers: from the engine's
    routed-experts rows."""
    rows = np.stack([engine.rows.gather(s.block_table.array, engine.config.block_size, first + steps, first)
                     for s, first in zip(seqs, firsts)])  # [B, steps, layers, top_k]
    moe = sorted(engine.model_config.moe_layers)
    return [sum(len(np.unique(rows[:, k, layer])) for layer in moe) for k in range(steps)]


def decode_run(engine, batch: int, prompt_len: int, steps: int, rng, vocab: int) -> dict:
    """Prefill `batch` prompts, then `steps` decode steps from graphs and `steps` eagerly,
    alternating in rounds of 4; returns the median step times and the steps' active experts."""
    from r3srv import SamplingParams

    # none may finish while timed: those prefilled first decode in the later prefill steps too
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", rng.integers(0, vocab, prompt_len).tolist(), params)
    seqs = [r.seqs[0] for r in engine.requests.values()]
    while any(s.num_computed_tokens < prompt_len for s in seqs):
        engine.step()
    graphs = engine.runner.graphs
    times: dict[str, list[float]] = {"graphs": [], "eager": []}
    # sequences whose prefill ended in an earlier step have decoded in the mixed steps since
    firsts = [s.num_computed_tokens for s in seqs]
    modes = ["graphs", "eager"] if graphs is not None else ["eager"]
    while len(times[modes[-1]]) < steps:
        for mode in modes:
            engine.runner.graphs = graphs if mode == "graphs" else None
            for _ in range(4):
                sync(engine.device)
                start = time.perf_counter()
                engine.step()  # sampling reads the tokens back: the step has ended when it returns
                times[mode].append(time.perf_counter() - start)
    engine.runner.graphs = graphs
    done = sum(len(t) for t in times.values())
    experts = active_experts(engine, seqs, firsts, done) if engine.rows is not None else []
    for rid in list(engine.requests):
        engine.abort_request(rid)
    context = round(statistics.mean(firsts)) + done // 2 + 1  # the steps' mean context
    return {"context": context, "experts": experts, **{m: statistics.median(t) for m, t in times.items() if t}}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.batches, args.prompt_len, args.steps = [1, 3], 32, 4
    elif not torch.cuda.is_available():
        print("benches/gpu_throughput.py: skipped, no CUDA device visible (it measures a GPU's decode "
              "against its HBM roofline)")
        return 1 if args.require_gpu else 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from r3srv.engine import cuda_graphs, llm_engine
    from r3srv.models import loader

    device = torch.device("cpu" if args.smoke else "cuda")
    bandwidth = copy_bandwidth(device)
    config = dict(QWEN3_30B_A3B, **SMOKE) if args.smoke else dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    model = random_model(config, device)
    sizes = Bytes(model)
    name = "CPU (--smoke)" if args.smoke else torch.cuda.get_device_name()
    print(f"# {name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; model {config['num_hidden_layers']} layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
    load, ladder = loader.load_model, cuda_graphs.batch_size_buckets
    loader.load_model = lambda *a, **k: (model, None)  # every engine below serves this model
    # graphs for the measured batch sizes only: the engine's ladder up to 256 has 35 buckets, a
    # minute or more of capture for 48 layers
    cuda_graphs.batch_size_buckets = lambda max_num_seqs: sorted(set(args.batches))
    results: dict[tuple[int, bool], dict] = {}
    try:
        for rexp in (True, False):
            if model.block_size:
                model.free_kv_cache()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            engine = llm_engine.LLMEngine.from_kwargs(
                "qwen3-30b-a3b-random", device=device.type, dtype="bfloat16", enable_return_routed_experts=rexp,
                enable_prefix_caching=False, max_num_seqs=max(args.batches), max_num_batched_tokens=8192,
                max_model_len=args.prompt_len + 4 * args.steps + 64, cuda_graphs=True,
                num_kv_blocks=8 * max(args.batches) if args.smoke else None)
            rng = np.random.default_rng(1)  # the same prompts for both engines
            for batch in args.batches:
                r = results[batch, rexp] = decode_run(engine, batch, args.prompt_len, args.steps, rng,
                                                      config["vocab_size"])
                print(f"batch {batch}, routed experts {'on' if rexp else 'off'}: median step "
                      + ", ".join(f"{m} {r[m] * 1e3:.2f} ms" for m in ("eager", "graphs") if m in r), flush=True)
            if engine.runner.graphs is not None:
                engine.runner.graphs.clear()
            del engine
    finally:
        loader.load_model, cuda_graphs.batch_size_buckets = load, ladder
    lines = [
        "| batch | experts | mode | step ms | out tok/s | roofline ms | % roofline | target |",
        "|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for (batch, rexp), r in sorted(results.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        experts = r["experts"] or results[batch, True]["experts"]  # same prompts, same greedy tokens
        roof = sizes.step(batch, r["context"], statistics.mean(experts)) / bandwidth
        for mode in ("eager", "graphs"):
            if mode not in r:
                continue
            share = roof / r[mode]
            target = TARGETS.get(batch)
            verdict = "" if target is None else f">= {target:.0%}: {'met' if share >= target else 'NOT met'}"
            lines.append(f"| {batch} | {'on' if rexp else 'off'} | {mode} | {r[mode] * 1e3:.2f} | {batch / r[mode]:.0f} "
                         f"| {roof * 1e3:.2f} | {share:.0%} | {verdict} |")
    lines.append("")
    for batch in args.batches:
        for mode in ("eager", "graphs"):
            on, off = results[batch, True].get(mode), results[batch, False].get(mode)
            if on and off:
                ratio = on / off
                lines.append(f"batch {batch} {mode}: routed experts on/off step time {ratio:.3f} "
                             f"(target within {ON_OFF_BUDGET:.0%}: {'met' if abs(ratio - 1) <= ON_OFF_BUDGET else 'NOT met'})")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

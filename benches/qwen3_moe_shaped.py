"""A checkpoint of Qwen3-30B-A3B's layer shape with fewer layers and RANDOM weights, for
benchmarks beside the built-in model: `python benches/qwen3_moe_shaped.py DIR [--layers 2]`.

Each layer is Qwen3-30B-A3B's (hidden 2,048; 32 query and 4 KV heads of 128; 128 experts of
768, top-8; per-head q/k norms), written the way r3srv's built-in model is (the same random
scaling and byte-level tokenizer: models/builtin.py), so both servers load it as any Qwen3-MoE
checkpoint. The vocabulary is the tokenizer's 259 bytes and specials, not Qwen's 151,936: a stack
of two layers would otherwise spend most of a decode step in its LM head, where the real model,
with 48 layers, spends a few percent. bfloat16 on disk, about 1.2 GB per layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import save_file

from r3srv.models.builtin import builtin_config, builtin_weights, write_byte_level_tokenizer

QWEN3_30B_A3B_LAYER = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144)


def qwen3_moe_shaped_config(layers: int) -> dict:
    config = dict(builtin_config(), **QWEN3_30B_A3B_LAYER, num_hidden_layers=layers, rope_theta=1e6,
                  r3srv_model_name=f"qwen3-30b-a3b-shaped-{layers}-layers-random")
    return config


def write_checkpoint(path: Path, layers: int) -> Path:
    """Writes the checkpoint into `path` (created if missing) unless it is already there."""
    path.mkdir(parents=True, exist_ok=True)
    config = qwen3_moe_shaped_config(layers)
    if (path / "config.json").is_file() and json.loads((path / "config.json").read_text()) == config:
        return path
    save_file(builtin_weights(config), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}) + "\n")
    write_byte_level_tokenizer(path)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: marks the checkpoint whole
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(write_checkpoint(args.dir, args.layers))


if __name__ == "__main__":
    main()

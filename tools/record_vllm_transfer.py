"""Record what vLLM's NCCL weight-transfer trainer puts on the wire, for tests/test_vllm_transfer.py.

Runs in a throwaway environment that has vLLM (never in CI): pickles an `ncclUniqueId` with vLLM's
own class (what `StatelessProcessGroup.broadcast_obj` stores at `broadcast_from/0/0`), and cuts
generated tensors into packed chunks with vLLM 0.33's own `pack_tensors` (loaded from the wheel's
source file, which needs only torch), for several buffer sizes. Writes tests/data/vllm_transfer.json.

    pip download --no-deps vllm==0.33.0 && unzip the wheel into SRC (it holds vllm/), then
    /path/to/vllm-venv/bin/python tools/record_vllm_transfer.py SRC [--check]
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import pickle
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "vllm_transfer.json"
DTYPES = ("float32", "bfloat16", "float16", "int64", "uint8")


def load_packed_tensor(src: Path):
    path = src / "vllm" / "distributed" / "weight_transfer" / "packed_tensor.py"
    spec = importlib.util.spec_from_file_location("vllm_packed_tensor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generated_tensors(rng: random.Random, count: int) -> list[tuple[str, list[int], str]]:
    tensors = []
    for i in range(count):
        shape = [rng.randint(1, 9) for _ in range(rng.randint(0, 3))]
        tensors.append((f"layers.{i}.w{rng.randint(0, 99)}", shape, rng.choice(DTYPES)))
    return tensors


def vllm_chunks(packed_tensor, tensors, buffer_size: int) -> list[list[str]]:
    import torch

    items = iter([(name, torch.zeros(shape, dtype=getattr(torch, dtype))) for name, shape, dtype in tensors])
    chunks = []
    while (chunk := packed_tensor.pack_tensors(items, lambda item: item[1], buffer_size)) is not None:
        chunks.append(chunk.names)
    return chunks


def record(src: Path) -> dict:
    import vllm
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    rng = random.Random(0)
    unique_id = ncclUniqueId()
    raw = bytes(rng.randrange(256) for _ in range(128))
    for i, byte in enumerate(raw):
        unique_id.internal[i] = byte - 256 if byte > 127 else byte
    packed_tensor = load_packed_tensor(src)
    cases = []
    for count, buffer_size in ((1, 1), (7, 64), (12, 200), (20, 1 << 30)):
        tensors = generated_tensors(rng, count)
        cases.append({"buffer_size_bytes": buffer_size, "tensors": tensors,
                      "chunks": vllm_chunks(packed_tensor, tensors, buffer_size)})
    return {
        "source": f"vLLM {vllm.__version__} ncclUniqueId (pickled); vLLM 0.33.0 packed_tensor.pack_tensors",
        "unique_id_pickle_b64": base64.b64encode(pickle.dumps(unique_id)).decode(),
        "unique_id_hex": raw.hex(),
        "packing": cases,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("src", type=Path, help="the unzipped wheels' root (holds vllm/)")
    parser.add_argument("--check", action="store_true", help="compare with the checked-in file instead of writing it")
    args = parser.parse_args()
    data = record(args.src)
    if args.check:
        same = json.loads(OUT.read_text()) == data
        print("up to date" if same else f"{OUT} differs from what vLLM records now")
        return 0 if same else 1
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

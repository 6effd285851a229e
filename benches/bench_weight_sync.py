"""Weight-sync time, as a same-run ratio: `pytest benches/bench_weight_sync.py -s`.

One server (`r3srv serve`, the built-in model, CPU) takes a perturbed copy of its own weights
round after round, alternately (a) from disk (/update_weights_from_disk on a checkpoint
directory: safetensors read, checked, copied) and (b) over torch.distributed (this process is
the trainer, rank 0 of a gloo group: /update_weights_from_distributed, one broadcast per
tensor, staged, checked, copied). Each round's time runs from the request to the answer, the
weights being served. The ratio distributed/disk is printed and kept in extra_info.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import weight_sync_trainer as trainer  # noqa: E402
from bench_server import report  # noqa: E402
from server_fixture import TEST_SERVER_ARGS, RemoteServer, free_port  # noqa: E402

ROUNDS = 5


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory) -> Path:
    """The built-in checkpoint with every weight nudged, written as a checkpoint directory."""
    from r3srv.models.builtin import builtin_model_dir

    source, target = builtin_model_dir(), tmp_path_factory.mktemp("perturbed")
    generator = torch.Generator().manual_seed(0)
    for name in source.iterdir():
        if name.suffix != ".safetensors":
            shutil.copy(name, target)
    for shard in source.glob("*.safetensors"):
        tensors = load_file(shard)
        nudged = {k: (t.float() * (1 + 0.01 * torch.randn(t.shape, generator=generator))).to(t.dtype)
                  for k, t in tensors.items()}
        save_file(nudged, target / shard.name, metadata={"format": "pt"})
    return target


def test_weight_sync_distributed_vs_disk(benchmark, perturbed):
    tensors = trainer.checkpoint_tensors(perturbed)
    size_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    with RemoteServer("--enable-weight-updates", *TEST_SERVER_ARGS) as server, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        group = trainer.join(server.url, free_port(), pool)
        times: dict[str, list[float]] = {"disk": [], "distributed": []}
        count = iter(range(10**6))

        def disk() -> None:
            r = httpx.post(server.url + "/update_weights_from_disk", timeout=300,
                           json={"model_path": str(perturbed), "weight_version": f"disk-{next(count)}"})
            assert r.status_code == 200, r.text

        def distributed() -> None:
            r = trainer.push(server.url, group, tensors, pool, weight_version=f"pushed-{next(count)}")
            assert r.status_code == 200 and "updated" in r.json()["message"], r.text

        order = [("disk", disk), ("distributed", distributed)]

        def one_round() -> None:
            order.reverse()  # alternate who goes first, so drift in machine load hits both alike
            for name, sync in order:
                t0 = time.perf_counter()
                sync()
                times[name].append(time.perf_counter() - t0)

        try:
            one_round()  # warm-up: page cache, first allocations
            for measured in times.values():
                measured.clear()
            benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
        finally:
            dist.destroy_process_group(group)
    assert all(times.values())
    report(benchmark, f"weight sync of the built-in model ({size_mb:.0f} MiB, {len(tensors)} tensors)",
           times, "disk", "distributed")

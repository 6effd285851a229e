"""A CUDA decode step must not wait for the GPU once per layer: each wait stalls the host until
the queued layers finish, so the next layers' launches no longer overlap the GPU's work (the
H200 ran 6-11 ms decode steps on a 4-layer model). torch's sync debug mode reports every
synchronizing call; a model twice as deep must make no more of them per step. Skipped (with
the reason) without CUDA."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from engine_testing import GREEDY, prompt_ids
from r3srv import LLM, SamplingParams
from tiny_checkpoints import write_tiny_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu


def _syncs_per_decode_step(path, steps: int = 4, sampling: dict = GREEDY) -> list[list[str]]:
    """Per decode step, where it synchronized (file:line of the Python call, one per sync)."""
    engine = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=128).engine
    for i in range(3):
        engine.add_request(f"r{i}", prompt_ids(20 + 7 * i, base=i),
                           SamplingParams(max_tokens=steps + 3, **sampling))
    engine.step()  # the prefills
    engine.step()  # first decodes: one-time allocations
    engine.step()
    return [_sync_sites_of_a_step(engine) for _ in range(steps)]


def _sync_sites_of_a_step(engine) -> list[str]:
    """Where one engine step synchronized (file:line of the Python call, one per sync)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert not engine.step().failed
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


# plain attention + the fused router + grouped expert GEMMs; latent attention; a hybrid (Gated
# DeltaNet beside attention: its fused decode steps, state slots)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_decode_steps_wait_for_the_gpu_no_more_in_a_deeper_model(family, tmp_path):
    """A sync inside a layer shows in every step of the deeper model (the first GPU run saw one
    step of the shallow model make an extra, one-off sync: the fewest per step are compared).
    Since the inputs travel pinned and non-blocking, a decode step waits once: reading back the
    sampled tokens (an H200 counted 11 before, 14 for a hybrid, and 1 since)."""
    shallow = _syncs_per_decode_step(write_tiny_checkpoint(tmp_path / "2", family, seed=1, num_layers=2))
    deep = _syncs_per_decode_step(write_tiny_checkpoint(tmp_path / "4", family, seed=1, num_layers=4))
    print(f"{family}: syncs per decode step, 2 layers {[len(s) for s in shallow]}, 4 layers {[len(s) for s in deep]}; "
          f"where (4 layers, a middle step): {dict(Counter(deep[1]))}")
    assert min(map(len, shallow)) > 0  # the sampler reads its picks back: the mode does report syncs
    assert min(map(len, deep)) <= min(map(len, shallow)), f"2 layers: {shallow}\n4 layers: {deep}"
    assert min(map(len, deep)) == 1, f"a decode step waited more than once: {deep}"


def test_a_sampling_decode_step_waits_once(tmp_path):
    """Rollouts sample (temperature 1): the temperatures travel without a wait too, so the step
    waits only to read the draws back."""
    path = write_tiny_checkpoint(tmp_path / "q", "qwen3_moe", seed=1, num_layers=2)
    sites = _syncs_per_decode_step(path, sampling=dict(temperature=1.0, ignore_eos=True))
    print(f"sampling: syncs per decode step {[len(s) for s in sites]}; where: {dict(Counter(sites[1]))}")
    assert min(map(len, sites)) == 1, sites


def _syncs_in_a_prefill_step(path) -> list[str]:
    engine = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=128).engine
    engine.add_request("warm", prompt_ids(9), SamplingParams(max_tokens=1, **GREEDY))
    engine.step()  # one-time allocations
    for i in range(3):
        engine.add_request(f"r{i}", prompt_ids(20 + 7 * i, base=i), SamplingParams(max_tokens=2, **GREEDY))
    return _sync_sites_of_a_step(engine)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_prefill_steps_wait_for_the_gpu_no_more_in_a_deeper_model(family, tmp_path):
    """The same for a step of three prefills: a hybrid's scan groups index their real rows by
    host-built positions, not by a mask (which waited for the GPU in every recurrent layer)."""
    shallow = _syncs_in_a_prefill_step(write_tiny_checkpoint(tmp_path / "2", family, seed=1, num_layers=2))
    deep = _syncs_in_a_prefill_step(write_tiny_checkpoint(tmp_path / "4", family, seed=1, num_layers=4))
    print(f"{family} prefill step: {len(shallow)} syncs with 2 layers, {len(deep)} with 4; where: {dict(Counter(deep))}")
    assert 0 < len(deep) <= len(shallow), f"2 layers: {shallow}\n4 layers: {deep}"

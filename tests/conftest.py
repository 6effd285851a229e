"""Shared by every test: fixed seeds, deterministic Hypothesis, and a way to run a test under
other settings."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from r3srv import settings

try:
    import hypothesis
except ImportError:  # the GPU machine's image (benches/gpu_check.sh) runs only tests without it
    hypothesis = None
if hypothesis is not None:
    # Every run draws the same examples (derandomize: from each test's own source), and nothing
    # found by an earlier run on this machine is replayed first: a failure reproduces anywhere.
    hypothesis.settings.register_profile("r3srv", derandomize=True, database=None, print_blob=True)
    hypothesis.settings.load_profile("r3srv")


# `make test-fast` (-m "not slow") leaves these out: whole files that start real servers, compare
# against transformers' models, run Triton's interpreter in subprocesses or compile kernels,
# and single tests of otherwise quick files that take longest (tens of seconds each).
SLOW_FILES = {
    "test_cli.py", "test_server.py", "test_server_chat_specials.py", "test_server_hybrid.py",
    "test_server_sglang.py", "test_server_weights.py", "test_server_without_flag.py", "test_server_fields.py",
    "test_server_protocol_fidelity.py", "test_server_schema.py", "test_weight_sync.py", "test_weight_sync_tp.py",
    "test_fleet.py", "test_fleet_tensor_parallel.py",
    "test_server_sampling.py", "test_server_rows_encoding.py",
    "test_models_llm_oracle.py", "test_models_bfloat16.py", "test_models_quantized.py",
    "test_router_triton.py", "test_paged_decode_triton.py", "test_recurrent_triton.py", "test_router_bench.py",
    "test_router_compile.py", "test_engine_hybrid.py", "test_builtin_model.py",
    "test_weight_updates.py", "test_pause_generation.py", "test_cuda_graphs.py",
}
SLOW_DIRS = {"families"}  # every family against transformers (tests/family_oracle.py)
SLOW_TESTS = {
    "test_a_chat_prompt_gets_the_templates_bos_only", "test_a_mixed_workload_under_a_tight_pool_matches_a_roomy_engine",
    "test_forced_preemption_gives_identical_rows", "test_weight_update_on_the_builtin_model",
    "test_prepare_matches_the_per_token_reference", "test_greedy_generation_at_ep2_equals_one_device",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow_file = item.path.name in SLOW_FILES or item.path.parent.name in SLOW_DIRS
        if slow_file or getattr(item, "originalname", item.name) in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def fixed_seeds():
    """Every test starts from the same global random state, whatever ran before it (tests
    should still pass their own generators: this catches the ones that do not)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def r3srv_settings():
    """`r3srv_settings(grouped_mm=False, ...)` makes those this process's settings (see
    r3srv/settings.py) until the test ends; returns the new settings."""
    previous = settings.current()

    def change(**fields) -> settings.Settings:
        changed = settings.current().replace(**fields)
        settings.configure(changed)
        return changed

    yield change
    settings.configure(previous)

"""OpenRLHF 0.11.2 on r3srv's engine factory: OpenRLHF's own agent executor generating through
the factory's Ray actors, then its trainer's per-tensor weight broadcast (ray.util.collective
over gloo, its `--vllm.sync_with_ray --vllm.sync_backend gloo`), then generation on the new
weights, then its async trainer's pause, broadcast and resume with a round waiting. OpenRLHF runs
in its own environment (tools/openrlhf_env.sh: openrlhf with --no-deps,
its Ray and the imports its agent module needs) on a one-node CPU Ray cluster, as a subprocess
(tests/openrlhf_rollout.py says what of OpenRLHF runs and what is restated, and why).

Oracle: r3srv's own LLM on each checkpoint, given the prompt ids OpenRLHF's executor tokenized:
the same greedy tokens, the same rows (every token but the last) and the same sampled-token
logprobs as OpenRLHF's `rollout_log_probs`. About 2 to 3 minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from framework_rollouts import assert_batch_equals_own
from tiny_checkpoints import write_tiny_checkpoint

from r3srv import LLM, SamplingParams
from r3srv.integrations.openrlhf import create_vllm_engines

pytestmark = pytest.mark.slow  # a Ray cluster, OpenRLHF's executor and two engines

ROOT = Path(__file__).resolve().parent.parent
OPENRLHF_PYTHON = ROOT / ".openrlhf_venv" / "bin" / "python"
sys.path.insert(0, str(Path(__file__).parent))
import openrlhf_rollout as loop  # noqa: E402  (its constants only: it imports Ray and OpenRLHF lazily)

NO_ENV = "no OpenRLHF environment at .openrlhf_venv: tools/openrlhf_env.sh creates it (make test does)"


def openrlhf_source(relative: str) -> str:
    """A file of the installed openrlhf package, read without importing it (its modules import vLLM)."""
    if not OPENRLHF_PYTHON.exists():
        pytest.skip(NO_ENV)
    site = subprocess.run([str(OPENRLHF_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return (Path(site) / "openrlhf" / relative).read_text()


@pytest.fixture(scope="module")
def openrlhf_run(tmp_path_factory):
    if not OPENRLHF_PYTHON.exists():
        pytest.skip(NO_ENV)
    root = tmp_path_factory.mktemp("openrlhf")
    v0, v1 = write_tiny_checkpoint(root / "v0", seed=0), write_tiny_checkpoint(root / "v1", seed=1)
    out = root / "rollouts.npz"
    proc = subprocess.run([str(OPENRLHF_PYTHON), str(Path(loop.__file__)), str(v0), str(v1), str(out)], cwd=root,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return v0, v1, dict(np.load(out, allow_pickle=True))


def own(checkpoint: Path, prompts: list[list[int]]) -> list:
    """r3srv's own API on a fresh engine, with the rollout's sampling (greedy, min_tokens 1)."""
    llm = LLM(str(checkpoint), device="cpu", max_model_len=loop.MAX_LEN, enable_return_routed_experts=True,
              logprobs_mode="processed_logprobs", **loop.ENGINE_KWARGS)  # as OpenRLHF's factory asks
    try:
        return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=loop.MAX_NEW_TOKENS, min_tokens=1,
                                                    logprobs=0))
    finally:
        llm.shutdown()


def test_factory_has_openrlhfs_signature():
    """create_vllm_engines' parameters as OpenRLHF 0.11.2 declares them (names, order, defaults),
    read from its installed vllm_engine.py; r3srv's adds keyword-only ones after them."""
    tree = ast.parse(openrlhf_source("trainer/ray/vllm_engine.py"))
    theirs = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "create_vllm_engines").args
    defaults = [None] * (len(theirs.args) - len(theirs.defaults)) + [ast.literal_eval(d) for d in theirs.defaults]
    ours = list(inspect.signature(create_vllm_engines).parameters.values())
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default)
            for p in ours[: len(theirs.args)]] == [(a.arg, d) for a, d in zip(theirs.args, defaults)]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours[: len(theirs.args)])
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs.args):])


def test_launcher_rebinds_the_name_openrlhfs_cli_imports():
    """train_ppo_ray rebinds openrlhf.trainer.ray.create_vllm_engines: the package exports it and
    the CLI imports it by that name, then calls it in train()."""
    package = ast.parse(openrlhf_source("trainer/ray/__init__.py"))
    exported = next(n for n in package.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    assert "create_vllm_engines" in ast.literal_eval(exported.value)
    cli = ast.parse(openrlhf_source("cli/train_ppo_ray.py"))
    imports = [n for n in cli.body if isinstance(n, ast.ImportFrom) and n.module == "openrlhf.trainer.ray"]
    assert any(alias.name == "create_vllm_engines" and alias.asname is None for n in imports for alias in n.names)
    train = next(n for n in cli.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "create_vllm_engines" for c in ast.walk(train))


def test_engines_sleep_as_openrlhfs_do_and_cuda_ipc_is_refused_on_the_cpu(openrlhf_run):
    _, _, got = openrlhf_run
    assert bool(got["asleep_after_factory"])  # vllm_enable_sleep: the factory puts them to sleep
    assert bool(got["first_slept"]) and bool(got["second_slept"])  # the generator's sleep after each round
    assert "update_weight_cuda_ipc" in str(got["ipc_refusal"]) and "CPU" in str(got["ipc_refusal"])


def test_the_broadcast_changed_the_policy(openrlhf_run):
    v1 = openrlhf_run[1]
    _, _, got = openrlhf_run
    from safetensors import safe_open

    with safe_open(str(next(v1.glob("*.safetensors"))), "pt") as f:
        assert int(got["params_sent"]) == len(list(f.keys()))  # every tensor of the checkpoint, one call each
    assert [list(r) for r in got["first_response_ids"]] != [list(r) for r in got["second_response_ids"]]


def test_a_round_waiting_on_a_paused_engine_runs_on_the_weights_broadcast_meanwhile(openrlhf_run):
    """The async trainer's partial-rollout sync: pause (keep), the first checkpoint broadcast back
    while a round waits, resume: the round's actions are the first round's (checked against v0)."""
    _, _, got = openrlhf_run
    assert [list(r) for r in got["resumed_response_ids"]] == [list(r) for r in got["first_response_ids"]]


@pytest.mark.parametrize("which", ["first", "second"])
def test_rollouts_equal_r3srvs_own_api(openrlhf_run, which):
    """OpenRLHF's executor's actions and rollout_log_probs, and the engine's rows, before (v0) and
    after (v1) the broadcast."""
    v0, v1, got = openrlhf_run
    prompts = [list(map(int, p)) for p in got[f"{which}_prompt_ids"]]
    assert len(prompts) == len(loop.PROMPTS) * loop.N_SAMPLES and all(prompts)
    want = own(v0 if which == "first" else v1, prompts)
    assert_batch_equals_own(want, prompts, got[f"{which}_response_ids"], got[f"{which}_rows"],
                            got[f"{which}_logprobs"])

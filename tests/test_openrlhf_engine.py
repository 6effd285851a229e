"""r3srv.integrations.openrlhf from r3srv's side, without Ray or OpenRLHF: the rollout engine's
methods (those OpenRLHF 0.11.2's RolloutRayActor offers, openrlhf/trainer/ray/vllm_engine.py)
called as OpenRLHF calls them, against r3srv's own LLM on the same checkpoint (tokens, rows,
logprobs); vLLM's SamplingParams read by field name; the refusals; the launcher's arguments.
OpenRLHF's own code driving the engines on a Ray cluster: tests/test_openrlhf_rollout.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from engine_testing import prompt_ids
from tiny_checkpoints import write_tiny_checkpoint

import r3srv.compat.vllm as vllm
from r3srv import LLM, SamplingParams
from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.integrations.openrlhf.rollout import RolloutEngine, load_agent_executor, openrlhf_params
from r3srv.integrations.openrlhf.train_ppo_ray import split_engine_kwargs

pytestmark = pytest.mark.slow  # two engines on a tiny transformers checkpoint

ENGINE = dict(dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=32)
# OpenRLHF's factory's vLLM keywords (vllm_engine.py, create_vllm_engines' actor_kwargs)
OPENRLHF_KWARGS = dict(enforce_eager=False, worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap",
                       tensor_parallel_size=1, seed=0, distributed_executor_backend="uni", enable_prefix_caching=True,
                       trust_remote_code=True, full_determinism=False, gpu_memory_utilization=0.5,
                       enable_sleep_mode=True, logprobs_mode="processed_logprobs", max_logprobs=1)
PROMPTS = [prompt_ids(9, base=3), prompt_ids(5, base=70)]
PEER_FIELDS = json.loads((Path(__file__).parent / "data" / "peer_fields.json").read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("openrlhf") / "v0", seed=0)


@pytest.fixture(scope="module")
def engine(checkpoint):
    e = RolloutEngine(str(checkpoint), **{**OPENRLHF_KWARGS, **ENGINE})
    yield e
    e.shutdown()


def run(coro):
    return asyncio.run(coro)


def greedy(**extra):
    """samples_generator.py's _dispatch_prompts_to_vllm fields (greedy, rollout correction on)."""
    return vllm.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=5, min_tokens=1,
                               skip_special_tokens=False, logprobs=1, **extra)


def vllm_sampling_params_class():
    """A msgspec Struct with vLLM 0.33's SamplingParams field names (tests/data/peer_fields.json),
    each at r3srv.compat.vllm's default, plus one field r3srv does not know: what vLLM's own
    class looks like to code that reads it by name."""
    defaults = vllm.SamplingParams()
    fields = [(name, object, msgspec.field(default_factory=lambda n=name: getattr(defaults, n)))
              for name in PEER_FIELDS["classes"]["vllm.SamplingParams"]["fields"]]
    return msgspec.defstruct("SamplingParams", [*fields, ("logits_processors", object, None)], kw_only=True)


def test_generate_equals_r3srvs_own_api_with_rows(engine, checkpoint):
    """The agent executors' callback: token ids in, vLLM's RequestOutput out, routed experts on."""
    got = [run(engine.generate(p, greedy())) for p in PROMPTS]
    own = LLM(str(checkpoint), enable_return_routed_experts=True, logprobs_mode=OPENRLHF_KWARGS["logprobs_mode"],
              **ENGINE)
    try:
        want = own.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, min_tokens=1, logprobs=1))
    finally:
        own.shutdown()
    for g, w, p in zip(got, want, PROMPTS):
        c, o = g.outputs[0], w.outputs[0]
        assert list(c.token_ids) == list(o.token_ids)
        assert c.routed_experts.shape == (len(p) + len(c.token_ids) - 1, *o.routed_experts.shape[1:])
        np.testing.assert_array_equal(c.routed_experts, o.routed_experts)
        # OpenRLHF's executor reads logprob_dict.get(token_id).logprob
        assert [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] == pytest.approx(
            [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)], abs=1e-5)
    assert engine.get_num_unfinished_requests() == 0


def test_vllms_own_sampling_params_are_read_by_field_name(engine):
    cls = vllm_sampling_params_class()
    foreign = cls(temperature=0.0, top_k=-1, max_tokens=5, min_tokens=1, logprobs=1, output_kind=2)
    converted = openrlhf_params(foreign)
    assert isinstance(converted, vllm.SamplingParams)
    assert (converted.max_tokens, converted.logprobs, converted.output_kind) == (5, 1, vllm.RequestOutputKind.FINAL_ONLY)
    a = run(engine.generate(PROMPTS[0], foreign)).outputs[0]
    b = run(engine.generate(PROMPTS[0], greedy())).outputs[0]
    assert list(a.token_ids) == list(b.token_ids)
    with pytest.raises(InvalidRequestError) as exc:
        openrlhf_params(cls(logits_processors=["x"]))
    assert exc.value.param == "sampling_params.logits_processors"
    with pytest.raises(InvalidRequestError) as exc:
        openrlhf_params({"temperature": 0.0})
    assert exc.value.param == "sampling_params"


def test_openrlhfs_processed_logprobs_mode_reaches_the_engine(engine, checkpoint):
    """logprobs_mode=processed_logprobs (OpenRLHF's, with rollout correction): the sampled tokens'
    logprobs under the distribution they were drawn from, as r3srv's own LLM in that mode."""
    params = dict(temperature=0.8, top_k=5, top_p=0.9, max_tokens=5, logprobs=1, seed=3)
    got = run(engine.generate(PROMPTS[0], vllm.SamplingParams(**params))).outputs[0]
    own = LLM(str(checkpoint), logprobs_mode="processed_logprobs", **ENGINE)
    try:
        want = own.generate([PROMPTS[0]], SamplingParams(**params))[0].outputs[0]
    finally:
        own.shutdown()
    assert list(got.token_ids) == list(want.token_ids)
    assert [d[t].logprob for d, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
        [d[t].logprob for d, t in zip(want.logprobs, want.token_ids)], abs=1e-5)


def test_sleep_then_wake_one_tag_at_a_time(engine):
    run(engine.sleep())
    assert run(engine.is_sleeping())
    run(engine.wake_up(["weights"]))  # OpenRLHF wakes the weights for a sync, then the KV cache
    assert run(engine.is_sleeping())
    run(engine.wake_up(["kv_cache"]))
    assert not run(engine.is_sleeping())
    run(engine.sleep(level=1))
    run(engine.wake_up())
    assert not run(engine.is_sleeping())
    run(engine.pause_generation())
    run(engine.resume_generation())
    run(engine.reset_prefix_cache())
    assert run(engine.generate(PROMPTS[1], greedy())).outputs[0].finish_reason in ("stop", "length")


def test_refusals_name_what_r3srv_does_not_serve(engine, checkpoint):
    with pytest.raises(InvalidRequestError) as exc:
        run(engine.update_weight_cuda_ipc("lm_head.weight", "bfloat16", [1], {"gpu": None}))
    assert exc.value.param == "method" and "CPU" in str(exc.value)
    with pytest.raises(InvalidRequestError) as exc:
        run(engine.generate(PROMPTS[0], greedy(), multi_modal_data={"image": [object()]}))
    assert exc.value.param == "multi_modal_data"
    with pytest.raises(InvalidRequestError) as exc:  # OpenRLHF's update_weight before its group exists
        run(engine.update_weight("lm_head.weight", "float32", [1, 1]))
    assert "init_process_group" in str(exc.value)
    with pytest.raises(ConfigError, match="logprobs_mode"):
        RolloutEngine(str(checkpoint), logprobs_mode="processed_probs", **ENGINE)
    with pytest.raises(ConfigError, match="multimodal"):
        RolloutEngine(str(checkpoint), mm_pad_token_ids={151655}, **ENGINE)


def test_launcher_takes_r3srvs_engine_kwargs_out_of_openrlhfs_arguments():
    argv = ["--actor.model_name_or_path", "/ckpt", "--r3srv.engine_kwargs", '{"num_kv_blocks": 64}', "--vllm.num_engines",
            "2"]
    assert split_engine_kwargs(argv) == ({"num_kv_blocks": 64}, ["--actor.model_name_or_path", "/ckpt",
                                                                 "--vllm.num_engines", "2"])
    assert split_engine_kwargs(['--r3srv.engine_kwargs={"seed": 3}', "--x"]) == ({"seed": 3}, ["--x"])
    with pytest.raises(SystemExit):
        split_engine_kwargs(["--r3srv.engine_kwargs", "[1]"])


def test_agent_func_path_is_loaded_and_checked_as_openrlhf_checks_it(tmp_path, monkeypatch):
    """--train.agent_func_path: a Python file whose AgentExecutor subclasses OpenRLHF's
    AgentExecutorBase (a stand-in module here: OpenRLHF is not in r3srv's environment)."""
    (tmp_path / "agent_base.py").write_text("class AgentExecutorBase:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from agent_base import AgentExecutorBase

    good = tmp_path / "agent.py"
    good.write_text("from agent_base import AgentExecutorBase\n\n"
                    "class AgentExecutor(AgentExecutorBase):\n    loaded_from = __file__\n")
    executor = load_agent_executor(str(good), AgentExecutorBase)
    assert isinstance(executor, AgentExecutorBase) and executor.loaded_from == str(good)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("class AgentExecutor:\n    pass\n")
    with pytest.raises(ConfigError, match="AgentExecutorBase"):
        load_agent_executor(str(wrong), AgentExecutorBase)
    with pytest.raises(ConfigError, match="Python file"):
        load_agent_executor(str(tmp_path / "agent.txt"), AgentExecutorBase)

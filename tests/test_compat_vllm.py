"""r3srv.compat.vllm's offline LLM: code written for vLLM's LLM (OpenRLHF's rollout actors,
NeMo-RL's and ROLL's vLLM workers) against r3srv's engine. The oracle is r3srv's own LLM on the
same checkpoint: tokens, logprobs and rows through the compat layer equal those through r3srv's
API; weights pushed through collective_rpc serve as the same checkpoint loaded from disk."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
import weight_sync_trainer as trainer
from server_fixture import free_port
from tiny_checkpoints import write_tiny_checkpoint

import r3srv.compat.vllm as vllm
from engine_testing import GREEDY, prompt_ids
from r3srv import LLM as R3srvLLM
from r3srv import SamplingParams as R3srvSamplingParams
from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.outputs import SamplingMasks

pytestmark = pytest.mark.slow  # engines on tiny transformers checkpoints, a trainer process

ENGINE = dict(max_model_len=128, num_kv_blocks=64, device="cpu")
PROMPTS = [prompt_ids(12, base=3), prompt_ids(7, base=40)]
PEER_FIELDS = json.loads((Path(__file__).parent / "data" / "peer_fields.json").read_text())


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat-policies")
    return write_tiny_checkpoint(root / "v0", seed=0), write_tiny_checkpoint(root / "v1", seed=1)


@pytest.fixture(scope="module")
def llm(policies):
    return vllm.LLM(str(policies[0]), enable_return_routed_experts=True, gpu_memory_utilization=0.5,
                    trust_remote_code=True, enable_sleep_mode=True, **ENGINE)


def own(path, prompts, params) -> list:
    """r3srv's own API on a fresh engine: the oracle."""
    return R3srvLLM(str(path), **ENGINE).generate(prompts, params)


def served(llm, prompts, **params) -> list:
    return llm.generate(prompts, vllm.SamplingParams(**params))


def same(a, b) -> bool:
    return all(x.outputs[0].token_ids == y.outputs[0].token_ids
               and np.array_equal(x.outputs[0].routed_experts, y.outputs[0].routed_experts) for x, y in zip(a, b))


def test_vllm_prompt_forms_give_r3srv_own_tokens_rows_and_logprobs(llm, policies):
    params = dict(max_tokens=6, logprobs=2, seed=7, temperature=0.8)
    want = own(policies[0], PROMPTS, R3srvSamplingParams(**params))
    forms = [
        [{"prompt_token_ids": p} for p in PROMPTS],
        [vllm.TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        PROMPTS,
    ]
    for prompts in forms:
        got = served(llm, prompts, **params)
        assert same(got, want)
        for g, w in zip(got, want):
            c = g.outputs[0]
            assert c.logprobs == w.outputs[0].logprobs
            # the read every framework makes (verl's vllm_async_server, OpenRLHF, NeMo-RL, ROLL)
            sampled = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
            assert c.cumulative_logprob == pytest.approx(sum(sampled))
            assert all(next(iter(entry)) == t for entry, t in zip(c.logprobs, c.token_ids))
            assert c.routed_experts.shape == (len(g.prompt_token_ids) + len(c.token_ids) - 1, *c.routed_experts.shape[1:])
    one = llm.generate(vllm.TokensPrompt(prompt_token_ids=PROMPTS[0]), vllm.SamplingParams(max_tokens=6, **GREEDY))
    assert len(one) == 1 and one[0].prompt_token_ids == PROMPTS[0]


def test_every_vllm_sampling_field_is_taken_at_its_default_and_refused_on_when_unserved():
    fields = PEER_FIELDS["classes"]["vllm.SamplingParams"]["fields"]
    params = vllm.SamplingParams()
    assert all(hasattr(params, name) for name in fields)  # vLLM code may read any of them
    vllm.SamplingParams(output_kind=vllm.RequestOutputKind.DELTA, extra_args={"kv_transfer_params": None},
                        bad_words=[], detokenize=True, stream_interval=1, allowed_token_ids=None)
    for name, value in [("bad_words", ["no"]), ("allowed_token_ids", [1, 2]), ("structured_outputs", {"json": {}}),
                        ("logprob_token_ids", [3]), ("stream_interval", 4), ("flat_logprobs", True)]:
        with pytest.raises(InvalidRequestError) as exc:
            vllm.SamplingParams(**{name: value})
        assert exc.value.param == name
    with pytest.raises(InvalidRequestError) as exc:
        vllm.SamplingParams(output_kind=7)
    assert exc.value.param == "output_kind"
    clone = vllm.SamplingParams(max_tokens=3, stop=["x"]).clone()
    clone.stop.append("y")
    assert clone.stop == ["x", "y"]


def test_generate_refuses_lora_priority_multimodal_and_unknown_engine_arguments(llm):
    p = vllm.SamplingParams(max_tokens=2)
    assert llm.generate(PROMPTS[0], p, lora_request=None, priority=[0])[0].outputs[0].token_ids
    for kwargs, param in [({"lora_request": object()}, "lora_request"), ({"priority": [2]}, "priority")]:
        with pytest.raises(InvalidRequestError) as exc:
            llm.generate(PROMPTS[0], p, **kwargs)
        assert exc.value.param == param
    with pytest.raises(InvalidRequestError, match="takes no image inputs") as exc:  # a text-only model
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [1]}}, p)
    assert exc.value.param == "multi_modal_data"
    with pytest.raises(ConfigError, match="swap_blocks"):
        vllm.EngineArgs("m", swap_blocks=3)
    with pytest.raises(ConfigError, match="quantization"):
        vllm.EngineArgs("m", quantization="fp8")
    assert vllm.EngineArgs("m", gpu_memory_utilization=0.3, max_model_len=64).create_engine_config().options[
        "max_model_len"] == 64


def test_model_config_tokenizer_and_unfinished_requests(llm):
    assert llm.llm_engine.model_config.max_model_len == ENGINE["max_model_len"]
    tok = llm.get_tokenizer()
    assert tok.decode(tok.encode("abc", add_special_tokens=False)) == "abc"
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_tensor_buckets_through_collective_rpc_serve_the_pushed_policy(llm, policies):
    v0, v1 = policies
    want = {v: own(v, PROMPTS, R3srvSamplingParams(max_tokens=6, **GREEDY)) for v in policies}
    tensors = list(trainer.checkpoint_tensors(v1).items())
    half = len(tensors) // 2
    staged = llm.collective_rpc("update_weights_from_tensors", args=(tensors[:half],))
    assert len(staged) == 1 and "staged" in staged[0]
    assert same(served(llm, PROMPTS, max_tokens=6, **GREEDY), want[v0])  # a partial bucket changes nothing
    llm.collective_rpc("update_weights_from_tensors", kwargs={"named_tensors": dict(tensors[half:])})
    assert same(served(llm, PROMPTS, max_tokens=6, **GREEDY), want[v1])
    llm.collective_rpc("update_weights_from_tensors", args=(trainer.checkpoint_tensors(v0),))
    assert same(served(llm, PROMPTS, max_tokens=6, **GREEDY), want[v0])


def test_openrlhf_per_tensor_broadcast_serves_the_pushed_policy(llm, policies):
    """OpenRLHF's worker calls (init_process_group, then update_weight per tensor) with a trainer
    process broadcasting each tensor from rank 0 of a gloo group."""
    v0, v1 = policies
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    pusher = ctx.Process(target=trainer.broadcast_checkpoint, args=(port, 2, v1))
    pusher.start()
    try:
        # OpenRLHF's positional arguments; a CPU engine takes gloo (--vllm_sync_backend gloo), NCCL is refused
        with pytest.raises(InvalidRequestError) as refused:
            llm.collective_rpc("init_process_group", args=("127.0.0.1", port, 1, 2, trainer.GROUP, "nccl", False))
        assert refused.value.param == "backend"
        llm.collective_rpc("init_process_group", args=("127.0.0.1", port, 1, 2, trainer.GROUP, "gloo", False))
        for name, tensor in trainer.checkpoint_tensors(v1).items():
            llm.collective_rpc("update_weight", args=(name, tensor.dtype, tensor.shape, False))
        pusher.join(120)
        assert pusher.exitcode == 0
        assert same(served(llm, PROMPTS, max_tokens=6, **GREEDY), own(v1, PROMPTS, R3srvSamplingParams(max_tokens=6,
                                                                                                         **GREEDY)))
    finally:
        if pusher.is_alive():
            pusher.kill()
        llm.collective_rpc("destroy_weights_update_group", kwargs={"group_name": trainer.GROUP})
        llm.collective_rpc("update_weights_from_tensors", args=(trainer.checkpoint_tensors(v0),))


@pytest.mark.parametrize("method, args, param", [
    ("apply_model", (), "method"),  # a framework's worker-extension method: not in the table
    (print, (), "method"),  # vLLM takes callables; r3srv never calls one
    ("init_process_group", ("127.0.0.1", 1, 1, 2, "g", "nccl", True), "use_ray"),
    ("update_weight_cuda_ipc", ("w", torch.float32, [2], {"0": (print, ())}), "method"),  # CPU: no IPC
    ("update_weight", ("w", torch.float32, [2], False, "extra"), "args"),
    ("update_weights_from_tensors", ([("w", [1.0])],), "named_tensors"),
])
def test_collective_rpc_answers_its_table_only(llm, method, args, param):
    with pytest.raises(InvalidRequestError) as exc:
        llm.collective_rpc(method, args=args)
    assert exc.value.param == param


def test_sleep_releases_and_wake_up_takes_back_by_tag(llm, policies):
    want = served(llm, PROMPTS, max_tokens=6, **GREEDY)
    llm.sleep(level=1)
    assert llm.is_sleeping() and llm.r3srv.engine.released_memory == {"kv_cache", "weights"}
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and llm.r3srv.engine.released_memory == {"kv_cache"}
    llm.wake_up(["kv_cache", "scheduling"])
    assert not llm.is_sleeping()
    assert same(served(llm, PROMPTS, max_tokens=6, **GREEDY), want)
    with pytest.raises(InvalidRequestError) as exc:
        llm.wake_up(["nothing"])
    assert exc.value.param == "tags"


def test_num_preempted_counts_each_samples_preemptions():
    """A KV pool too small for every sequence at once: the scheduler preempts; each sample says
    how often it was, and they add up to the engine's count."""
    llm = vllm.LLM(None, max_model_len=32, num_kv_blocks=10, block_size=4, device="cpu")
    prompts = [prompt_ids(9, base=b) for b in range(1, 6)]
    outs = llm.generate(prompts, vllm.SamplingParams(max_tokens=12, **GREEDY))
    counts = [o.outputs[0].num_preempted for o in outs]
    assert sum(counts) == llm.r3srv.stats().num_preemptions > 0


def assert_vllm_masks(token_ids, mask, oracle) -> None:
    """vLLM's form: mask.token_ids, one list of ids per generated token, ascending and holding
    the token drawn (what NeMo-RL's vLLM worker pads to [tokens, top_k]), row for row r3srv's
    own SamplingMasks (ids and logprobs)."""
    assert len(mask.token_ids) == len(mask.logprobs) == len(token_ids) == len(oracle.sampling_mask)
    for i, (ids, token) in enumerate(zip(mask.token_ids, token_ids)):
        want_ids, want_logprobs = oracle.sampling_mask.row(i)
        assert ids == want_ids.tolist() and mask.logprobs[i] == want_logprobs.tolist(), i
        assert token in ids and ids == sorted(ids) and all(type(t) is int for t in ids), i


def test_sampling_masks_come_one_list_per_token_as_vllm_gives_them(policies):
    params = dict(max_tokens=6, temperature=1.0, top_k=6, top_p=0.9, seed=11)
    compat = vllm.LLM(str(policies[0]), return_sampling_mask=True, **ENGINE)
    got = compat.generate(PROMPTS, vllm.SamplingParams(**params))
    oracle = R3srvLLM(str(policies[0]), return_sampling_mask=True, **ENGINE)
    want = oracle.generate(PROMPTS, R3srvSamplingParams(**params))
    assert any(len(ids) > 1 for out in got for ids in out.outputs[0].sampling_mask.token_ids)  # not all greedy-like
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert_vllm_masks(g.outputs[0].token_ids, g.outputs[0].sampling_mask, w.outputs[0])
    # r3srv's own API keeps its CSR form: the compat layer converts copies
    again = oracle.generate(PROMPTS[:1], R3srvSamplingParams(**params))[0].outputs[0]
    assert isinstance(again.sampling_mask, SamplingMasks)
    # vLLM's class, built as vLLM's own tests build it (positionally), from the module mirroring vllm.outputs
    from r3srv.compat.vllm.outputs import SamplingMask

    mask = got[0].outputs[0].sampling_mask
    assert mask == SamplingMask(list(mask.token_ids), list(mask.logprobs)) != SamplingMask([[0]], [[0.0]])

"""The offline engine on the built-in model: row counts, validation, prefix cache, preemption,
n > 1, stop trimming, abort, and rows equal to an independent recomputation of the router."""

import random

import numpy as np
import pytest
import torch
from tiny_checkpoints import BOS_TEMPLATE_ID, make_bos_adding_chat_checkpoint

from engine_testing import GREEDY, model_of, one_torch_thread, prompt_ids, recording_routers, run_with_aborts  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, max_num_seqs=16)


def rows_shape(llm: LLM, out, start: int = 0) -> tuple[int, int, int]:
    info = llm.routed_experts_info
    return (len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1 - start, info["num_layers"], info["top_k"])


def test_rows_have_one_row_per_token_but_the_last_for_several_starts(llm):
    prompts = [prompt_ids(3, 1), "hello world", prompt_ids(21, 2)]
    full = llm.generate(prompts, SamplingParams(max_tokens=9, **GREEDY))
    for out in full:
        arr = out.outputs[0].routed_experts
        assert arr.shape == rows_shape(llm, out) and arr.dtype == np.uint8
        assert len(out.outputs[0].token_ids) == 9 and out.outputs[0].finish_reason == "length"
        assert arr.max() < 64
        # every token picks 8 distinct experts at every (MoE) layer
        assert all(len(set(r)) == 8 for r in arr.reshape(-1, 8).tolist())
    # Every start for every prompt, in one batch.
    cases = [(out, prompt, start) for out, prompt in zip(full, prompts)
             for start in sorted({0, 1, len(out.prompt_token_ids) // 2, len(out.prompt_token_ids)})]
    again = llm.generate(
        [prompt for _, prompt, _ in cases],
        [SamplingParams(max_tokens=9, routed_experts_prompt_start=start, **GREEDY) for _, _, start in cases],
    )
    for (out, _, start), res in zip(cases, again):
        arr = res.outputs[0].routed_experts
        assert arr.shape == rows_shape(llm, res, start)
        assert res.outputs[0].token_ids == out.outputs[0].token_ids
        np.testing.assert_array_equal(arr, out.outputs[0].routed_experts[start:])
    assert again[-1].outputs[0].routed_experts.shape[0] == 8  # start = len(prompt): the output's rows only


@pytest.mark.parametrize("start", [-1, 4, 100])
def test_bad_start_is_rejected_before_anything_is_scheduled(llm, start):
    before = llm.stats()
    good = SamplingParams(max_tokens=4)
    if start < 0:  # SamplingParams itself refuses a negative offset
        with pytest.raises(ValueError, match="routed_experts_prompt_start"):
            SamplingParams(routed_experts_prompt_start=start)
        return
    bad = SamplingParams(max_tokens=4, routed_experts_prompt_start=start)
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([prompt_ids(5), prompt_ids(3)], [good, bad])
    assert exc.value.param == "routed_experts_prompt_start"
    assert f"routed_experts_prompt_start={start}" in str(exc.value) and "3 tokens" in str(exc.value)
    after = llm.stats()
    # The good request was not scheduled either: no lookups, nothing queued.
    assert after.prefix_cache_queries == before.prefix_cache_queries
    assert after.num_waiting == after.num_running == 0 and not llm.engine.requests


def test_length_checks_name_the_field(llm):
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([prompt_ids(250)], SamplingParams(max_tokens=10))
    assert exc.value.param == "max_tokens" and "max_model_len=256" in str(exc.value)
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([prompt_ids(256)], SamplingParams(max_tokens=1))
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([[]], SamplingParams(max_tokens=1))
    assert exc.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=1))
    assert exc.value.param == "prompt" and "vocabulary" in str(exc.value)
    # max_tokens=None: up to the context length
    out = llm.generate([prompt_ids(250)], SamplingParams(max_tokens=None, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_per_request_opt_out_returns_no_rows(llm):
    out = llm.generate([prompt_ids(4)], SamplingParams(max_tokens=3, return_routed_experts=False))[0]
    assert out.outputs[0].routed_experts is None and len(out.outputs[0].token_ids) == 3


def test_prefix_cache_hit_returns_identical_rows(llm):
    prompt = prompt_ids(45, base=11)  # two full blocks of 16 can be reused
    params = SamplingParams(max_tokens=12, **GREEDY)
    cold = llm.generate([prompt], params)[0]
    hits_before = llm.stats().prefix_cache_hits
    warm = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 32
    assert llm.stats().prefix_cache_hits - hits_before == 32
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_array_equal(warm.outputs[0].routed_experts, cold.outputs[0].routed_experts)
    # A longer prompt sharing the prefix also hits, and its shared rows are the same.
    longer = llm.generate([prompt + prompt_ids(20, base=3)], params)[0]
    assert longer.num_cached_tokens >= 32
    np.testing.assert_array_equal(longer.outputs[0].routed_experts[:44], cold.outputs[0].routed_experts[:44])


@pytest.mark.slow  # long generations under a tight pool
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_forced_preemption_gives_identical_rows(llm, prefix_caching):
    prompts = [prompt_ids(10 + i, base=20 + i) for i in range(4)]
    params = SamplingParams(max_tokens=30, **GREEDY)
    roomy = llm.generate(prompts, params)
    # 4 sequences of up to 43 tokens need 4 * 11 blocks of 4; give them 14.
    tight = LLM(
        block_size=4, num_kv_blocks=14, max_model_len=48, enable_prefix_caching=prefix_caching, max_num_seqs=4
    )
    outs = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0
    for a, b in zip(roomy, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_array_equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)


def test_n_samples_each_get_their_own_full_array(llm):
    prompt = prompt_ids(37, base=5)
    greedy = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))[0]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=123, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    tokens = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(tokens)) > 1  # different samples
    for c in out.outputs:
        assert c.routed_experts.shape == (len(prompt) + len(c.token_ids) - 1, 4, 8)
        # the prompt's rows are the same for every sample (and as in a greedy run)
        np.testing.assert_array_equal(c.routed_experts[: len(prompt) - 1], greedy.outputs[0].routed_experts[: len(prompt) - 1])
    # Seeded: the same request again gives the same samples.
    again = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=123, ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in again.outputs] == tokens
    for a, b in zip(out.outputs, again.outputs):
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_trims_tokens_text_and_rows(llm, include):
    prompt = prompt_ids(6, base=9)
    full = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    text = full.text
    assert len(text) == 30  # one byte per token for this ASCII walk
    stop = text[10:13]
    cut = text.find(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=include, **GREEDY))[0]
    c = out.outputs[0]
    kept = cut + len(stop) if include else cut
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:kept]
    assert c.token_ids == full.token_ids[:kept]
    np.testing.assert_array_equal(c.routed_experts, full.routed_experts[: len(prompt) + kept - 1])


def test_stop_token_id_ends_the_sequence_and_keeps_the_token(llm):
    prompt = prompt_ids(6, base=4)
    full = llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    c = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_id], **GREEDY))[0].outputs[0]
    assert c.token_ids == full.token_ids[: first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.routed_experts.shape[0] == len(prompt) + first


def test_logprobs_and_cumulative_logprob(llm):
    c = llm.generate([prompt_ids(5)], SamplingParams(max_tokens=6, logprobs=2, **GREEDY))[0].outputs[0]
    assert len(c.logprobs) == 6
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert next(iter(lp)) == tok and len(lp) <= 3  # the sampled token first, as vLLM's
        assert lp[tok].logprob == max(x.logprob for x in lp.values()) and lp[tok].rank == 1  # greedy: the most likely
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))


def test_abort_returns_every_block(llm):
    engine = llm.engine
    total = llm.stats().kv_blocks_total
    for i in range(3):
        engine.add_request(f"abort-{i}", prompt_ids(40, base=i), SamplingParams(max_tokens=50, n=2, **GREEDY))
    for _ in range(4):
        engine.step()
    assert llm.stats().kv_blocks_used > 0
    for i in range(3):
        final = engine.abort_request(f"abort-{i}")
        assert final.finished and all(c.finish_reason == "abort" for c in final.outputs)
    stats = llm.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_total == total
    assert stats.num_running == stats.num_waiting == 0 and not engine.has_unfinished()
    assert engine.abort_request("abort-0") is None


def test_rows_equal_an_independent_recomputation_of_the_router(llm):
    """Record every router's logits during the forward passes, recompute top-k ourselves
    (descending, ties to the lower id), and compare with the rows the engine returned."""
    recorded: list[torch.Tensor] = []
    prompt = prompt_ids(19, base=77)  # unique: no prefix-cache hit, one sequence per step
    with recording_routers(model_of(llm), recorded):
        out = llm.generate([prompt], SamplingParams(max_tokens=7, **GREEDY))[0]
    arr = out.outputs[0].routed_experts
    num_layers, top_k = 4, 8
    assert len(recorded) % num_layers == 0
    per_layer = [torch.cat(recorded[layer::num_layers]) for layer in range(num_layers)]
    expected = np.stack(
        [torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k].numpy() for logits in per_layer],
        axis=1,
    )
    assert expected.shape == arr.shape  # one routed token per row: 19 prompt + 6 decoded
    np.testing.assert_array_equal(arr, expected.astype(np.uint8))


def test_engine_without_capture_rejects_return_routed_experts():
    llm = LLM(enable_return_routed_experts=False, max_model_len=64)
    assert llm.routed_experts_info is None
    out = llm.generate([prompt_ids(4)], SamplingParams(max_tokens=2))[0]
    assert out.outputs[0].routed_experts is None
    with pytest.raises(InvalidRequestError, match="--enable-return-routed-experts") as exc:
        llm.generate([prompt_ids(4)], SamplingParams(max_tokens=2, return_routed_experts=True))
    assert exc.value.param == "return_routed_experts"


def test_chat_renders_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.slow  # a checkpoint made through transformers
def test_a_chat_prompt_gets_the_templates_bos_only(tmp_path):
    """Templates that write the BOS (Mixtral's `{{ bos_token }}[INST]...`) with a tokenizer
    that also adds one: the rendered chat is encoded without special tokens, as HF's
    apply_chat_template(tokenize=True) and vLLM do; a doubled BOS would shift every row."""
    path = make_bos_adding_chat_checkpoint(tmp_path / "ckpt")
    bos = BOS_TEMPLATE_ID
    llm = LLM(str(path), max_model_len=64)
    params = SamplingParams(max_tokens=2, **GREEDY)
    chat = llm.chat([{"role": "user", "content": "hi"}], params)[0]
    assert chat.prompt_token_ids == [bos, *b"[INST] hi [/INST]"]
    assert chat.outputs[0].routed_experts.shape[0] == len(chat.prompt_token_ids) + 1
    # A plain text prompt still gets the tokenizer's own BOS (as HF's encode does).
    assert llm.generate("hi", params)[0].prompt_token_ids == [bos, *b"hi"]


def test_chunked_prefill_gives_the_same_tokens_and_rows(llm):
    prompts = [prompt_ids(50, base=31), prompt_ids(23, base=32)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    ref = llm.generate(prompts, params)
    chunked = LLM(max_model_len=256, max_num_batched_tokens=7, enable_prefix_caching=False)
    outs = chunked.generate(prompts, params)
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_array_equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)


def test_stop_trimming_keeps_logprobs_consistent(llm):
    prompt = prompt_ids(6, base=9)
    full = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    stop = full.text[12:14]
    c = llm.generate([prompt], SamplingParams(max_tokens=30, stop=stop, logprobs=1, **GREEDY))[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) < 30
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))


@pytest.mark.gpu
def test_cuda_engine_rows_match_across_prefix_hits_and_seeds():
    # float32: the warm run computes the prompt's tail in a different batch shape, and in
    # bfloat16 a last-bit difference flips near-tie router picks often (docs/architecture.md: floating
    # point is not batch-invariant); in float32 such ties are as rare as on the CPU.
    gpu = LLM(device="cuda", dtype="float32", max_model_len=256)
    prompt = prompt_ids(40, base=3)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, n=2, ignore_eos=True)
    a = gpu.generate([prompt], params)[0]
    b = gpu.generate([prompt], params)[0]
    assert b.num_cached_tokens > 0
    for x, y in zip(a.outputs, b.outputs):
        assert x.token_ids == y.token_ids
        assert x.routed_experts.shape == (len(prompt) + 16 - 1, 4, 8)
        np.testing.assert_array_equal(x.routed_experts, y.routed_experts)
    assert gpu.stats().kv_blocks_used == 0


@pytest.mark.gpu
def test_cuda_engine_in_bfloat16_returns_full_rows_and_frees_blocks():
    gpu = LLM(device="cuda", max_model_len=256)  # dtype "auto": the checkpoint's bfloat16
    assert gpu.engine.model.dtype == torch.bfloat16
    prompt = prompt_ids(40, base=3)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, n=2, ignore_eos=True)
    for out in gpu.generate([prompt, prompt], params):
        for c in out.outputs:
            assert len(c.token_ids) == 16 and c.routed_experts.shape == (len(prompt) + 16 - 1, 4, 8)
            assert all(len(set(r)) == 8 for r in c.routed_experts.reshape(-1, 8).tolist())
    assert gpu.stats().kv_blocks_used == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 5])
def test_n_samples_with_and_without_prefix_caching(max_tokens, prefix_caching):
    llm = LLM(max_model_len=128, enable_prefix_caching=prefix_caching)
    prompt = prompt_ids(21, base=8)
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=max_tokens, temperature=1.0, seed=9, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert len(c.token_ids) == max_tokens
        assert c.routed_experts.shape == (len(prompt) + max_tokens - 1, 4, 8)
        np.testing.assert_array_equal(c.routed_experts[:20], out.outputs[0].routed_experts[:20])
    assert llm.stats().kv_blocks_used == 0


def test_single_prompt_forms_and_min_tokens_check(llm):
    params = SamplingParams(max_tokens=3, **GREEDY)
    by_list = llm.generate(prompt_ids(5), params)  # one prompt given as a bare list of ids
    by_numpy = llm.generate(np.array(prompt_ids(5)), params)
    by_np_ints = llm.generate(list(np.array(prompt_ids(5))), params)
    assert len(by_list) == len(by_numpy) == len(by_np_ints) == 1
    assert by_list[0].outputs[0].token_ids == by_numpy[0].outputs[0].token_ids == by_np_ints[0].outputs[0].token_ids
    text = llm.generate("abc", params)
    assert len(text) == 1 and text[0].prompt_token_ids == [97, 98, 99]
    assert llm.generate([], params) == []
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate("abc", SamplingParams(max_tokens=2, min_tokens=3))
    assert exc.value.param == "min_tokens"


def test_partial_prefix_hit_after_eviction_gives_identical_rows():
    small = LLM(block_size=4, num_kv_blocks=20, max_model_len=64)
    a = prompt_ids(30, base=41)
    params = SamplingParams(max_tokens=8, **GREEDY)
    cold = small.generate([a], params)[0]
    # Another request takes 15 blocks: the 10 never used, then 5 of a's freed blocks (tail first).
    small.generate([prompt_ids(40, base=42)], SamplingParams(max_tokens=20, **GREEDY))
    warm = small.generate([a], params)[0]
    assert 0 < warm.num_cached_tokens < 28  # only a's leading blocks survived
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    np.testing.assert_array_equal(warm.outputs[0].routed_experts, cold.outputs[0].routed_experts)


@pytest.mark.slow  # two engines over a mixed workload
def test_a_mixed_workload_under_a_tight_pool_matches_a_roomy_engine():
    """Chunked prefill, prefix hits, preemption, n=2, stop strings, prompt starts and aborts,
    all at once: every output's tokens and rows equal an engine that needs none of them."""
    rng = random.Random(9)  # 5 requests with n=2, 8 with a stop string; 8 preemptions, 400 cached tokens
    shared = prompt_ids(60)
    prompts, params = [], []
    for _ in range(14):
        prompt = shared[: rng.choice([0, 8, 17, 33, 40])] + [32 + rng.randrange(90) for _ in range(rng.randint(1, 20))]
        kw = dict(max_tokens=rng.randint(1, 20), ignore_eos=True, routed_experts_prompt_start=rng.randint(0, len(prompt)))
        kw.update(dict(n=2, temperature=1.0, seed=rng.randrange(1000)) if rng.random() < 1 / 3 else dict(temperature=0.0))
        if rng.random() < 0.3:
            kw["stop"] = [chr(32 + rng.randrange(90))]
        prompts.append(prompt)
        params.append(SamplingParams(**kw))
    roomy = LLM(max_model_len=128, enable_prefix_caching=False, max_num_seqs=64).generate(prompts, params)
    tight = LLM(max_model_len=128, block_size=4, num_kv_blocks=32, max_num_batched_tokens=11, max_num_seqs=8)
    requests = {f"r{i}": (prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))}
    # requests sharing the prefix, aborted mid-flight
    aborted = {f"x{j}": (shared[:30] + [40 + j] * 5, SamplingParams(max_tokens=40, **GREEDY)) for j in range(3)}
    finished = run_with_aborts(tight.engine, requests, aborted, abort_at_step=15)
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_blocks_used == 0
    for i, want in enumerate(roomy):
        got = finished[f"r{i}"]
        assert len(got.outputs) == len(want.outputs)
        for a, b in zip(want.outputs, got.outputs):
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
            np.testing.assert_array_equal(b.routed_experts, a.routed_experts)


def perturbed_builtin_copy(path) -> str:
    """The built-in checkpoint with its router gates and expert weights scaled (other routing,
    other tokens), written without transformers so that the GPU machine can run it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from r3srv.models.builtin import builtin_model_dir

    src = builtin_model_dir()
    shutil.copytree(src, path)
    shard = next(path.glob("*.safetensors"))
    tensors = load_file(shard)
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if "gate" in name or "experts" in name:
            tensors[name] = (t.float() * (1 + 0.5 * torch.rand(t.shape, generator=g))).to(t.dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.slow  # the built-in checkpoint written and loaded twice
def test_weight_update_on_the_builtin_model(device, tmp_path):
    new_weights = perturbed_builtin_copy(tmp_path / "step1")
    kwargs = dict(device=device, dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompt = prompt_ids(40, base=6)
    llm = LLM(**kwargs)
    before = llm.generate([prompt], params)[0].outputs[0]
    llm.update_weights(new_weights, weight_version="step1")
    after = llm.generate([prompt], params)[0]
    want = LLM(new_weights, **kwargs).generate([prompt], params)[0].outputs[0]
    assert after.weight_version == "step1" and after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == want.token_ids
    np.testing.assert_array_equal(after.outputs[0].routed_experts, want.routed_experts)
    assert not np.array_equal(before.routed_experts, want.routed_experts)  # the update changed the routing


@pytest.mark.gpu
def test_cuda_unseeded_and_top_p_sampling_in_one_batch():
    """Unseeded rows draw together from the engine's CUDA generator, top-p rows filter in one
    batched sort, a seeded row draws from its own generator: all in one step."""
    gpu = LLM(device="cuda", max_model_len=256)
    prompt = prompt_ids(20, base=4)
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, n=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_p=0.8, top_k=20, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True),
    ]
    outs = gpu.generate([prompt] * 3, params)
    for out in outs:
        for c in out.outputs:
            assert len(c.token_ids) == 12 and all(0 <= t < gpu.model_config.vocab_size for t in c.token_ids)
    # (not compared with a run alone: bfloat16 logits change with the batch shape on a GPU)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # the n=3 samples differ
    assert gpu.stats().kv_blocks_used == 0

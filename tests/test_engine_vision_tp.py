"""Image prompts under tensor parallelism on CPU ranks (gloo, 2 ranks): the vision tower runs
whole on rank 0 and its outputs travel with the step's inputs; tokens and every position's
routed experts equal transformers' for the three families. And the step packet carries M-RoPE
ids and image embeddings (float32, bfloat16) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv import LLM
from r3srv.engine.step_channel import pack_batch, unpack_batch
from r3srv.lora.slots import LoraBatch
from r3srv.models.batch import ForwardBatch, VisualRows
from test_engine_vision import NEW_TOKENS, greedy, picture, text, with_placeholders
from vision_testing import FAMILIES, IMAGE_TOKEN, hf_greedy, write_vision_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # worker processes, transformers oracles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_packet_carries_image_inputs_exactly(dtype):
    g = torch.Generator().manual_seed(3)
    t = 7
    batch = ForwardBatch(
        input_ids=torch.arange(t), positions=torch.arange(t), slot_mapping=torch.arange(t), query_lens=[t],
        context_lens=[t], block_tables=torch.zeros(1, 2, dtype=torch.int64), logits_indices=torch.tensor([t - 1]),
        mrope_positions=torch.randint(0, 50, (3, t), generator=g),
        visual=VisualRows(torch.tensor([2, 3, 4]), torch.randn(3, 5, generator=g).to(dtype),
                          [torch.randn(3, 5, generator=g).to(dtype) for _ in range(2)]),
        lora=LoraBatch.of_token_slots(torch.tensor([1, 1, -1, -1, 0, 0, 0]), torch.device("cpu")))  # and adapters
    got = unpack_batch(list(pack_batch(batch)[0]), pack_batch(batch)[1])
    assert torch.equal(got.lora.token_slots, batch.lora.token_slots)
    assert torch.equal(got.mrope_positions, batch.mrope_positions)
    assert torch.equal(got.visual.rows, batch.visual.rows)
    for ours, sent in zip([got.visual.embeds, *got.visual.deepstack], [batch.visual.embeds, *batch.visual.deepstack]):
        assert torch.equal(ours.to(dtype), sent)
    plain = ForwardBatch(input_ids=torch.arange(t), positions=torch.arange(t), slot_mapping=torch.arange(t),
                         query_lens=[t], context_lens=[t], block_tables=torch.zeros(1, 2, dtype=torch.int64),
                         logits_indices=torch.tensor([t - 1]))
    back = unpack_batch(list(pack_batch(plain)[0]), pack_batch(plain)[1])
    assert back.mrope_positions is None and back.visual is None and back.lora is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_image_prompts_under_tp2_match_transformers(family, tmp_path):
    hf, processor = write_vision_checkpoint(transformers, family, tmp_path)
    llm = LLM(str(tmp_path), block_size=4, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=24,
              tensor_parallel_size=2, dtype="float32")
    try:
        assert llm.engine.runner.encoder is not None
        images = [[picture(0)], [picture(1), picture(6)]]
        prompts = [{"prompt_token_ids": with_placeholders(text(5, 1), 0, text(3, 2)), "multi_modal_data": {"image": images[0]}},
                   {"prompt_token_ids": with_placeholders(text(2, 3), 0, text(2, 4), 1), "multi_modal_data": {"image": images[1]}}]
        for out, pictures in zip(llm.generate(prompts, greedy(logprobs=False)), images):
            tokens, _, rows = hf_greedy(hf, out.prompt_token_ids, pictures, processor, IMAGE_TOKEN, NEW_TOKENS)
            assert out.outputs[0].token_ids == tokens
            for layer, want in rows.items():
                assert np.array_equal(out.outputs[0].routed_experts[:, layer], want.numpy()), f"layer {layer}"
    finally:
        llm.shutdown()


def test_an_update_from_disk_under_tp2_reaches_the_tower_and_pushed_tower_tensors_are_refused(tmp_path_factory):
    """The tower lives in rank 0's process: an update from disk refills it (and empties the
    encoder cache) while the ranks load their language-model shards; pushed tower tensors,
    which the ranks would receive, are refused before anything changes."""
    from safetensors.torch import load_file

    from r3srv.engine.weight_sync import named_tensor_metas
    from r3srv.errors import ConfigError

    v0, v1 = tmp_path_factory.mktemp("v0"), tmp_path_factory.mktemp("v1")
    _, processor = write_vision_checkpoint(transformers, "qwen3_vl_moe", v0, seed=7)
    hf1, _ = write_vision_checkpoint(transformers, "qwen3_vl_moe", v1, seed=8)
    llm = LLM(str(v0), block_size=4, num_kv_blocks=128, max_model_len=256, tensor_parallel_size=2, dtype="float32")
    try:
        prompt = {"prompt_token_ids": with_placeholders(text(4, 1), 0, text(3, 2)), "multi_modal_data": {"image": picture(2)}}
        llm.generate(prompt, greedy(logprobs=False))
        tower = {n: t for n, t in load_file(str(v1 / "model.safetensors")).items() if n.startswith("model.visual.")}
        named = named_tensor_metas(list(tower), [str(t.dtype) for t in tower.values()],
                                   [list(t.shape) for t in tower.values()], dtypes_param="dtypes")
        with pytest.raises(ConfigError, match="tensor parallelism"):
            llm.engine.core.unfilled_weights(named)
        llm.update_weights(str(v1))
        out = llm.generate(prompt, greedy(logprobs=False))[0]
        tokens, _, rows = hf_greedy(hf1, out.prompt_token_ids, [picture(2)], processor, IMAGE_TOKEN, NEW_TOKENS)
        assert out.outputs[0].token_ids == tokens
        for layer, picked in rows.items():
            assert np.array_equal(out.outputs[0].routed_experts[:, layer], picked.numpy()), f"layer {layer}"
    finally:
        llm.shutdown()

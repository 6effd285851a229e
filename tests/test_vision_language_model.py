"""Image prompts through the language model (M-RoPE ids, image embeddings at the placeholder
rows, Qwen3-VL's deepstack) against transformers' image-text models, on tiny random
checkpoints of the three families: logits at every prompt position and the routed experts of
every position, image placeholders included, then a greedy continuation; one prefill, and
a prefill cut in two in the middle of an image (chunked prefill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv.models.batch import ForwardBatch, VisualRows
from r3srv.models.loader import load_model
from r3srv.models.vision import load_vision_tower
from r3srv.vision.decode import decode_image
from r3srv.vision.positions import ImageSpan, mrope_positions
from r3srv.vision.processor import ImageProcessorConfig, preprocess
from vision_testing import FAMILIES, IMAGE_CASES, IMAGE_TOKEN, VISION_END, VISION_START, hf_run, image_bytes, write_vision_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers oracles

BLOCK_SIZE = 4
NEW_TOKENS = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, _ = write_vision_checkpoint(transformers, request.param, path)
    return hf, load_model(path)[0], load_vision_tower(path), ImageProcessorConfig.from_dir(path)


def image_prompt(processor, images: list[int], texts: list[int], merge: int):
    """Text, then each image (delimited, its placeholders expanded) followed by text: ids, the
    images' spans, pixels and grids."""
    rng = np.random.default_rng(11)
    ids, spans, pixels, grids = rng.integers(0, 200, texts[0]).tolist(), [], [], []
    for case, n in zip(images, texts[1:]):
        width, height, mode, fmt = IMAGE_CASES[case]
        image = preprocess(processor, decode_image(image_bytes(width, height, mode, fmt, seed=case), param="image",
                                                   max_pixels=1 << 20), param="image")
        ids.append(VISION_START)
        spans.append(ImageSpan(len(ids), image.grid_thw))
        ids += [IMAGE_TOKEN] * image.num_tokens(merge) + [VISION_END] + rng.integers(0, 200, n).tolist()
        pixels.append(image.pixel_values)
        grids.append(image.grid_thw)
    return ids, spans, torch.from_numpy(np.concatenate(pixels)), grids


def step(model, ids, start, positions3, visual=None):
    t, ctx = len(ids), start + len(ids)
    positions = torch.arange(start, ctx)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=positions, slot_mapping=positions.clone(), query_lens=[t],
        context_lens=[ctx], block_tables=torch.arange((ctx + BLOCK_SIZE - 1) // BLOCK_SIZE)[None],
        logits_indices=torch.arange(t),
        routing_capture=torch.zeros(t, model.config.num_layers, model.config.top_k, dtype=torch.int32),
        mrope_positions=positions3, visual=visual)
    return model.forward(batch), batch.routing_capture


def visual_rows(out, image_rows: torch.Tensor, lo: int, hi: int) -> VisualRows | None:
    """The image embeddings of the prompt rows in [lo, hi), rows counted from lo."""
    keep = (image_rows >= lo) & (image_rows < hi)
    if not keep.any():
        return None
    return VisualRows(image_rows[keep] - lo, out.embeds[keep], [d[keep] for d in out.deepstack])


@pytest.mark.parametrize("layout,cut", [
    (([0], [5, 4]), None),                 # text, image, text
    (([1, 3], [3, 2, 6]), None),           # image, text, image, text: two images of other sizes
    (([2, 6], [0, 0, 3]), "mid-image"),    # an image first, then another right after it, cut inside the first
], ids=["one_image", "two_images", "chunked"])
def test_image_prompt_logits_rows_and_continuation_match_transformers(case, layout, cut):
    hf, model, tower, processor = case
    merge = tower.merge_size
    ids, spans, pixels, grids = image_prompt(processor, *layout, merge=merge)
    image_rows = torch.tensor([s.start + i for s in spans for i in range(s.num_tokens(merge))])
    kinds = torch.zeros(1, len(ids), dtype=torch.int32)
    kinds[0, image_rows] = 1
    ref_logits, ref_rows, past = hf_run(hf, ids, pixel_values=pixels, image_grid_thw=torch.tensor(grids),
                                        mm_token_type_ids=kinds)
    ref_tokens, ref_decode_rows = [], []
    for _ in range(NEW_TOKENS):
        ref_tokens.append(int(ref_logits[-1].argmax()))
        ref_logits_next, picked, past = hf_run(hf, [ref_tokens[-1]], past)
        ref_decode_rows.append(picked)
        ref_logits = torch.cat([ref_logits, ref_logits_next])

    model.init_kv_cache(64, BLOCK_SIZE)
    out = tower(pixels, grids)
    positions3, delta = mrope_positions(len(ids), spans, merge)
    cuts = [0, spans[0].start + 3, len(ids)] if cut else [0, len(ids)]
    logits, rows = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        got, capture = step(model, ids[lo:hi], lo, positions3[:, lo:hi], visual_rows(out, image_rows, lo, hi))
        logits.append(got)
        rows.append(capture)
    tokens = []
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits[-1][-1].argmax()))
        index = len(ids) + len(tokens) - 1
        got, capture = step(model, [tokens[-1]], index, torch.full((3, 1), index + delta))
        logits.append(got)
        rows.append(capture)
    assert tokens == ref_tokens
    # float32 rounding: a hybrid's chunked scan over a long prompt drifts up to ~2e-4 from the reference's
    torch.testing.assert_close(torch.cat(logits)[: len(ids)], ref_logits[: len(ids)], rtol=1e-4, atol=5e-4)
    ours = torch.cat(rows)
    for layer in model.config.moe_layers:  # every position's experts, the image placeholders' included
        ref = torch.cat([ref_rows[layer]] + [r[layer] for r in ref_decode_rows])
        assert torch.equal(ours[:, layer].long(), ref.long()), f"layer {layer}"


def test_mrope_positions_equal_transformers_rope_index():
    """Image first, two images one token apart, an image last, text only: the ids and the delta
    (transformers tells images apart by the text between them, as prompts delimit them)."""
    hf, _ = FAMILIES["qwen3_vl_moe"](transformers)
    layouts = [[(0, (1, 4, 6))], [(3, (1, 2, 2)), (5, (1, 6, 2))], [(2, (1, 8, 4))], []]
    for layout in layouts:
        spans = [ImageSpan(start, grid) for start, grid in layout]
        n = (spans[-1].start + spans[-1].num_tokens(2) if spans else 0) + 3
        kinds = torch.zeros(1, n, dtype=torch.int32)
        for span in spans:
            kinds[0, span.start:span.start + span.num_tokens(2)] = 1
        want, want_delta = hf.model.get_rope_index(torch.zeros(1, n, dtype=torch.long), kinds,
                                                   image_grid_thw=torch.tensor([g for _, g in layout]) if layout else None)
        got, delta = mrope_positions(n, spans, 2)
        assert torch.equal(got, want[:, 0]) and delta == int(want_delta), layout

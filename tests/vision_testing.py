"""Generated images for the vision tests: random pixels of several sizes, aspect ratios, modes
and formats, encoded as a client would send them."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from tiny_checkpoints import VOCAB_SIZE

# (width, height, mode, format): tall, wide, tiny, odd sizes; alpha, palette with a transparent
# entry, greyscale; lossless and lossy formats
IMAGE_CASES = [
    (64, 48, "RGB", "PNG"), (33, 97, "RGB", "JPEG"), (120, 20, "RGBA", "PNG"), (9, 7, "L", "PNG"),
    (50, 50, "P", "GIF"), (77, 31, "LA", "PNG"), (40, 64, "RGB", "WEBP"), (300, 2, "RGB", "BMP"),
]


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 4), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA").convert(mode) if mode != "P" else None
    if mode == "P":  # a palette image whose entry 0 is transparent
        image = Image.fromarray(pixels[..., 0] % 16, "P")
        image.putpalette(rng.integers(0, 256, size=16 * 3, dtype=np.uint8).tolist())
        image.info["transparency"] = 0
    return image


def encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    kwargs = {"transparency": 0} if fmt == "GIF" and "transparency" in image.info else {}
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def image_bytes(width: int, height: int, mode: str = "RGB", fmt: str = "PNG", seed: int = 0) -> bytes:
    return encode(random_image(width, height, mode, seed), fmt)


# Tiny vision-language checkpoints of the three families (transformers' image-text models; the
# placeholder and delimiter ids inside the byte-level vocabulary)
# the byte-level tokenizer's vocabulary, then an image's delimiters and placeholder as special
# tokens (their text in a chat template encodes to them, as a real checkpoint's does)
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
VISION_START, IMAGE_TOKEN, VISION_END = range(VOCAB_SIZE, VOCAB_SIZE + len(VISION_TOKENS))
# ChatML whose list contents show each image as its delimited placeholder (as Qwen3-VL's template)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TEXT = dict(vocab_size=VOCAB_SIZE + len(VISION_TOKENS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts_per_tok=2, max_position_embeddings=512)
# merged tokens cover 8 x 8 pixels (patch 4, merge 2); images land on 2 x 2 to 16 x 16 patches
PREPROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 256, "longest_edge": 4096}}


QWEN_IDS = dict(image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def qwen3_vl_moe(transformers):
    text = dict(TEXT, num_experts=8, moe_intermediate_size=8, intermediate_size=48,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, num_position_embeddings=25, deepstack_visual_indexes=[0, 2])
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **QWEN_IDS)
    return transformers.Qwen3VLMoeForConditionalGeneration(config), "Qwen2VLImageProcessorFast"


def qwen3_5_moe(transformers):
    text = dict(TEXT, num_experts=8, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                layer_types=["linear_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, num_position_embeddings=36)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **QWEN_IDS)
    return transformers.Qwen3_5MoeForConditionalGeneration(config), "Qwen2VLImageProcessorFast"


def glm4v_moe(transformers):
    text = dict(TEXT, n_routed_experts=8, moe_intermediate_size=16, intermediate_size=48, first_k_dense_replace=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=32, patch_size=4,
                  image_size=20, spatial_merge_size=2, attention_bias=True)
    config = transformers.Glm4vMoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                         image_start_token_id=VISION_START, image_end_token_id=VISION_END)
    return transformers.Glm4vMoeForConditionalGeneration(config), "Glm4vImageProcessor"


FAMILIES = {"qwen3_vl_moe": qwen3_vl_moe, "qwen3_5_moe": qwen3_5_moe, "glm4v_moe": glm4v_moe}


def write_vision_checkpoint(transformers, family: str, path, seed: int = 7):
    """A tiny random image-text checkpoint of `family` at `path` (weights, preprocessor config,
    the byte-level tokenizer); returns the transformers model (float32, eval) and transformers'
    own PIL image processor for its preprocessor config (the oracle of the pixels)."""
    import json

    import torch

    from tiny_checkpoints import randomize_

    torch.manual_seed(0)
    hf, processor_type = FAMILIES[family](transformers)
    randomize_(hf, seed=seed)
    hf = hf.float().eval()
    hf.save_pretrained(path)
    write_vision_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "image_processor_type": processor_type}))
    oracle = "Glm4vImageProcessorPil" if processor_type.startswith("Glm4v") else "Qwen2VLImageProcessorPil"
    return hf, getattr(transformers, oracle)(**PREPROCESSOR)


def hf_run(hf, ids: list[int], past=None, **images):
    """transformers' forward of `ids` (after `past`): float32 logits [T, V], the router's picks
    per MoE layer [T, k], and the cache."""
    import torch

    from tiny_checkpoints import hf_gate_modules, hf_router_ids

    picked = {}
    hooks = [gate.register_forward_hook(lambda m, i, o, n=n: picked.__setitem__(n, hf_router_ids(m, i, o).clone()))
             for n, gate in hf_gate_modules(hf).items()]
    try:
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True, **images)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float(), picked, out.past_key_values


def hf_greedy(hf, ids: list[int], images: list[bytes], processor, image_token: int, new_tokens: int):
    """transformers' greedy continuation of an expanded prompt with `images` (bytes, through its
    own processor): tokens, each one's logprob, and the routed experts of every position but
    the last, per MoE layer [positions, k]."""
    import torch

    hf.model.rope_deltas = None  # transformers keeps the last prompt's M-RoPE delta for its decodes: not this one's
    extra = {}
    if images:
        batch = processor(images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt")
        kinds = (torch.tensor([ids]) == image_token).int()
        extra = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=kinds)
    logits, picked, past = hf_run(hf, ids, **extra)
    rows = [picked]
    tokens, logprobs = [], []
    for i in range(new_tokens):
        last = logits[-1].log_softmax(-1)
        tokens.append(int(last.argmax()))
        logprobs.append(float(last[tokens[-1]]))
        if i + 1 < new_tokens:
            logits, picked, past = hf_run(hf, [tokens[-1]], past)
            rows.append(picked)
    return tokens, logprobs, {layer: torch.cat([r[layer] for r in rows]) for layer in rows[0]}


def image_grids(images: list[bytes], processor) -> list[list[int]]:
    """Each image's (t, h, w) patch grid, as transformers' processor computes it."""
    return processor(images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="np")["image_grid_thw"].tolist()


def expanded(ids: list[int], images: list[bytes], processor, image_token: int, merge: int = 2) -> list[int]:
    """`ids` with each single placeholder expanded to its image's tokens, by transformers' processor's grids."""
    if not images:
        return list(ids)
    grids = np.array(image_grids(images, processor))
    out, k = [], 0
    for t in ids:
        if t == image_token:
            out += [image_token] * (int(grids[k].prod()) // (merge * merge))
            k += 1
        else:
            out.append(t)
    return out


def write_vision_tokenizer(path) -> None:
    """The byte-level tokenizer with the image tokens added, and CHAT_TEMPLATE."""
    import json

    from r3srv.models.builtin import byte_level_tokenizer, write_byte_level_tokenizer

    write_byte_level_tokenizer(path)
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens(list(VISION_TOKENS))
    assert tokenizer.token_to_id(VISION_TOKENS[1]) == IMAGE_TOKEN
    (path / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config["additional_special_tokens"] = [*config["additional_special_tokens"], *VISION_TOKENS]
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")

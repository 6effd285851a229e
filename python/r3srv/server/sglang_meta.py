"""SGLang's meta_info object: what its /generate answers carry beside the text and ids, and
what its OpenAI chat route puts on each choice with `return_meta_info` (miles' session server
reads it there)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from msgspec import UNSET

from r3srv import serial
from r3srv.engine.indexer_topk import every_layer
from r3srv.outputs import CompletionOutput, Logprob, RequestOutput, SamplingMasks
from r3srv.server.generation import ServerState
from r3srv.server.responses import expert_weights, ranked_logprobs


async def meta_info(state: ServerState, output_id: str, out: RequestOutput, c: CompletionOutput,
                    token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, final: bool, *,
                    start_len: int, logprobs_top: int | None, text_in_logprobs: bool, encoding: str,
                    weights_dtype: str = "float32") -> dict[str, Any]:
    """Output `c`'s meta_info. `logprobs_top`: None without logprobs, else the top entries per
    token; `encoding`: how the routed experts are written (SGLang's raw int32 by default);
    `weights_dtype`: how their router weights are, where asked for."""
    meta: dict[str, Any] = {
        "id": output_id,
        "finish_reason": finish_reason(c, token_ids) if final else None,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(token_ids),
        "cached_tokens": out.num_cached_tokens,
        "routed_experts_start_len": start_len,
    }
    if out.image_grid_thw is not None:  # r3srv's: each image's patch grid, to rebuild the input
        meta["image_grid_thw"] = [list(grid) for grid in out.image_grid_thw]
    if logprobs_top is not None:
        add_logprobs(meta, logprobs_top, out, token_ids, logprobs, state.engine.tokenizer if text_in_logprobs else None)
    if final and c.routed_experts is not None:
        meta["routed_experts"] = await state.encode_experts(c.routed_experts, encoding, start_len)
    if final and c.routed_expert_weights is not None:
        meta["routed_expert_weights"] = expert_weights(c, weights_dtype)
    if final and c.indexer_topk is not None:  # SGLang's form: raw int32, every layer (shared ones repeated)
        meta["indexer_topk"] = serial.encode_raw(every_layer(c.indexer_topk, state.engine.model_config), "int32")
    version = state.weight_version(out) if final else UNSET
    if version is not UNSET:
        meta["weight_version"] = version
    if final and c.weight_versions is not None:
        meta["weight_versions"] = sglang_weight_versions(c, len(token_ids))
    if final:
        meta.update(state.lora_fields(out))
    return meta


def sglang_weight_versions(c: CompletionOutput, num_tokens: int) -> list[dict[str, Any]]:
    """SGLang's `weight_versions`: which weights sampled which of the first `num_tokens` output
    tokens, as `{"version", "start", "end"}` objects (end exclusive), cut to those tokens."""
    return [{"version": s.version, "start": s.start, "end": min(s.end, num_tokens)}
            for s in c.weight_versions or [] if s.start < num_tokens or s.start == 0]


def add_logprobs(meta: dict[str, Any], k: int, out: RequestOutput, token_ids: list[int],
                  logprobs: list[dict[int, Logprob]] | None, tokenizer: Any = None) -> None:
    """SGLang's logprob keys: [logprob, token id, text] triples; the input ones from
    logprob_start_len on, the first of them without a logprob (as SGLang sends them). The text is
    null, or with return_text_in_logprobs each token decoded alone, specials kept (SGLang's)."""
    def text(t: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)

    entries = out.prompt_logprobs or []
    inputs = out.prompt_token_ids[len(out.prompt_token_ids) - len(entries):]
    meta["input_token_logprobs"] = [[None if e is None else e[t].logprob, t, text(t)] for t, e in zip(inputs, entries)]
    meta["output_token_logprobs"] = [[entry[t].logprob, t, text(t)] for t, entry in zip(token_ids, logprobs or [])]
    meta["output_token_logprobs_length"] = len(token_ids)
    if k:
        meta["input_top_logprobs"] = [
            None if e is None else [[lp.logprob, t, text(t)] for t, lp in sorted(e.items(), key=lambda kv: kv[1].rank)[:k]]
            for e in entries
        ]
        meta["output_top_logprobs"] = [[[v, t, text(t)] for t, v in ranked_logprobs(entry)[:k]] for entry in logprobs or []]


def add_sampling_masks(meta: dict[str, Any], masks: SamplingMasks, token_ids: list[int], mode: str | None,
                       top_p_ids: bool) -> None:
    """Sampling masks as SGLang writes them (`mode`: "selected" or "support"; None: not asked):
    `output_token_sampling_mask`, each token's ids by descending probability (ties: lower id
    first), `output_token_sampling_logprobs` (the sampled token's logprob under the filtered
    distribution, or every mask id's in the mask's order) and `output_token_sampling_mask_length`;
    and slime's (`top_p_ids`): `top_p_token_ids` and `top_p_token_offsets`, base64 of
    little-endian int32, the ids ascending. The JSON is written by the Rust core."""
    if top_p_ids:
        meta["top_p_token_ids"] = serial.encode_raw(masks.token_ids, "int32")
        meta["top_p_token_offsets"] = serial.encode_raw(masks.offsets, "int32")
    if mode is None:
        return
    rows = np.repeat(np.arange(len(masks)), np.diff(masks.offsets))
    order = np.lexsort((masks.token_ids, -masks.logprobs, rows))
    ids, logprobs = masks.token_ids[order], masks.logprobs[order]
    meta["output_token_sampling_mask"] = msgspec.Raw(serial.encode_int_lists(ids, masks.offsets))
    if mode == "support":
        meta["output_token_sampling_logprobs"] = msgspec.Raw(serial.encode_float_lists(logprobs, masks.offsets))
    else:
        chosen = np.array(token_ids[: len(masks)], dtype=np.int32)
        hit = ids == np.repeat(chosen, np.diff(masks.offsets))
        selected = np.zeros(len(masks), dtype=np.float32)
        selected[rows[hit]] = logprobs[hit]
        meta["output_token_sampling_logprobs"] = msgspec.Raw(serial.encode_float_lists(selected))
    meta["output_token_sampling_mask_length"] = len(masks)


def finish_reason(c: CompletionOutput, token_ids: list[int]) -> dict[str, Any]:
    """SGLang's finish_reason objects."""
    if c.finish_reason == "length":
        return {"type": "length", "length": len(token_ids)}
    if c.finish_reason == "stop":  # a stop string, a stop token, or EOS (the last token)
        last = token_ids[-1] if token_ids else None
        return {"type": "stop", "matched": c.stop_reason if c.stop_reason is not None else last}
    return {"type": "abort", "message": "aborted"}

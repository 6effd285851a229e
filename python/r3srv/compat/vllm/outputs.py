"""vLLM's `vllm.outputs` where its shapes differ from r3srv's: a sample's sampling mask.

vLLM's `CompletionOutput.sampling_mask` is `SamplingMask(token_ids, logprobs)`, one list per
generated token each (the ids its draw could pick, ascending, and their logprobs), which
vLLM-based workers read per token (NeMo-RL's vLLM worker pads them to [tokens, top_k]);
r3srv's own `SamplingMasks` holds the same rows as CSR arrays. The output classes themselves
are r3srv's, already vLLM-shaped.
"""

from __future__ import annotations

import dataclasses

from r3srv.outputs import CompletionOutput, RequestOutput, SamplingMasks

__all__ = ["CompletionOutput", "RequestOutput", "SamplingMask", "vllm_output"]


@dataclasses.dataclass(frozen=True)
class SamplingMask:
    """vLLM's form of a sample's masks (built and compared as vLLM's, positionally):
    `token_ids[i]`, generated token i's ids, ascending; `logprobs[i]`, their logprobs under the
    distribution drawn from."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]

    @classmethod
    def of(cls, masks: SamplingMasks) -> "SamplingMask":
        bounds = masks.offsets.tolist()
        ids, logprobs = masks.token_ids.tolist(), masks.logprobs.tolist()
        spans = list(zip(bounds[:-1], bounds[1:]))
        return cls([ids[a:b] for a, b in spans], [logprobs[a:b] for a, b in spans])


def vllm_output(out: RequestOutput) -> RequestOutput:
    """`out` with each sample's sampling mask in vLLM's form: a copy where one changes (the
    engine's own output, which cumulative outputs go on extending, stays as it is)."""
    if not any(isinstance(c.sampling_mask, SamplingMasks) for c in out.outputs):
        return out
    outputs = [dataclasses.replace(c, sampling_mask=SamplingMask.of(c.sampling_mask))
               if isinstance(c.sampling_mask, SamplingMasks) else c for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)

"""Plain-torch expert selection: the CPU routing path and the oracle for the fused kernel."""

from __future__ import annotations

import functools

import torch

SCORINGS = ("softmax", "sigmoid")


@functools.cache  # every MoE layer of every step asks, for one or two dtypes
def _id_limit(dtype: torch.dtype) -> int | None:
    """Largest expert count whose ids fit `dtype`; None if it is not an integer dtype."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return None
    return int(torch.iinfo(dtype).max) + 1


def check_route_args(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    correction_bias: torch.Tensor | None,
    capture: torch.Tensor | None,
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score_top: int = 2,
) -> None:
    """Reject bad routing arguments with a ValueError that names the argument (both backends)."""
    if router_logits.dim() != 2 or not router_logits.dtype.is_floating_point:
        raise ValueError(
            f"router_logits must be a 2-D floating tensor [tokens, experts], got "
            f"{router_logits.dtype} of shape {tuple(router_logits.shape)}"
        )
    num_tokens, num_experts = router_logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"unknown router scoring {scoring!r}; expected 'softmax' or 'sigmoid'")
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"correction_bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}"
        )
    if num_groups != 1 or topk_groups != 1:
        if num_groups < 1 or num_experts % num_groups or not 1 <= topk_groups <= num_groups:
            raise ValueError(
                f"expert groups: num_groups={num_groups} must divide num_experts={num_experts} and "
                f"topk_groups={topk_groups} must be in [1, num_groups]"
            )
        if group_score_top not in (1, 2):
            raise ValueError(f"group_score_top must be 1 (DeepSeek-V2) or 2 (DeepSeek-V3), got {group_score_top!r}")
        if top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(
                f"top_k={top_k} exceeds the {topk_groups * (num_experts // num_groups)} experts of "
                f"topk_groups={topk_groups} groups"
            )
    if capture is not None:
        if tuple(capture.shape) != (num_tokens, top_k):
            raise ValueError(f"capture must have shape ({num_tokens}, {top_k}), got {tuple(capture.shape)}")
        limit = _id_limit(capture.dtype)
        if limit is None or limit < num_experts:
            raise ValueError(f"capture dtype {capture.dtype} cannot hold expert ids of {num_experts} experts")
        if capture.device != router_logits.device:
            raise ValueError(f"capture is on {capture.device} but router_logits on {router_logits.device}")


def wide_scores(logits: torch.Tensor, scoring: str, correction_bias: torch.Tensor | None) -> torch.Tensor:
    """float64 score (+ bias) of every expert, NaN as +inf: what biased choices and expert
    groups are ranked by (the fused kernel computes the same values)."""
    wide = logits.double()
    scores = torch.softmax(wide, dim=-1) if scoring == "softmax" else torch.sigmoid(wide)
    if correction_bias is not None:
        scores = scores + correction_bias.double()
    return torch.nan_to_num(scores, nan=float("inf"))


def choice_keys(
    logits: torch.Tensor, scoring: str, correction_bias: torch.Tensor | None
) -> torch.Tensor:
    """The values the experts are ranked by, built so that the fused kernel computes them bit for bit.

    Softmax and sigmoid are monotone, so without a bias the float32 logits themselves rank
    the experts (an equal-score tie is an equal-logit tie, whatever the exp rounding).
    With a bias, score + bias is ranked in float64 (`wide_scores`), where the last-bit
    differences between torch's and the kernel's exp cannot reorder two different inputs.
    NaN ranks as +inf (first, as torch's descending sort puts it), so a NaN row is still
    routed deterministically.
    """
    if correction_bias is not None:
        return wide_scores(logits, scoring, correction_bias)
    inf = float("inf")
    return torch.nan_to_num(logits, nan=inf, posinf=inf, neginf=-inf)


def eligible_experts(scores: torch.Tensor, num_groups: int, topk_groups: int, group_score_top: int = 2) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `topk_groups` best groups, from `wide_scores`.

    Group-limited routing: experts come in `num_groups` equal groups, a group scores the sum
    of its `group_score_top` best `score + bias` values (2 in DeepSeek-V3, whose GLM-4.5 and
    Kimi-K2 configs carry the switch too; 1, the best score, in DeepSeek-V2's
    group_limited_greedy), and equal group scores go to the lower group id.
    """
    num_tokens, num_experts = scores.shape
    per_group = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = per_group.topk(min(group_score_top, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
    best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
    keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return keep.repeat_interleave(num_experts // num_groups, dim=1)


def route_reference(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    scaling: float = 1.0,
    capture: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score_top: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the top-k experts of each token.

    router_logits: [T, E]. Returns (weights float32 [T, k], ids int32 [T, k]) in
    descending score order, ties going to the lower expert id.
    scoring "softmax": scores = softmax(logits); "sigmoid": scores = sigmoid(logits),
    and `correction_bias` (if given) is added for the choice only, as DeepSeek-V3
    routers do: the weights are still the unbiased scores.
    renormalize: weights /= their sum. scaling multiplies the final weights.
    capture: an optional [T, k] integer view (e.g. one layer of a capture buffer);
    the ids are written into it, narrowed to its dtype.
    num_groups > 1: group-limited routing (see `eligible_experts`): only experts of each
    token's `topk_groups` best groups can be picked; a group scores its `group_score_top` best.
    Bad arguments raise ValueError. See `choice_keys` for how scores are ranked exactly.
    """
    check_route_args(router_logits, top_k, scoring, correction_bias, capture, num_groups, topk_groups, group_score_top)
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    # A stable descending sort keeps the lower id first among equal keys
    # (torch.topk does not promise an order for ties).
    keys = choice_keys(logits, scoring, correction_bias)
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    if num_groups > 1:
        # eligible experts first, in key order: one of a dropped group is never picked, even
        # against an eligible expert whose key is -inf
        # biased keys are the wide scores already: computed once
        group_keys = keys if correction_bias is not None else wide_scores(logits, scoring, None)
        dropped = ~eligible_experts(group_keys, num_groups, topk_groups, group_score_top)
        order = order.gather(1, torch.sort(dropped.gather(1, order).to(torch.uint8), dim=-1, stable=True).indices)
    ids = order[:, :top_k]
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    ids = ids.to(torch.int32)
    if capture is not None:
        capture.copy_(ids)
    return weights, ids

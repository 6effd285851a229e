"""Plain-torch expert selection: the CPU routing path and the oracle for the fused kernel."""

from __future__ import annotations

import torch


def route_reference(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    scaling: float = 1.0,
    capture: torch.Tensor | None = None,
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
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown router scoring {scoring!r}; expected 'softmax' or 'sigmoid'")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    # A stable descending sort keeps the lower id first among equal scores
    # (torch.topk does not promise an order for ties).
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    ids = ids.to(torch.int32)
    if capture is not None:
        capture.copy_(ids)
    return weights, ids

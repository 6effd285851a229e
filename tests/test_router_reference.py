"""The torch router reference (CPU path and oracle) against a brute-force numpy oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv.kernels.router_reference import choice_keys, route_reference


def oracle(logits, top_k, scoring, renormalize, bias, scaling):
    """Rank with Python's sort on (-key, id); weights in float64."""
    x = logits.double().numpy()
    if scoring == "softmax":
        e = np.exp(x - x.max(axis=1, keepdims=True))
        scores = e / e.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-x))
    keys = x if bias is None else scores + bias.double().numpy()
    ids = np.array([sorted(range(x.shape[1]), key=lambda e: (-row[e], e))[:top_k] for row in keys])
    weights = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return weights * scaling, ids


@pytest.mark.parametrize("scoring,with_bias", [("softmax", False), ("sigmoid", False), ("sigmoid", True), ("softmax", True)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (64, 6), (160, 8), (512, 8)])
def test_matches_oracle_random(scoring, with_bias, renormalize, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts * 31 + top_k)
    logits = torch.randn(23, num_experts, generator=gen) * 3
    bias = torch.randn(num_experts, generator=gen) * 0.2 if with_bias else None
    weights, ids = route_reference(
        logits, top_k, scoring=scoring, renormalize=renormalize, correction_bias=bias, scaling=1.5
    )
    want_w, want_ids = oracle(logits, top_k, scoring, renormalize, bias, 1.5)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(weights.numpy(), want_w, atol=2e-6, rtol=0)


@pytest.mark.parametrize("scoring,with_bias", [("softmax", False), ("sigmoid", False), ("sigmoid", True)])
def test_ties_go_to_the_lower_id(scoring, with_bias):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randint(-2, 3, (40, 24), generator=gen).float()  # many equal values per row
    bias = torch.randint(0, 2, (24,), generator=gen).float() * 0.5 if with_bias else None
    _, ids = route_reference(logits, 6, scoring=scoring, correction_bias=bias)
    _, want_ids = oracle(logits, 6, scoring, True, bias, 1.0)
    np.testing.assert_array_equal(ids.numpy(), want_ids)


def test_all_equal_row_picks_ids_in_order():
    _, ids = route_reference(torch.zeros(3, 16), 8)
    assert ids.tolist() == [list(range(8))] * 3


def test_bias_changes_choice_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = route_reference(logits, 2, scoring="sigmoid", correction_bias=bias, renormalize=False)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(logits[:, [3, 0]]))


def test_nan_ranks_first_and_inf_masks_last():
    logits = torch.tensor([[0.5, float("nan"), float("-inf"), 2.0, float("-inf")]])
    _, ids = route_reference(logits, 5, scoring="sigmoid")
    assert ids.tolist() == [[1, 3, 0, 2, 4]]
    keys = choice_keys(logits, "sigmoid", None)
    assert keys[0, 1] == float("inf")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int32, torch.int64])
def test_capture_view_is_fully_overwritten(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(17, 60, generator=gen)
    buffer = torch.full((17, 3, 4), 99, dtype=dtype)  # poison: 99 is a valid-looking id
    _, ids = route_reference(logits, 4, capture=buffer[:, 1])
    assert torch.equal(buffer[:, 1].long(), ids.long())
    assert (buffer[:, 0] == 99).all() and (buffer[:, 2] == 99).all()  # other layers untouched


def test_zero_tokens():
    buffer = torch.zeros((0, 2, 2), dtype=torch.uint8)
    weights, ids = route_reference(torch.empty(0, 8), 2, capture=buffer[:, 0])
    assert weights.shape == (0, 2) and ids.shape == (0, 2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(router_logits=torch.zeros(4), top_k=1), "2-D floating"),
        (dict(router_logits=torch.zeros(2, 8, dtype=torch.int64), top_k=1), "2-D floating"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=9), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(scoring="relu"), "scoring"),
        (dict(correction_bias=torch.zeros(7)), "correction_bias"),
        (dict(capture=torch.zeros(2, 3, dtype=torch.uint8)), "capture must have shape"),
        (dict(capture=torch.zeros(2, 2, dtype=torch.float32)), "cannot hold"),
        (dict(capture=torch.zeros(2, 2, dtype=torch.bool)), "cannot hold"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    args = dict(router_logits=torch.zeros(2, 8), top_k=2) | kwargs
    with pytest.raises(ValueError, match=message):
        route_reference(args.pop("router_logits"), args.pop("top_k"), **args)


def test_capture_too_narrow_for_expert_count():
    with pytest.raises(ValueError, match="cannot hold expert ids of 300 experts"):
        route_reference(torch.zeros(2, 300), 2, capture=torch.zeros(2, 2, dtype=torch.uint8))

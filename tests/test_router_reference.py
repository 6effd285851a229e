"""The torch router reference (CPU path and oracle) against a brute-force numpy oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv.kernels.router_reference import choice_keys, route_reference


def float64_scores(x: np.ndarray, scoring: str) -> np.ndarray:
    if scoring == "softmax":
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-x))


def oracle(logits, top_k, scoring, renormalize, bias, scaling):
    """Rank with Python's sort on (-key, id); weights in float64."""
    x = logits.double().numpy()
    scores = float64_scores(x, scoring)
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


def group_oracle(logits, top_k, scoring, bias, num_groups, topk_groups, score_top=2):
    """The group-limited choice, by Python sorts: a group scores the sum of its `score_top`
    best score + bias values (DeepSeek-V3: 2, V2: 1); the best topk_groups groups (ties: lower
    group) are eligible."""
    x = logits.double().numpy()
    scores = float64_scores(x, scoring)
    choice = scores + (0.0 if bias is None else bias.double().numpy())
    size = x.shape[1] // num_groups
    all_ids = []
    for row_choice, row_logits in zip(choice, x):
        group_score = [sum(sorted(row_choice[g * size:(g + 1) * size])[-score_top:]) for g in range(num_groups)]
        groups = sorted(range(num_groups), key=lambda g: (-group_score[g], g))[:topk_groups]
        eligible = [e for g in groups for e in range(g * size, (g + 1) * size)]
        rank = row_logits if bias is None else row_choice  # as choice_keys ranks
        all_ids.append(sorted(eligible, key=lambda e: (-rank[e], e))[:top_k])
    ids = np.array(all_ids)
    return np.take_along_axis(scores, ids, axis=1), ids


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from([(8, 2, 1, 2), (16, 4, 2, 4), (32, 8, 4, 6), (64, 8, 4, 8), (160, 8, 3, 8), (256, 8, 4, 8)]),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    with_bias=st.booleans(),
    tie_heavy=st.booleans(),
    score_top=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_limited_routing_matches_the_oracle(layout, scoring, with_bias, tie_heavy, score_top, seed):
    num_experts, num_groups, topk_groups, top_k = layout
    gen = torch.Generator().manual_seed(seed)
    if tie_heavy:  # few distinct values: equal experts and equal groups
        logits = torch.randint(-2, 3, (13, num_experts), generator=gen).float()
    else:
        logits = torch.randn(13, num_experts, generator=gen) * 3
    bias = torch.randn(num_experts, generator=gen) * 0.2 if with_bias else None
    weights, ids = route_reference(
        logits, top_k, scoring=scoring, correction_bias=bias, renormalize=False,
        num_groups=num_groups, topk_groups=topk_groups, group_score_top=score_top,
    )
    want_w, want_ids = group_oracle(logits, top_k, scoring, bias, num_groups, topk_groups, score_top)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(weights.numpy(), want_w, atol=2e-6, rtol=0)


def test_groups_exclude_a_better_expert_of_a_weaker_group():
    # group 0 = experts 0-3 has the single best expert; group 1's two best sum higher
    logits = torch.tensor([[4.0, -5.0, -5.0, -5.0, 3.0, 3.0, -5.0, -5.0]])
    _, ungrouped = route_reference(logits, 2, scoring="sigmoid")
    _, grouped = route_reference(logits, 2, scoring="sigmoid", num_groups=2, topk_groups=1)
    assert ungrouped.tolist() == [[0, 4]] and grouped.tolist() == [[4, 5]]


@pytest.mark.parametrize(
    "num_experts,top_k,num_groups,topk_groups,match",
    [(8, 2, 3, 1, "must divide"), (8, 2, 2, 3, "topk_groups"), (8, 5, 4, 2, "exceeds"), (8, 2, 0, 1, "must divide")],
)
def test_bad_groups_are_value_errors(num_experts, top_k, num_groups, topk_groups, match):
    with pytest.raises(ValueError, match=match):
        route_reference(torch.zeros(2, num_experts), top_k, num_groups=num_groups, topk_groups=topk_groups)
    with pytest.raises(ValueError, match="group_score_top"):
        route_reference(torch.zeros(2, 8), 2, num_groups=2, topk_groups=1, group_score_top=3)

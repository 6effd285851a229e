"""Shared by the tests of RL frameworks' own rollout code on r3srv (verl, OpenRLHF): a batch as
the framework recorded it, checked against r3srv's own API on the same prompts."""

from __future__ import annotations

import numpy as np
import pytest


def assert_batch_equals_own(want: list, prompts: list[list[int]], responses, rows, logprobs) -> None:
    """`want`: r3srv's own RequestOutputs for `prompts` (logprobs asked); the framework's batch:
    per sample its response ids, its rows (every token of prompt and response but the last) and
    its sampled tokens' logprobs."""
    assert len(want) == len(prompts) == len(responses) == len(rows) == len(logprobs)
    for i, w in enumerate(want):
        c = w.outputs[0]
        response = list(map(int, responses[i]))
        assert response == c.token_ids
        got_rows = np.asarray(rows[i])
        assert got_rows.shape == (len(prompts[i]) + len(response) - 1, *c.routed_experts.shape[1:])
        np.testing.assert_array_equal(got_rows, c.routed_experts)
        sampled = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
        assert list(logprobs[i]) == pytest.approx(sampled, abs=1e-4)

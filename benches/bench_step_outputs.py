"""Per-step output building for a streaming request: CUMULATIVE (everything so far, as streams
used before) against DELTA (only the new token, what the server now streams).

    .venv/bin/python -m pytest benches/bench_step_outputs.py

One sequence with L output tokens and logprobs; each round is one decode step's output.
benches/conftest.py prints reference (cumulative) / r3srv (delta) per L: the engine thread
pays this for every streaming request at every step, so it grows with the output in the
cumulative form and stays flat in the delta form.
"""

from __future__ import annotations

import pytest

from r3srv.engine.input_processor import EngineRequest
from r3srv.engine.output_processor import SeqState
from r3srv.engine.output_processor import completion_output as _completion
from r3srv.sampling_params import SamplingParams

LENGTHS = [256, 8192, 32768]


def streaming_sequence(num_output: int) -> SeqState:
    prep = EngineRequest("r", None, list(range(100)), SamplingParams(logprobs=1), num_output + 1, False)
    seq = SeqState(0, prep, None)
    for i in range(num_output):
        seq.token_ids.append(i % 250)
        seq.logprobs.append({i % 250: -0.5, 3: -1.5})
        seq.cumulative_logprobs.append(seq.cumulative_logprob - 0.5)
    seq.stream.text = "x" * num_output
    return seq


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("length", LENGTHS)
def test_build_one_step_output(benchmark, length, candidate):
    seq = streaming_sequence(length)
    benchmark.group = f"step output at {length} tokens"
    if candidate == "reference":
        out = benchmark(_completion, seq, False)
        assert len(out.token_ids) == length and len(out.logprobs) == length
    else:

        def one_new_token():
            seq.num_emitted_tokens, seq.num_emitted_chars = length - 1, length - 1  # the step's one new token
            return _completion(seq, True)

        out = benchmark(one_new_token)
        assert out.token_ids == seq.token_ids[-1:] and out.text == "x" and len(out.logprobs) == 1

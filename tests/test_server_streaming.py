"""SSE helpers alone: per-choice deltas from cumulative outputs, and errors after the headers."""

from __future__ import annotations

import asyncio
import json

import msgspec
import numpy as np
import pytest
from litestar.serialization import encode_json

from r3srv.errors import InvalidRequestError
from r3srv.outputs import CompletionOutput
from r3srv.serial import numpy2base64
from r3srv.server import protocol as p
from r3srv.server.generation import ServerState
from r3srv.server.metrics import ServerMetrics
from r3srv.server.streaming import DONE, _guarded, _Tracker, sse


def test_tracker_passes_each_delta_once_and_counts_what_was_sent():
    tracker = _Tracker()
    first = tracker.delta(0, CompletionOutput(index=0, text="", token_ids=[]))
    assert first is not None and first.first and not first.text  # opens the choice
    assert tracker.delta(0, CompletionOutput(index=0, text="", token_ids=[])) is None  # nothing new
    d = tracker.delta(0, CompletionOutput(index=0, text="ab", token_ids=[1, 2], logprobs=[{1: -0.1}, {2: -0.2}]))
    assert (d.text, d.token_ids, d.logprobs, d.text_offset, d.first, d.final) == (
        "ab", [1, 2], [{1: -0.1}, {2: -0.2}], 0, False, False
    )
    d = tracker.delta(0, CompletionOutput(index=0, text="c", token_ids=[3], finish_reason="length"))
    assert (d.text, d.token_ids, d.text_offset, d.final) == ("c", [3], 2, True)
    assert tracker.delta(0, CompletionOutput(index=0, text="", token_ids=[], finish_reason="length")) is None
    # choices of other prompts are tracked separately
    assert tracker.delta(1, CompletionOutput(index=0, text="z", token_ids=[9])).token_ids == [9]
    assert tracker.num_tokens == 4


def test_error_mid_stream_becomes_an_error_event_then_done():
    closed = []

    async def content():
        try:
            yield b"data: 1\n\n"
            raise InvalidRequestError("boom", param="x")
        finally:
            closed.append(True)

    async def collect():
        return [chunk async for chunk in _guarded(content())]

    chunks = asyncio.run(collect())
    assert chunks[0] == b"data: 1\n\n" and chunks[-1] == DONE
    event = json.loads(chunks[1].removeprefix(b"data: "))
    assert event["error"]["code"] == 400 and event["error"]["param"] == "x" and "boom" in event["error"]["message"]
    assert closed == [True]


@pytest.mark.parametrize("rows", [3, 4000])  # 4000 rows (1.5 MB) are encoded on a worker thread
def test_routed_experts_go_into_responses_pre_quoted(rows):
    """The encoder's JSON-quoted text is embedded with msgspec.Raw (no escape scan of megabytes);
    the bytes on the wire, plain and SSE, are the same as for the plain str."""
    state = ServerState(engine=None, model_name="m", metrics=ServerMetrics(lambda: None))
    array = np.random.default_rng(rows).integers(0, 64, (rows, 48, 8), dtype=np.uint8)
    want = numpy2base64(array)
    embedded = asyncio.run(state.encode_experts(array))
    assert isinstance(embedded, msgspec.Raw)
    assert bytes(embedded) == b'"' + want.encode() + b'"'
    choice = p.CompletionResponseChoice(index=0, text="a", routed_experts=embedded)
    plain = p.CompletionResponseChoice(index=0, text="a", routed_experts=want)
    assert msgspec.json.encode(choice) == msgspec.json.encode(plain)
    assert encode_json(choice) == encode_json(plain)  # Litestar's encoder, which writes the responses
    chunk = p.CompletionStreamResponse(id="c", created=0, model="m", choices=[p.CompletionResponseStreamChoice(index=0, text="", routed_experts=embedded)])
    assert json.loads(sse(chunk)[len(b"data: ") :])["choices"][0]["routed_experts"] == want
    assert state.metrics.routed_experts_bytes._value.get() == len(want)  # the base64 text, not the quotes

"""SSE helpers alone: per-choice deltas from cumulative outputs, and errors after the headers."""

from __future__ import annotations

import asyncio
import json

from r3srv.errors import InvalidRequestError
from r3srv.outputs import CompletionOutput
from r3srv.server.streaming import DONE, _guarded, _Tracker


def test_tracker_emits_each_new_piece_once():
    tracker = _Tracker()
    first = tracker.delta(0, CompletionOutput(index=0, text="", token_ids=[]))
    assert first is not None and first.first and not first.text  # opens the choice
    assert tracker.delta(0, CompletionOutput(index=0, text="", token_ids=[])) is None  # nothing new
    d = tracker.delta(0, CompletionOutput(index=0, text="ab", token_ids=[1, 2], logprobs=[{1: -0.1}, {2: -0.2}]))
    assert (d.text, d.token_ids, d.logprobs, d.first, d.final) == ("ab", [1, 2], [{1: -0.1}, {2: -0.2}], False, False)
    d = tracker.delta(0, CompletionOutput(index=0, text="abc", token_ids=[1, 2, 3], finish_reason="length"))
    assert (d.text, d.token_ids, d.text_offset, d.final) == ("c", [3], 2, True)
    assert tracker.delta(0, CompletionOutput(index=0, text="abc", token_ids=[1, 2, 3], finish_reason="length")) is None
    # choices of other prompts are tracked separately
    assert tracker.delta(1, CompletionOutput(index=0, text="z", token_ids=[9])).token_ids == [9]


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

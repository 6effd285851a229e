"""run_sized: small work inline on the caller's thread, large work on a worker thread, same results and errors."""

import asyncio
import threading

import pytest

from r3srv.offload import OFFLOAD_MIN_SIZE, run_sized


def where(tag: str) -> tuple[str, int]:
    return tag, threading.get_ident()


def fail(message: str) -> None:
    raise ValueError(message)


def test_small_inline_large_on_a_worker_thread():
    async def main():
        here = threading.get_ident()
        small = await run_sized(OFFLOAD_MIN_SIZE - 1, where, "small")
        large = await run_sized(OFFLOAD_MIN_SIZE, where, tag="large")
        return here, small, large

    here, small, large = asyncio.run(main())
    assert small == ("small", here)
    assert large[0] == "large" and large[1] != here


@pytest.mark.parametrize("size", [0, OFFLOAD_MIN_SIZE * 4])
def test_errors_propagate_from_either_path(size):
    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(run_sized(size, fail, "bad input"))

"""vLLM's sleep mode (/sleep, /wake_up, /is_sleeping) on r3srv's pause and memory release.

vLLM 0.33 (v1/engine/core.py): sleep pauses scheduling in `mode` (abort, wait or keep the
requests in flight); level 0 does only that; level 1 also empties the prefix cache, moves the
weights to host memory and drops the KV cache; level 2 drops the weights too. wake_up(tags)
brings back "weights" and/or "kv_cache" (None: both; "scheduling" alone changes no memory) and
resumes scheduling once nothing is asleep.

On r3srv level 1 and 2 release both tags (engine/core.py: release_memory): the weights go to host
memory at either level, so a wake without a new push serves the weights it had (vLLM's level 2
would need a push first); a trainer that pushes new weights meanwhile loads them into that copy.
A release needs no request in flight, so level >= 1 takes mode abort or wait, not keep (a 400).
"""

from __future__ import annotations

from r3srv.errors import InvalidRequestError

SLEEP_LEVELS = (0, 1, 2)
SLEEP_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


async def sleep(engine, level: int, mode: str) -> None:
    """Pause, and at level >= 1 release the KV cache and the weights. `engine`: an AsyncLLM."""
    if level not in SLEEP_LEVELS:
        raise InvalidRequestError(f"level must be 0, 1 or 2, got {level}", param="level")
    if mode not in SLEEP_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}", param="mode")
    if level >= 1 and mode == "keep":
        raise InvalidRequestError(
            "mode=keep holds the requests in flight, and sleep level >= 1 releases the memory they hold: "
            "use mode=abort or mode=wait, or level=0", param="mode")
    await engine.pause_generation(mode)
    if level >= 1:
        await engine.reset_prefix_cache()
        await engine.release_memory(["kv_cache", "weights"])


async def wake_up(engine, tags: list[str] | None) -> bool:
    """Take back `tags` (None: everything); resume generation once nothing is released.
    Returns whether the engine is fully awake."""
    unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
    if unknown:
        raise InvalidRequestError(f"tags: {unknown} unknown; known: {', '.join(WAKE_TAGS)}", param="tags")
    memory = None if tags is None else [t for t in tags if t != "scheduling"]
    if memory is None or memory:
        await engine.resume_memory(memory)
    fully_awake = not engine.released_memory
    if fully_awake:
        await engine.continue_generation()
    return fully_awake


def is_sleeping(engine) -> bool:
    """vLLM's rule: scheduling paused (by /sleep or /pause) or any memory released."""
    return engine.paused is not None or bool(engine.released_memory)

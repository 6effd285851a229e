"""A request's images, made ready before its prompts reach the engine: each reference read
(r3srv/vision/media.py: data: URIs, allowed files and hosts), then decoded, preprocessed and
its placeholders expanded off the event loop (InputProcessor.expand_images), so a route knows
each prompt's expanded length (SGLang clips max_new_tokens to the room it leaves)."""

from __future__ import annotations

from r3srv.errors import InvalidRequestError
from r3srv.offload import run_sized
from r3srv.server.generation import ServerState
from r3srv.vision.inputs import MultiModalPrompt
from r3srv.vision.media import image_bytes


async def expand(state: ServerState, ids: list[int], refs: list[str], *, param: str, fields: list[str] | None = None,
                 bare_base64: bool = False) -> tuple[list[int], MultiModalPrompt | None]:
    """`ids` with the placeholders of the images `refs` name expanded, and those images; errors
    name `param` for the whole and fields[k] (default `param[k]`) for image k. The prompt
    unchanged when it has none."""
    if not refs:
        return ids, None
    if state.engine.input_processor.images is None:  # before any file is read or URL fetched
        raise InvalidRequestError(param=param, problem=": this model takes no image inputs")
    fields = fields or [f"{param}[{k}]" for k in range(len(refs))]
    images = [await image_bytes(ref, state.media, param=field, bare_base64=bare_base64)
              for ref, field in zip(refs, fields)]
    size = sum(len(image) for image in images)
    return await run_sized(size, state.engine.input_processor.expand_images, ids, images, param=param, fields=fields)

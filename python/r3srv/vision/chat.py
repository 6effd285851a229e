"""A conversation's images as vLLM's offline `LLM.chat` takes them: `image_url` content parts
(a base64 `data:image/...` URI; the offline API opens no files and fetches no URLs) and
`image_pil` parts (a PIL image). Each becomes the `{"type": "image"}` part the chat template
shows as its placeholder (vLLM's "openai" content format), as the chat route renders them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from r3srv.errors import InvalidRequestError
from r3srv.vision.media import MediaPolicy, decode_data_uri

IMAGE_PARTS = ("image_url", "image_pil")


def chat_images(messages: list[Any]) -> tuple[list[Any], list[Any], list[str]]:
    """(the messages as the template reads them, the images in order, the field each came in).
    A message whose content is a list holding anything but text parts has every part checked:
    another kind of part (video, audio, embeddings) is a 400 naming it."""
    rendered, images, fields = [], [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list) or all(_kind(part) == "text" for part in content):
            rendered.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            field, kind = f"messages[{i}].content[{j}]", _kind(part)
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text")})
                continue
            if kind not in IMAGE_PARTS:
                raise InvalidRequestError(param=field, problem=f": content parts of type {kind!r} are not supported "
                                          "by r3srv (text, image_url, image_pil)")
            images.append(_image(part, kind, f"{field}.{kind}"))
            fields.append(f"{field}.{kind}")
            parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images, fields


def _kind(part: Any) -> Any:
    return part.get("type") if isinstance(part, Mapping) else None


def _image(part: Mapping, kind: str, field: str) -> Any:
    value = part.get(kind)
    if kind == "image_pil":
        if value is None:
            raise InvalidRequestError(param=field, problem=" is missing (an image_pil part needs its PIL image)")
        return value  # the input processor checks its type
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url.lower().startswith("data:"):
        raise InvalidRequestError(param=field, problem=": offline chat takes data:image/...;base64 URIs (or "
                                  "image_pil parts); files and URLs only through the server's allowed media")
    return decode_data_uri(url, param=field, max_bytes=MediaPolicy.max_bytes)

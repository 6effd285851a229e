"""What identifies a prompt's images for the front: a digest of each image's encoded bytes, in
prompt order. Replicas key cached KV blocks and encoder outputs by image content, so a repeat or
next turn that sends the same images (in any form: a data: URI, bare base64, a file) should reach
the replica that has them, even when its token ids fill no KV block before the engine expands
the placeholders. The front hashes bytes only: pixels are decoded by the replica that serves the
request (its digest is of the decoded pixels), so one image re-encoded differently keys apart here.

References are read as the replicas read them (r3srv/vision/media.py, with the same media flags):
data: URIs and SGLang's bare base64 decoded, files read only under --allowed-local-media-path.
An http(s) URL is keyed by its text (the front fetches nothing), and so is a reference the
replica will refuse (it answers the 400 itself)."""

from __future__ import annotations

import hashlib
from typing import Any

from r3srv.errors import InvalidRequestError
from r3srv.vision.media import MediaPolicy, inline_image_bytes

Reference = tuple[str, bool]  # (the reference as sent, whether it may be SGLang's bare base64 or plain path)


def image_references(body: Any) -> list[Reference]:
    """The first prompt's image references in prompt order, from whichever field the dialect
    sends them in (SGLang's image_data, vLLM's content_parts, OpenAI chat's image_url parts)."""
    if not isinstance(body, dict):
        return []
    if body.get("image_data") is not None:
        return [(ref, True) for ref in _first_prompt_images(body)]
    if isinstance(body.get("content_parts"), list):
        return [(part["url"], False) for part in body["content_parts"]
                if isinstance(part, dict) and isinstance(part.get("url"), str)]
    messages = body.get("messages")
    if isinstance(messages, list):
        return [(url, False) for message in messages for url in _message_image_urls(message)]
    return []


def image_digests(references: list[Reference], media: MediaPolicy) -> list[bytes]:
    """A SHA-256 of each referenced image's bytes (of the reference's text where the front cannot read them)."""
    digests = []
    for ref, bare_base64 in references:
        try:
            data = inline_image_bytes(ref, media, param="image", bare_base64=bare_base64)
        except InvalidRequestError:
            data = None
        digests.append(hashlib.sha256(b"bytes:" + data if data is not None else b"reference:" + ref.encode()).digest())
    return digests


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _message_image_urls(message: Any) -> list[str]:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    urls = []
    for part in content:
        if is_image_part(part):
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(url, str):
                urls.append(url)
    return urls


def _first_prompt_images(body: dict[str, Any]) -> list[str]:
    """SGLang's image_data for the first prompt: one image for every prompt, a list for a single
    prompt (or that list wrapped once), or a batch's first entry (an image or a list)."""
    data = body["image_data"]
    if not isinstance(data, list):
        items = [data]
    elif _is_batch(body):
        first = data[0] if data else None
        items = first if isinstance(first, list) else [first]
    else:
        items = data[0] if len(data) == 1 and isinstance(data[0], list) else data
    refs = [item.get("url") if isinstance(item, dict) else item for item in items]
    return [ref for ref in refs if isinstance(ref, str)]


def _is_batch(body: dict[str, Any]) -> bool:
    ids = body.get("input_ids")
    if ids is not None:  # SGLang reads input_ids over text when both are given
        return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    return isinstance(body.get("text"), list)

"""Where a request's images come from, as clients send them: `data:` URIs (and SGLang's bare
base64), local files, and http(s) URLs. A server that opens paths or fetches URLs for its
callers is a request-forgery risk, so both are off unless the operator allows them:
files only under --allowed-local-media-path (vLLM's flag), URLs only to hosts of
--allowed-media-domains, with a size cap and a deadline. Every refusal is a 400 naming the
field; nothing about the server's files or network is echoed beyond what the client sent."""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from r3srv.errors import InvalidRequestError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif")  # SGLang's image_extension_names
IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp", "image/tiff")


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_path: Path | None = None  # files under this directory; None: no files
    allowed_domains: tuple[str, ...] = ()  # URL hosts (and their subdomains); empty: no URLs
    max_bytes: int = 20 << 20  # per image, however it arrives
    timeout_s: float = 5.0  # per URL fetch, connection to last byte

    def __post_init__(self) -> None:
        if self.allowed_local_path is not None:
            object.__setattr__(self, "allowed_local_path", Path(self.allowed_local_path).resolve())


def decode_data_uri(uri: str, *, param: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:image/...;base64,` URI; another media type is refused."""
    header, sep, payload = uri.partition(",")
    media = header.removeprefix("data:").split(";")
    if not sep or "base64" not in media[1:]:
        raise InvalidRequestError(param=param, problem=": a data: URI must be base64 (data:image/png;base64,...)")
    if media[0].lower() not in IMAGE_TYPES:
        raise InvalidRequestError(param=param, problem=f": a data: URI of type {media[0]!r} is not an image "
                                  f"({', '.join(IMAGE_TYPES)})")
    return decode_base64(payload, param=param, max_bytes=max_bytes)


def decode_base64(text: str, *, param: str, max_bytes: int) -> bytes:
    if len(text) > (max_bytes + 2) // 3 * 4 + 4:
        raise InvalidRequestError(param=param, problem=f" is larger than the {max_bytes} bytes an image may have")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(param=param, problem=" is not valid base64") from None


def read_local(location: str, policy: MediaPolicy, *, param: str) -> bytes:
    """A file under the allowed directory (after resolving links and '..'); else a 400 that
    says only that the path is not allowed."""
    root = policy.allowed_local_path
    if root is None:
        raise InvalidRequestError(param=param, problem=": local files are off (start the server with "
                                  "--allowed-local-media-path DIR)")
    path = Path(unquote(location)).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise InvalidRequestError(param=param, problem=": the path is not a file under the allowed media directory")
    if path.stat().st_size > policy.max_bytes:
        raise InvalidRequestError(param=param, problem=f" is larger than the {policy.max_bytes} bytes an image may have")
    return path.read_bytes()


async def fetch(url: str, policy: MediaPolicy, *, param: str) -> bytes:
    """An http(s) URL's body, from an allowed host, within the size cap and the deadline, with
    no redirects followed (a redirect could leave the allowed hosts)."""
    import httpx

    host = (urlsplit(url).hostname or "").lower()
    if not policy.allowed_domains:
        raise InvalidRequestError(param=param, problem=": image URLs are off (start the server with "
                                  "--allowed-media-domains)")
    if not any(host == d or host.endswith("." + d) for d in policy.allowed_domains):
        raise InvalidRequestError(param=param, problem=f": the host {host!r} is not an allowed media domain")
    async def get() -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client, client.stream("GET", url) as response:
            if response.status_code != 200:
                raise InvalidRequestError(param=param, problem=f": fetching the image answered HTTP "
                                          f"{response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > policy.max_bytes:
                    raise InvalidRequestError(param=param, problem=f" is larger than the {policy.max_bytes} bytes "
                                              "an image may have")
            return bytes(body)

    try:
        return await asyncio.wait_for(get(), policy.timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise InvalidRequestError(param=param, problem=f": fetching the image took longer than {policy.timeout_s} s"
                                  ) from None
    except httpx.HTTPError as exc:
        raise InvalidRequestError(param=param, problem=f": the image could not be fetched ({type(exc).__name__})") from None


async def image_bytes(source: str, policy: MediaPolicy, *, param: str, bare_base64: bool = False) -> bytes:
    """An image reference as a client sends it -> its bytes: a data: URI, file:// or (with
    `bare_base64`: SGLang's image_data) a plain path or bare base64, http(s)://."""
    data = inline_image_bytes(source, policy, param=param, bare_base64=bare_base64)
    return await fetch(source, policy, param=param) if data is None else data


def inline_image_bytes(source: str, policy: MediaPolicy, *, param: str, bare_base64: bool = False) -> bytes | None:
    """image_bytes without the network: the bytes of a data: URI, an allowed file or (with
    `bare_base64`) bare base64; None for an http(s) URL."""
    scheme = source.split(":", 1)[0].lower() if ":" in source[:12] else ""
    if scheme == "data":
        return decode_data_uri(source, param=param, max_bytes=policy.max_bytes)
    if scheme in ("http", "https"):
        return None
    if scheme == "file":
        return read_local(urlsplit(source).path, policy, param=param)
    if bare_base64 and not scheme:  # SGLang's rule: a name ending as an image file's is a path
        if source.lower().endswith(IMAGE_EXTENSIONS):
            return read_local(source, policy, param=param)
        return decode_base64(source, param=param, max_bytes=policy.max_bytes)
    raise InvalidRequestError(param=param, problem=": expected a data:image/...;base64 URI"
                              f"{', a file:// path' if policy.allowed_local_path else ''}"
                              f"{' or an http(s) URL' if policy.allowed_domains else ''}")

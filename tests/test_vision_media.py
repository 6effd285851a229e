"""Where images come from (r3srv/vision/media.py): data: URIs, SGLang's bare base64 and paths,
files only under the allowed directory, URLs only to allowed hosts (a local HTTP server on
127.0.0.1 stands for one), with the size cap, the deadline and no redirects; each refusal a
400 naming the field and echoing nothing of the server's files."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading

import pytest

from r3srv.errors import InvalidRequestError
from r3srv.vision.media import MediaPolicy, image_bytes
from vision_testing import image_bytes as make_image

PNG = make_image(20, 10, "RGB", "PNG", seed=1)


def run(coro):
    return asyncio.run(coro)


def refused(source: str, policy: MediaPolicy, match: str, *, bare: bool = False) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        run(image_bytes(source, policy, param="image_data[1]", bare_base64=bare))
    assert info.value.param == "image_data[1]"
    return info.value


def test_data_uris_and_sglangs_bare_base64():
    policy = MediaPolicy()
    b64 = base64.b64encode(PNG).decode()
    assert run(image_bytes(f"data:image/png;base64,{b64}", policy, param="x")) == PNG
    assert run(image_bytes(b64, policy, param="x", bare_base64=True)) == PNG
    refused(f"data:text/plain;base64,{b64}", policy, "not an image")
    refused("data:image/png,rawbytes", policy, "must be base64")
    refused("data:image/png;base64,@@@@", policy, "not valid base64")
    refused(f"data:image/png;base64,{b64}", MediaPolicy(max_bytes=len(PNG) // 2), "larger than")
    refused("no-scheme-here", policy, "expected a data:")  # only SGLang's image_data takes bare strings


def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir(), outside.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (outside / "key.png").write_bytes(b"secret bytes")
    (allowed / "link.png").symlink_to(outside / "key.png")
    refused(f"file://{allowed / 'cat.png'}", MediaPolicy(), "local files are off")
    policy = MediaPolicy(allowed_local_path=allowed)
    assert run(image_bytes(f"file://{allowed / 'cat.png'}", policy, param="x")) == PNG
    assert run(image_bytes(str(allowed / "cat.png"), policy, param="x", bare_base64=True)) == PNG
    for escape in (f"file://{outside / 'key.png'}", f"file://{allowed}/../secret/key.png", f"file://{allowed / 'link.png'}",
                   f"file://{allowed / 'missing.png'}"):
        error = refused(escape, policy, "not a file under the allowed media directory")
        assert str(outside) not in str(error) and "secret bytes" not in str(error)


class _Server:
    """Answers /image with PNG, /big with more than the cap, /moved with a redirect, /hang never."""

    def __init__(self) -> None:
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/hang":
                    server.release.wait()
                    return
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", "http://example.com/")
                    self.end_headers()
                    return
                body = PNG if self.path == "/image" else b"x" * 4096
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_urls_off_by_default_then_only_to_allowed_hosts(server):
    refused(f"{server.url}/image", MediaPolicy(), "image URLs are off")
    refused(f"{server.url}/image", MediaPolicy(allowed_domains=("example.com",)), "not an allowed media domain")
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), max_bytes=2048, timeout_s=60.0)  # a deadline no answer nears
    assert run(image_bytes(f"{server.url}/image", policy, param="x")) == PNG
    refused(f"{server.url}/big", policy, "larger than the 2048 bytes")
    refused(f"{server.url}/moved", policy, "answered HTTP 302")  # a redirect is not followed
    hasty = MediaPolicy(allowed_domains=("127.0.0.1",), timeout_s=0.5)
    refused(f"{server.url}/hang", hasty, "longer than 0.5 s")  # the server never answers

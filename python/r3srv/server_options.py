"""`r3srv serve`'s own options (the HTTP layer's; the engine's are engine_options.py's): declared
once, as the fields of `ServerOptions`, from which come the serve flags (`add_arguments`), the
options of a parsed command line (`ServerOptions.from_args`) and what the app is built with
(`server/app.py`'s `create_app(engine, options=...)`), so a new option needs a field and nothing else.
Imports nothing heavy: `r3srv --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from r3srv.vision.media import MediaPolicy

__all__ = ["CHAT_GROUP", "MEDIA_GROUP", "ServerOptions", "add_arguments", "positive_float", "positive_int"]

CHAT_GROUP = "tool calling and reasoning (chat completions)"
MEDIA_GROUP = "image inputs (vision-language models)"
_MEDIA = MediaPolicy()  # the library's media defaults are the flags' too


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def flag(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None,
         many: bool = False, metavar: str | None = None, group: str | None = None) -> Any:
    """A field that is a serve flag: --NAME; a bool is a switch (store_true), `many` takes one or
    more values; a default other than None or False is shown in the help."""
    return dataclasses.field(default=default, metadata={"flag": dict(
        help=help, parse=parse, choices=choices, many=many, metavar=metavar, group=group)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    host: str = flag("127.0.0.1", "address to bind")
    port: int = flag(8000, "port to bind", parse=int)
    listen_fd: int | None = flag(
        None, "serve on this inherited socket, already bound, instead of binding --host/--port (a fleet's "
        "supervisor hands each replica the socket it bound, so that no other process can take the port meanwhile)",
        parse=int, metavar="FD")
    served_model_name: str | None = flag(None, "model name in the API (default: the model's name)")
    routed_experts_encoding: str = flag(
        "auto", "how responses encode routed_experts: npy (vLLM's .npy base64), sglang (SGLang's raw int32 base64; on "
        "the OpenAI routes in sglext), prime-rl or skyrl (their {data, shape, ...} dicts); auto: each route's own "
        "peer's (npy on the OpenAI and /inference routes, sglang on /generate). Per request: routed_experts_encoding; "
        "/skyrl/v1/generate always sends skyrl's", choices=("auto", "npy", "sglang", "prime-rl", "skyrl"))
    max_request_body_bytes: int = flag(32 << 20, "larger bodies get 413", parse=positive_int)
    enable_weight_updates: bool = flag(
        False, "allow POST /update_weights_from_disk and /reset_prefix_cache (RL trainers; off by default: the first "
        "loads any checkpoint directory the server can read)")
    enable_memory_saver: bool = flag(
        False, "SGLang's flag: say in /server_info that a trainer releases this server's memory between rollouts "
        "(slime and miles compare it with their offload flag); the memory routes need --enable-weight-updates")
    enable_sleep_mode: bool = flag(
        False, "vLLM's flag: serve /sleep, /wake_up and /is_sleeping (vLLM: development mode; needs "
        "--enable-weight-updates)")
    enable_collective_rpc: bool = flag(
        False, "serve /collective_rpc for the weight-sync methods SkyRL calls, from a fixed table (vLLM: development "
        "mode; needs --enable-weight-updates; docs/weight_sync.md)")
    lora_modules: list[str] | None = flag(
        None, "vLLM's flag: LoRA adapters (PEFT saves) loaded at start, each selected by its name as `model` (needs "
        "--enable-lora; docs/lora.md)", many=True, metavar="NAME=PATH")
    lora_paths: list[str] | None = flag(
        None, "SGLang's flag: the same, an adapter without a name named by its path (lora_path on /generate)",
        many=True, metavar="[NAME=]PATH")
    weight_sync_timeout: float = flag(
        600.0, "seconds a trainer's rendezvous or broadcast (/update_weights_from_distributed) may stall before the "
        "update fails, leaving the weights unchanged", parse=float)
    fleet_peer_urls: list[str] | None = flag(
        None, "other servers (or, with --data-parallel-size, other nodes' fronts) that control calls (pause, "
        "continue, weight updates, flush, abort, memory release) made to this server also reach (docs/fleet.md)",
        many=True, metavar="URL")
    enable_prompt_tokens_details: bool = flag(
        False, "add usage.prompt_tokens_details (cached_tokens: prompt tokens served from the prefix cache), as vLLM")
    return_tokens_as_token_ids: bool = flag(
        False, "logprob tokens as 'token_id:<id>' instead of their text, unless a request says otherwise (vLLM's "
        "flag; prime-rl's client reads ids this way)")
    generate_logprobs_format: str = flag(
        "tokens", "logprobs on /inference/v1/generate in tokens mode: tokens (vLLM 0.33's {token_id, logprob, rank}) "
        "or openai ({token, logprob, bytes, top_logprobs}, as vLLM answered before output_mode existed: vLLM 0.22, "
        "which prime-rl pins and its renderers client parses); output_mode=text always answers openai's",
        choices=("tokens", "openai"))
    timeout_headers: float = flag(
        60.0, "seconds a connection may take from its first byte to its complete request headers",
        parse=positive_float)
    timeout_body: float = flag(
        60.0, "seconds a request body may stall between two reads before the connection closes", parse=positive_float)
    min_body_rate: float = flag(
        500.0, "a request body must arrive at this rate on average once --timeout-body has passed: each BYTES_PER_S "
        "bytes received give it one more second, so a trickled body is cut (Apache mod_reqtimeout's MinRate)",
        parse=positive_float, metavar="BYTES_PER_S")
    log_level: str = flag("info", "log level", choices=("critical", "error", "warning", "info", "debug"))
    # tool calling and reasoning on /v1/chat/completions, vLLM's flags (docs/protocol.md, "Tool calling")
    enable_auto_tool_choice: bool = flag(
        False, "read the model's tool calls into message.tool_calls (needs --tool-call-parser)", group=CHAT_GROUP)
    tool_call_parser: str | None = flag(
        None, "the model's tool-call format: hermes, qwen3_coder, qwen3_xml, deepseek_v3, deepseek_v31, glm45, glm47, "
        "kimi_k2, openai (gpt-oss)", metavar="NAME", group=CHAT_GROUP)
    reasoning_parser: str | None = flag(
        None, "the model's reasoning format, into message.reasoning: qwen3, deepseek_r1, deepseek_v3, glm45, glm47, "
        "kimi_k2, openai_gptoss", metavar="NAME", group=CHAT_GROUP)
    # image inputs of vision-language models: where images may come from (docs/vision.md)
    allowed_local_media_path: str | None = flag(
        None, "let requests read images from files under DIR (vLLM's flag; off by default: a server opening paths "
        "for its callers is a risk)", metavar="DIR", group=MEDIA_GROUP)
    allowed_media_domains: list[str] | None = flag(
        None, "let requests name http(s) image URLs on these hosts and their subdomains (off by default: a server "
        "fetching URLs for its callers is a request-forgery risk)", many=True, metavar="DOMAIN", group=MEDIA_GROUP)
    max_media_bytes: int = flag(_MEDIA.max_bytes, "most bytes one image may have, however it arrives",
                                parse=positive_int, group=MEDIA_GROUP)
    media_fetch_timeout: float = flag(_MEDIA.timeout_s, "seconds an image URL may take, connection to last byte",
                                      parse=positive_float, group=MEDIA_GROUP)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        """The options of a parsed `r3srv serve` command line."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def media_policy(self) -> MediaPolicy:
        """Where a request's images may come from (a fleet's front reads them too)."""
        return MediaPolicy(self.allowed_local_media_path, tuple(d.lower() for d in self.allowed_media_domains or ()),
                           self.max_media_bytes, self.media_fetch_timeout)


def add_arguments(parser: argparse.ArgumentParser, group: str | None) -> None:
    """The flags of the options in `group` (None: the ungrouped ones) on `parser` or, for a named
    group, on an argument group of that name."""
    target: Any = parser if group is None else parser.add_argument_group(group)
    for f in dataclasses.fields(ServerOptions):
        spec = f.metadata["flag"]
        if spec["group"] != group:
            continue
        name = "--" + f.name.replace("_", "-")
        if f.default is False:
            target.add_argument(name, action="store_true", help=spec["help"])
            continue
        shown = "" if f.default is None else " (default: %(default)s)"
        target.add_argument(name, type=spec["parse"], default=f.default, choices=spec["choices"],
                            nargs="+" if spec["many"] else None, metavar=spec["metavar"], help=spec["help"] + shown)

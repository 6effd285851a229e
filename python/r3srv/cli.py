"""`r3srv serve [MODEL]`: the OpenAI-compatible server, with the flags users know from `vllm serve`.

The engine is built before the port is bound, so a bad configuration exits with
status 2 and the engine's message and never opens a socket. SIGINT and SIGTERM
stop uvicorn gracefully; the app's lifespan then shuts the engine down (exit 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from r3srv import engine_options, security, settings
from r3srv.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from r3srv.vision.media import MediaPolicy

logger = logging.getLogger("r3srv.serve")

EXIT_CONFIG_ERROR = 2
EXIT_ENGINE_DIED = 3  # the engine loop (or a tensor-parallel rank) died while serving: restart the server
# after a rank died: the process exits this long after even if a collective holds the shutdown
_RANK_DEATH_HARD_EXIT_S = 15.0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


# Connection deadlines (server/connections.py's guarded_h11 takes them from these flags)
DEFAULT_HEADER_TIMEOUT_S = 60.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MIN_BODY_RATE = 500.0  # bytes per second, Apache mod_reqtimeout's default MinRate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r3srv", description="OpenAI-compatible MoE server that returns routed experts")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI + vLLM scale-out APIs)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    serve.add_argument(
        "--routed-experts-encoding",
        choices=["auto", "npy", "sglang", "prime-rl", "skyrl"],
        default="auto",
        help="how responses encode routed_experts: npy (vLLM's .npy base64), sglang (SGLang's raw int32 base64; on "
        "the OpenAI routes in sglext), prime-rl or skyrl (their {data, shape, ...} dicts); auto: each route's own "
        "peer's (npy on the OpenAI and /inference routes, sglang on /generate). Per request: routed_experts_encoding; "
        "/skyrl/v1/generate always sends skyrl's (default: %(default)s)",
    )
    serve.add_argument("--served-model-name", default=None, help="model name in the API (default: the model's name)")
    serve.add_argument(
        "--max-request-body-bytes", type=_positive_int, default=None, help="larger bodies get 413 (default: 32 MiB)"
    )
    serve.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="allow POST /update_weights_from_disk and /reset_prefix_cache (RL trainers; off by default: "
        "the first loads any checkpoint directory the server can read)",
    )
    serve.add_argument(
        "--enable-memory-saver", action="store_true",
        help="SGLang's flag: say in /server_info that a trainer releases this server's memory between rollouts "
        "(slime and miles compare it with their offload flag); the memory routes need --enable-weight-updates",
    )
    serve.add_argument(
        "--enable-sleep-mode", action="store_true",
        help="vLLM's flag: serve /sleep, /wake_up and /is_sleeping (vLLM: development mode; needs "
        "--enable-weight-updates)",
    )
    serve.add_argument(
        "--enable-collective-rpc", action="store_true",
        help="serve /collective_rpc for the weight-sync methods SkyRL calls, from a fixed table (vLLM: "
        "development mode; needs --enable-weight-updates; docs/weight_sync.md)",
    )
    serve.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="vLLM's flag: LoRA adapters (PEFT saves) loaded at start, each selected by its name as `model` "
        "(needs --enable-lora; docs/lora.md)",
    )
    serve.add_argument(
        "--lora-paths", nargs="+", default=None, metavar="[NAME=]PATH",
        help="SGLang's flag: the same, an adapter without a name named by its path (lora_path on /generate)",
    )
    serve.add_argument(
        "--weight-sync-timeout", type=float, default=600.0,
        help="seconds a trainer's rendezvous or broadcast (/update_weights_from_distributed) may stall before the "
        "update fails, leaving the weights unchanged (default: %(default)s)",
    )
    serve.add_argument(
        "--fleet-peer-urls", nargs="+", default=None, metavar="URL",
        help="other servers (or, with --data-parallel-size, other nodes' fronts) that control calls (pause, "
        "continue, weight updates, flush, abort, memory release) made to this server also reach (docs/fleet.md)",
    )
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="add usage.prompt_tokens_details (cached_tokens: prompt tokens served from the prefix cache), as vLLM",
    )
    serve.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprob tokens as 'token_id:<id>' instead of their text, unless a request says otherwise "
        "(vLLM's flag; prime-rl's client reads ids this way)",
    )
    serve.add_argument(
        "--generate-logprobs-format",
        choices=["tokens", "openai"],
        default="tokens",
        help="logprobs on /inference/v1/generate in tokens mode: tokens (vLLM 0.33's {token_id, logprob, rank}) or "
        "openai ({token, logprob, bytes, top_logprobs}, as vLLM answered before output_mode existed: vLLM 0.22, which "
        "prime-rl pins and its renderers client parses); output_mode=text always answers openai's "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--timeout-headers", type=_positive_float, default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a connection may take from its first byte to its complete request headers (default: %(default)s)",
    )
    serve.add_argument(
        "--timeout-body", type=_positive_float, default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request body may stall between two reads before the connection closes (default: %(default)s)",
    )
    serve.add_argument(
        "--min-body-rate", type=_positive_float, default=DEFAULT_MIN_BODY_RATE, metavar="BYTES_PER_S",
        help="a request body must arrive at this rate on average once --timeout-body has passed: each BYTES_PER_S "
        "bytes received give it one more second, so a trickled body is cut (default: %(default)s)",
    )
    engine_options.add_arguments(serve)
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # tool calling and reasoning on /v1/chat/completions, vLLM's flags (docs/protocol.md, "Tool calling")
    chat = serve.add_argument_group("tool calling and reasoning (chat completions)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="read the model's tool calls into message.tool_calls (needs --tool-call-parser)")
    chat.add_argument("--tool-call-parser", default=None, metavar="NAME",
                      help="the model's tool-call format: hermes, qwen3_coder, qwen3_xml, deepseek_v3, deepseek_v31, "
                      "glm45, glm47, kimi_k2, openai (gpt-oss)")
    chat.add_argument("--reasoning-parser", default=None, metavar="NAME",
                      help="the model's reasoning format, into message.reasoning: qwen3, deepseek_r1, deepseek_v3, "
                      "glm45, glm47, kimi_k2, openai_gptoss")
    # image inputs of vision-language models: where images may come from (docs/vision.md)
    media = serve.add_argument_group("image inputs (vision-language models)")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let requests read images from files under DIR (vLLM's flag; off by default: a server "
                       "opening paths for its callers is a risk)")
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="DOMAIN",
                       help="let requests name http(s) image URLs on these hosts and their subdomains (off by "
                       "default: a server fetching URLs for its callers is a request-forgery risk)")
    media.add_argument("--max-media-bytes", type=_positive_int, default=20 << 20,
                       help="most bytes one image may have, however it arrives (default: %(default)s)")
    media.add_argument("--media-fetch-timeout", type=_positive_float, default=5.0,
                       help="seconds an image URL may take, connection to last byte (default: %(default)s)")
    security.add_arguments(serve)
    settings.add_arguments(serve)
    return parser


def _server_class(on_shutdown: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after its graceful shutdown, so the
            # process would die by SIGTERM (or KeyboardInterrupt): a stop we asked for is exit 0.
            self._captured_signals.clear()

        async def shutdown(self, sockets: Any = None) -> None:
            # End the requests in flight first (finish_reason "abort"), so open streams
            # finish at once instead of being cut after the graceful-shutdown timeout.
            await on_shutdown()
            await super().shutdown(sockets=sockets)

    return Server


def _peers_but_self(args: argparse.Namespace) -> list[str]:
    """The peers, without this server (so one list can be handed to every replica)."""
    own = {f"http://{host}:{args.port}" for host in (args.host, "127.0.0.1", "localhost", "0.0.0.0")}
    return [url.rstrip("/") for url in args.fleet_peer_urls or () if url.rstrip("/") not in own]


def _load_lora_modules(engine, args: argparse.Namespace) -> None:
    """--lora-modules name=path (vLLM's, also its JSON form) and --lora-paths [name=]path (SGLang's)."""
    import asyncio
    import json

    modules = []
    for flag, items in (("--lora-modules", args.lora_modules), ("--lora-paths", args.lora_paths)):
        for item in items or ():
            if item.lstrip().startswith("{"):
                spec = json.loads(item)
                modules.append((spec["name"], spec["path"]))
            elif "=" in item:
                modules.append(tuple(item.split("=", 1)))
            elif flag == "--lora-paths":
                modules.append((item, item))
            else:
                raise ConfigError(f"{flag} {item!r}: give name=path")
    if modules and not args.enable_lora:
        raise ConfigError("--lora-modules / --lora-paths need --enable-lora")

    async def load() -> None:
        for name, path in modules:
            await engine.load_lora_adapter(name, path)

    if modules:
        asyncio.run(load())


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """Where a request's images may come from (the media flags); a fleet's front reads them too."""
    from r3srv.vision.media import MediaPolicy

    return MediaPolicy(args.allowed_local_media_path, tuple(d.lower() for d in args.allowed_media_domains or ()),
                       args.max_media_bytes, args.media_fetch_timeout)


def serve(args: argparse.Namespace, own_process: bool = False) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from r3srv.errors import ConfigError

    try:  # before anything reads them: the model, the encoder
        settings.configure(settings.from_args(args))
        guard = security.ServeSecurity.from_args(args)
    except ConfigError as exc:
        print(f"r3srv serve: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if own_process:
        from r3srv.preload import reexec_with_tcmalloc

        reexec_with_tcmalloc(args.device, settings.current().tcmalloc)
    # Imported here so `r3srv --help` stays fast.
    import uvicorn

    from r3srv.engine.async_llm import AsyncLLM
    from r3srv.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES, build_asgi_app
    from r3srv.server.connections import guarded_h11
    from r3srv.server.generation import LaunchFacts

    if args.data_parallel_size > 1 and (args.nnodes > 1 or args.master_port):
        print("r3srv serve: configuration error: --data-parallel-size runs its replicas on this machine, each "
              "replica's ranks on a free port of their own: leave out --nnodes and --master-port", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    for warning in guard.exposure_warnings(args.host, weight_updates=args.enable_weight_updates):
        if args.node_rank == 0:  # the other nodes serve no HTTP
            logger.warning("%s (docs/security.md)", warning)
    dev_flags = [flag for flag, on in (("--enable-sleep-mode", args.enable_sleep_mode),
                                        ("--enable-collective-rpc", args.enable_collective_rpc)) if on]
    if dev_flags and not args.enable_weight_updates:
        print(f"r3srv serve: configuration error: {' and '.join(dev_flags)} change the served weights and memory: "
              "add --enable-weight-updates", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.data_parallel_size > 1:  # N replicas behind this process, their front and supervisor
        from r3srv.data_parallel import serve_fleet

        return serve_fleet(args, build_parser(), guard)
    try:
        from r3srv.server.chat_output import ChatParsers

        chat_parsers = ChatParsers(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    except ConfigError as exc:
        print(f"r3srv serve: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        logger.warning("--tool-call-parser without --enable-auto-tool-choice reads no tool calls (as vLLM)")
    if args.model is None:
        logger.warning("no MODEL given: serving the built-in model, whose weights are RANDOM (text is meaningless)")
    if args.node_rank > 0:
        return _serve_node(args)
    try:
        engine = AsyncLLM(**engine_options.from_args(args))
    except ConfigError as exc:
        print(f"r3srv serve: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"r3srv serve: cannot load the model: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR

    try:
        _load_lora_modules(engine, args)
    except (ConfigError, InvalidRequestError) as exc:
        engine.shutdown()
        print(f"r3srv serve: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    name = args.served_model_name or engine.model_config.name
    engine_died = False
    server: Any = None

    def on_engine_death() -> None:
        nonlocal engine_died
        engine_died = True
        server.should_exit = True

    app = build_asgi_app(
        engine,
        served_model_name=name,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        enable_weight_updates=args.enable_weight_updates,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        generate_logprobs_format=args.generate_logprobs_format,
        routed_experts_encoding=args.routed_experts_encoding,
        on_engine_death=on_engine_death,
        weight_sync_timeout=args.weight_sync_timeout,
        fleet_peer_urls=_peers_but_self(args),
        keys=guard.keys(),
        confinement=guard.confinement(),
        launch=LaunchFacts(host=args.host, port=args.port, nnodes=args.nnodes, node_rank=args.node_rank,
                           enable_memory_saver=args.enable_memory_saver),
        enable_sleep_mode=args.enable_sleep_mode,
        enable_collective_rpc=args.enable_collective_rpc,
        chat_parsers=chat_parsers,
        media=media_policy(args),
    )
    logger.info(
        "serving %s on %s://%s:%d (device %s, routed experts %s by default, max_model_len=%d)",
        name,
        "https" if guard.tls else "http",
        args.host,
        args.port,
        engine.device,
        "returned" if engine.enable_return_routed_experts else "not returned",
        engine.max_model_len,
    )
    server_class = _server_class(app.state.abort_all)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        http=guarded_h11(args.timeout_headers, args.timeout_body, args.min_body_rate),
        **guard.uvicorn_ssl(),
        timeout_graceful_shutdown=5,
        access_log=args.log_level == "debug",
    )
    server = server_class(config)

    def rank_died(error: BaseException) -> None:
        # the engine is dead (/health 503, the app's watcher stops the server); exit even if a hung
        # collective holds the shutdown
        logger.error("the engine stopped: %s", error)
        timer = threading.Timer(_RANK_DEATH_HARD_EXIT_S, os._exit, args=(EXIT_ENGINE_DIED,))
        timer.daemon = True
        timer.start()

    engine.on_dead.append(rank_died)
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine_died:
        return EXIT_ENGINE_DIED
    # uvicorn exits quietly (started False) when it cannot bind the port.
    return 0 if server.started else 1


def _serve_node(args: argparse.Namespace) -> int:
    """A node other than node 0: its ranks' workers, which node 0's engine drives."""
    from r3srv.config import engine_config
    from r3srv.engine.multiproc_executor import rank_setup, run_node
    from r3srv.errors import ConfigError

    try:
        spec, rendezvous = rank_setup(engine_config(**engine_options.from_args(args)))
    except ConfigError as exc:
        print(f"r3srv serve: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    logger.info("node %d of %d: ranks %s for the engine at %s:%d", args.node_rank, args.nnodes,
                list(rendezvous.local_ranks), args.master_addr, args.master_port)
    return run_node(spec, rendezvous)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        # this process's own command line: it may re-execute itself (preload.py)
        return serve(args, own_process=argv is None and _is_entry_point())
    return 2  # unreachable: argparse requires a command


def _is_entry_point() -> bool:
    """Whether this process runs `python -m r3srv.cli` or the `r3srv` script."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(main_spec, "name", None) == "r3srv.cli" or os.path.basename(sys.argv[0]) == "r3srv"


if __name__ == "__main__":
    sys.exit(main())

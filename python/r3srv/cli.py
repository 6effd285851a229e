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
from typing import Any

from r3srv import engine_options, security, server_options, settings
from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.net import inherited_sockets
from r3srv.server_options import ServerOptions

logger = logging.getLogger("r3srv.serve")

EXIT_CONFIG_ERROR = 2
EXIT_ENGINE_DIED = 3  # the engine loop (or a tensor-parallel rank) died while serving: restart the server
# after a rank died: the process exits this long after even if a collective holds the shutdown
_RANK_DEATH_HARD_EXIT_S = 15.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r3srv", description="OpenAI-compatible MoE server that returns routed experts")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI + vLLM scale-out APIs)")
    server_options.add_arguments(serve, None)
    engine_options.add_arguments(serve)
    server_options.add_arguments(serve, server_options.CHAT_GROUP)
    server_options.add_arguments(serve, server_options.MEDIA_GROUP)
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
            # finish at once instead of being cut after the graceful-shutdown timeout, and
            # refuse the commands that waited for them (ServerState.stop_serving).
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
        from r3srv.preload import choose_openmp_wait, reexec_with_tcmalloc

        # before anything imports torch
        choose_openmp_wait(args.device, settings.current().openmp_kernel_threads)
        reexec_with_tcmalloc(args.device, settings.current().tcmalloc)
    # Imported here so `r3srv --help` stays fast.
    import uvicorn

    from r3srv.engine.async_llm import AsyncLLM
    from r3srv.heap import freeze_startup_heap
    from r3srv.server.app import build_asgi_app
    from r3srv.server.connections import guarded_h11

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

        options = ServerOptions.from_args(args)
        chat_parsers = ChatParsers.from_options(options)
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
        options=options,
        served_model_name=name,
        on_engine_death=on_engine_death,
        fleet_peer_urls=_peers_but_self(args),
        keys=guard.keys(),
        confinement=guard.confinement(),
        chat_parsers=chat_parsers,
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
    server_class = _server_class(app.state.stop_serving)
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
    logger.info("%d objects of the built server out of the garbage collector's reach", freeze_startup_heap())

    def rank_died(error: BaseException) -> None:
        # the engine is dead (/health 503, the app's watcher stops the server); exit even if a hung
        # collective holds the shutdown
        logger.error("the engine stopped: %s", error)
        timer = threading.Timer(_RANK_DEATH_HARD_EXIT_S, os._exit, args=(EXIT_ENGINE_DIED,))
        timer.daemon = True
        timer.start()

    engine.on_dead.append(rank_died)
    try:
        server.run(sockets=inherited_sockets(args.listen_fd))
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

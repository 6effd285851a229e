"""`r3srv serve --data-parallel-size N`: N replicas behind r3srv's own front, on one URL.

Each replica is a child `r3srv serve` on a free 127.0.0.1 port (device cuda:i when there are N
CUDA devices, else the CPU; with --tensor-parallel-size M, cuda:i*M and the M-1 devices after
it, its ranks meeting on a free port of their own). This process is the fleet's front
(front/app.py) on the public --host/--port, serving every route as one server does: generation
goes to the replica caching the prompt's prefix, control calls to every replica, process-group
calls to every replica with its own ranks; and it supervises the replicas (front/replicas.py):
one that exits is restarted on the fleet's current weights while the others serve.

Keys and TLS (docs/security.md): the front checks every request's key against its route's
declared access as one server does (server/auth.py) and serves TLS itself; the replicas listen
in plain HTTP on 127.0.0.1 with the same keys, given through $R3SRV_API_KEY and
$R3SRV_ADMIN_API_KEY (never on their command lines, which every user of the host can read), and
every call the front or the supervisor makes to them carries the fleet's own credential.

SIGTERM or SIGINT stops the front and every replica (exit 0); the replicas also get SIGTERM from
the kernel if this process dies outright: no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from r3srv.errors import ConfigError
from r3srv.net import inherited_sockets
from r3srv.security import ServeSecurity

logger = logging.getLogger("r3srv.fleet")

EXIT_CONFIG_ERROR = 2
# Flags the supervisor sets itself on each replica; every other serve flag is passed on unchanged.
_REPLICA_FLAGS = {"model", "host", "port", "listen_fd", "data_parallel_size", "device", "fleet_peer_urls",
                  "weight_version", "served_model_name", "help",
                  # keys reach a replica through its environment; TLS ends at the front
                  "api_key", "admin_api_key", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs"}


def replica_devices(device: str, n: int, tp: int = 1) -> list[str]:
    """Each replica's --device: cuda:0, cuda:tp, cuda:2tp, ... (a replica's tp ranks take the
    devices from there on), or the CPU for all of them."""
    if device == "cpu":
        return ["cpu"] * n
    if device not in ("auto", "cuda"):
        raise ConfigError(f"--device {device} names one device; with --data-parallel-size {n} use auto, cuda or cpu")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto" and count == 0:
        return ["cpu"] * n
    if count < n * tp:
        raise ConfigError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} CUDA devices, "
                          f"{count} found")
    return [f"cuda:{i * tp}" for i in range(n)]


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, *, model: str | None, port: int,
                 device: str, weight_version: str, served_model_name: str | None = None) -> list[str]:
    """The `r3srv serve` command of one replica: the fleet's flags as given, plus its own place.

    A replica restarted on updated weights keeps the fleet's model name (served_model_name): by
    default the name would come from the new checkpoint directory.
    """
    serve = _serve_parser(parser)
    argv = [sys.executable, "-m", "r3srv.cli", "serve"] + ([model] if model else [])
    for action in serve._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in _REPLICA_FLAGS or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif action.nargs == 0:  # store_true
            argv.append(flag)
        elif action.nargs in ("+", "*"):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--device", device, "--weight-version", weight_version]
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    return argv


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def supervisor_headers(guard: ServeSecurity) -> dict[str, str]:
    """Credentials for the supervisor's own calls to its replicas (/health, /model_info, /is_paused, a
    restarted replica's /pause_generation): the fleet's admin key, else its API key."""
    credential = guard.keys().fleet_credential
    return {"authorization": f"Bearer {credential}"} if credential else {}


def serve_fleet(args: argparse.Namespace, parser: argparse.ArgumentParser,
                guard: ServeSecurity = ServeSecurity()) -> int:
    from r3srv.front.replicas import Replica, ReplicaSet

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the supervisor's health polls are not news
    try:
        devices = replica_devices(args.device, args.data_parallel_size, args.tensor_parallel_size)
    except ConfigError as exc:
        print(f"r3srv serve: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    replicas = [Replica(i, 0, device) for i, device in enumerate(devices)]  # ports: bound at start

    def argv_for(r: Replica, model: str | None, version: str, name: str | None) -> list[str]:
        return replica_argv(parser, args, model=model, port=r.port, device=r.device, weight_version=version,
                            served_model_name=name)

    fleet = ReplicaSet(replicas, argv_for, model=args.model, weight_version=args.weight_version,
                       served_model_name=args.served_model_name, headers=supervisor_headers(guard),
                       environ=guard.key_environ())
    return asyncio.run(_run(args, fleet, guard))


async def _run(args: argparse.Namespace, fleet, guard: ServeSecurity) -> int:
    import uvicorn

    from r3srv.cli import _server_class
    from r3srv.front.app import Front, keyed
    from r3srv.front.policy import prompt_encoder
    from r3srv.server.connections import guarded_h11
    from r3srv.server_options import ServerOptions

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # until uvicorn takes the signals over
        loop.add_signal_handler(sig, stop.set)
    front = supervisor = None
    try:
        fleet.start_all()  # from this (the main) thread: see front/replicas.py
        code = await fleet.wait_all_up(stop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if code is not None:
            return code
        keys = guard.keys()
        front = Front(fleet, tp_size=args.tensor_parallel_size, block_size=args.block_size,
                      max_body_bytes=args.max_request_body_bytes,
                      peer_urls=args.fleet_peer_urls, encode=prompt_encoder(args.model),
                      credential=keys.fleet_credential, media=ServerOptions.from_args(args).media_policy())
        config = uvicorn.Config(keyed(front, keys), host=args.host, port=args.port, log_level=args.log_level,
                                lifespan="off", server_header=False, date_header=False, timeout_graceful_shutdown=5,
                                http=guarded_h11(args.timeout_headers, args.timeout_body, args.min_body_rate),
                                access_log=args.log_level == "debug", **guard.uvicorn_ssl())
        server = _server_class(fleet.stop_all)(config)  # stopping: the replicas first, so open streams end
        supervisor = asyncio.create_task(fleet.supervise())
        logger.info("fleet of %d replicas (%s) on %s://%s:%d: generation goes to the replica caching the "
                    "prompt's prefix, control calls to every replica", len(fleet.replicas),
                    ", ".join(f"{r.url} on {r.device}" for r in fleet.replicas), "https" if guard.tls else "http",
                    args.host, args.port)
        await server.serve(sockets=inherited_sockets(args.listen_fd))
        return 0 if server.started else 1
    finally:
        if supervisor is not None:
            supervisor.cancel()
        await fleet.stop_all()
        if front is not None:
            await front.aclose()

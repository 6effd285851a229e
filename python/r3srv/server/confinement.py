"""Where a request may make the server read weights from, and which trainers it may join.

`--allowed-weight-paths DIR...`: a checkpoint directory named by a request
(/update_weights_from_disk's `model_path`, prime-rl's `weight_dir`) must lie inside one of them,
after every symlink is resolved, and so must every file the loader reads there (its entries, and
the shards its `model.safetensors.index.json` names, which could point anywhere); otherwise the
request is a 403 naming the field. The engine is then handed the resolved path, not the one the
client wrote. A path outside is refused before it is looked at, so its answer says nothing about
what exists outside the allowed directories. Unset: any directory the server can read, as before.

`--allowed-trainer-hosts HOST...`: the `master_address` of a weight-update group
(/init_weights_update_group, vLLM's /init_weight_transfer_engine) must be one of these host names,
or resolve only to addresses inside these IP addresses or networks (CIDR); otherwise a 403.
Unset: any address.

The allowed directories are trusted: whoever can write inside them can already change the
served weights.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3srv.errors import PermissionDeniedError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _resolved(path: str) -> str | None:
    """The absolute path with every symlink resolved; None when the file system refuses the name."""
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):  # a NUL byte, a name too long to resolve
        return None


def _files_read(directory: str) -> Iterable[str]:
    """What the weight loader may open in `directory`: its entries, and the shards its index names."""
    from r3srv.errors import ConfigError
    from r3srv.models.loader import safetensors_files

    try:
        names = os.listdir(directory)
    except OSError:
        return []
    files = [os.path.join(directory, name) for name in names]
    try:
        files += [str(p) for p in safetensors_files(Path(directory))]
    except (ConfigError, OSError, ValueError):
        pass  # no readable shards: the load itself says so (a 400)
    return files


@dataclass(frozen=True)
class WeightPaths:
    """The directories requests may load weights from (resolved at start-up); None: anywhere."""

    roots: tuple[str, ...] | None = None

    @classmethod
    def allowing(cls, directories: Iterable[str] | None) -> WeightPaths:
        if directories is None:
            return cls(None)
        return cls(tuple(os.path.realpath(os.path.expanduser(d)) for d in directories))

    def confine(self, path: str, param: str) -> str:
        """`path` with its symlinks resolved when it and what the loader reads in it lie inside the
        allowed directories (`path` unchanged when any directory is allowed); else a 403 naming `param`."""
        if self.roots is None:
            return path
        real = _resolved(path)
        if real is None or not _inside(real, self.roots):
            raise PermissionDeniedError(
                f"{param}: {path[:256]!r} is outside the directories this server loads weights from "
                "(--allowed-weight-paths)", param=param)
        escaping = [f for f in _files_read(real) if not _inside(_resolved(f) or "", self.roots)]
        if escaping:
            raise PermissionDeniedError(
                f"{param}: {os.path.basename(escaping[0])!r} in {path[:256]!r} resolves outside the directories this "
                "server loads weights from (--allowed-weight-paths)", param=param)
        return real


def _network(text: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address `host` resolves to (an IP address resolves to itself); empty if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError, ValueError):
        return set()
    found = set()
    for *_, sockaddr in infos:
        try:
            found.add(ipaddress.ip_address(str(sockaddr[0]).split("%")[0]))
        except ValueError:
            continue
    return found


@dataclass(frozen=True)
class TrainerHosts:
    """The hosts a weight-update group may rendezvous at; None: any."""

    names: frozenset[str] | None = None
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def allowing(cls, hosts: Iterable[str] | None) -> TrainerHosts:
        if hosts is None:
            return cls(None)
        hosts = list(hosts)
        networks = [n for n in map(_network, hosts) if n is not None]
        names = frozenset(h.lower() for h in hosts if _network(h) is None)
        for name in names:  # a host name also admits the addresses it resolves to now
            networks += [ipaddress.ip_network(a) for a in _addresses(name)]
        return cls(names, tuple(networks))

    def check(self, address: str, param: str) -> None:
        """Nothing when a group may meet at `address`; else a 403 naming `param`. Resolves names
        (blocking: call it off the event loop)."""
        if self.names is None or address.lower() in self.names:
            return
        resolved = _addresses(address)
        if resolved and all(any(a in n for n in self.networks) for a in resolved):
            return
        raise PermissionDeniedError(
            f"{param}: {address[:256]!r} is not a trainer host this server may join (--allowed-trainer-hosts)",
            param=param)


@dataclass(frozen=True)
class Confinement:
    """What a server started with these flags lets requests reach (kept in `app.state.confinement`)."""

    weight_paths: WeightPaths = WeightPaths()
    trainer_hosts: TrainerHosts = TrainerHosts()


def confinement(request: Any) -> Confinement:
    """The confinement of the app serving `request` (none: an app built without one, as in tests)."""
    return request.app.state.get("confinement") or Confinement()

"""`r3srv serve`'s security flags: API and admin keys, TLS, where weights may come from and which
trainers may be joined (docs/security.md).

Light on purpose (no torch, no server imports at module level): `r3srv --help` builds its parser
from here. `ServeSecurity.from_args` turns the flags (and $R3SRV_API_KEY, $R3SRV_ADMIN_API_KEY)
into what the server needs: its keys (server/auth.py), its confinement (server/confinement.py) and
uvicorn's TLS arguments; a combination that cannot work is a ConfigError before the port is bound.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from r3srv import settings
from r3srv.errors import ConfigError

# vLLM's --ssl-cert-reqs takes the ssl module's numbers
CERT_REQS = {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional", ssl.CERT_REQUIRED: "required"}


def add_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("security (docs/security.md)")
    group.add_argument(
        "--api-key", nargs="+", default=None, metavar="KEY",
        help="require `Authorization: Bearer KEY` (any of these keys) on every inference route, as vLLM's flag "
        "(default: $R3SRV_API_KEY, comma-separated; none: open). Prefer the variable: a command line is visible to "
        "every user of the host")
    group.add_argument(
        "--admin-api-key", nargs="+", default=None, metavar="KEY",
        help="require one of these keys on every control, weight, memory and process-group route, as SGLang's flag "
        "(default: $R3SRV_ADMIN_API_KEY; none: the API keys guard those routes too)")
    group.add_argument(
        "--protect-probes", action="store_true",
        help="require a key on the probe routes too (/health, /metrics, /version, /get_load, /v1/loads, "
        "/health_generate); default: open, for load balancers, routers and Prometheus")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM), as vLLM's flag")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates are checked against")
    group.add_argument(
        "--ssl-cert-reqs", type=int, choices=sorted(CERT_REQS), default=int(ssl.CERT_NONE),
        help="client certificates: 0 not asked for, 1 checked when sent, 2 required (the ssl module's numbers, "
        "as vLLM's flag; default: %(default)s)")
    group.add_argument(
        "--allowed-weight-paths", nargs="+", default=None, metavar="DIR",
        help="load weights named by requests (/update_weights_from_disk, prime-rl's weight_dir) only from inside "
        "these directories, symlinks resolved; others are a 403 (default: any directory the server can read)")
    group.add_argument(
        "--allowed-trainer-hosts", nargs="+", default=None, metavar="HOST",
        help="join weight-update groups only at these host names, IP addresses or networks (CIDR); others are a "
        "403 (default: any address)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _checked_keys(flag: str, keys: list[str]) -> tuple[str, ...]:
    bad = [k for k in keys if not k or "," in k or k != k.strip()]
    if bad:  # never print the key itself
        raise ConfigError(f"{flag}: a key must be non-empty, without ',' and without leading or trailing spaces")
    return tuple(keys)


@dataclass(frozen=True)
class ServeSecurity:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    protect_probes: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    allowed_weight_paths: tuple[str, ...] | None = None
    allowed_trainer_hosts: tuple[str, ...] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeSecurity:
        """The flags as given, keys from their variables where the flags are absent (as vLLM's
        --api-key over $VLLM_API_KEY; `environ`: this process's by default); a ConfigError for a
        combination that cannot work."""
        api = args.api_key if args.api_key is not None else settings.secret_keys("api_key", environ)
        admin = args.admin_api_key if args.admin_api_key is not None else settings.secret_keys("admin_api_key", environ)
        found = cls(
            api_keys=_checked_keys("--api-key", api), admin_keys=_checked_keys("--admin-api-key", admin),
            protect_probes=args.protect_probes, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            allowed_weight_paths=tuple(args.allowed_weight_paths) if args.allowed_weight_paths else None,
            allowed_trainer_hosts=tuple(args.allowed_trainer_hosts) if args.allowed_trainer_hosts else None,
        )
        found._check()
        return found

    def _check(self) -> None:
        if (self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs != ssl.CERT_NONE) and not self.ssl_certfile:
            raise ConfigError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (HTTPS)")
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_ca_certs:
            raise ConfigError(f"--ssl-cert-reqs {self.ssl_cert_reqs} checks client certificates: give the CAs "
                              "that issue them (--ssl-ca-certs)")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path!r} is not a file")
        for path in self.allowed_weight_paths or ():
            if not os.path.isdir(os.path.expanduser(path)):
                raise ConfigError(f"--allowed-weight-paths {path!r} is not a directory")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def keys(self) -> Any:
        """The server's ApiKeys (server/auth.py)."""
        from r3srv.server.auth import ApiKeys

        return ApiKeys.from_keys(self.api_keys, self.admin_keys, protect_probes=self.protect_probes)

    def confinement(self) -> Any:
        """What requests may reach: the server's Confinement (server/confinement.py)."""
        from r3srv.server.confinement import Confinement, TrainerHosts, WeightPaths

        return Confinement(WeightPaths.allowing(self.allowed_weight_paths),
                           TrainerHosts.allowing(self.allowed_trainer_hosts))

    def uvicorn_ssl(self) -> dict[str, Any]:
        """uvicorn.Config's TLS arguments (none without --ssl-certfile)."""
        if not self.tls:
            return {}
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile,
                "ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": self.ssl_cert_reqs}

    def key_environ(self) -> dict[str, str]:
        """The variables that give a child server (a fleet's replica) these keys, off its command line."""
        names = settings.SECRET_ENV_NAMES
        return {names["api_key"]: ",".join(self.api_keys), names["admin_api_key"]: ",".join(self.admin_keys)}

    def exposure_warnings(self, host: str, *, weight_updates: bool) -> list[str]:
        """What a server listening on `host` leaves open to whoever reaches it (nothing on loopback)."""
        if _is_loopback(host):
            return []
        warnings = []
        if not self.api_keys and not self.admin_keys:
            warnings.append(f"listening on {host} without --api-key or --admin-api-key: anyone who reaches the port "
                            "can generate" + (" and call the control and weight routes" if weight_updates else ""))
        elif not self.admin_keys and weight_updates:
            warnings.append("no --admin-api-key: the API keys also open the control and weight routes")
        if weight_updates and self.allowed_weight_paths is None:
            warnings.append("--enable-weight-updates without --allowed-weight-paths: a request may load weights from "
                            "any directory this server can read")
        if (self.api_keys or self.admin_keys) and not self.tls:
            warnings.append(f"keys travel in clear text on {host}: serve HTTPS (--ssl-certfile, --ssl-keyfile) or keep "
                            "the port on a private network")
        return warnings

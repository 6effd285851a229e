"""Every option of the HTTP layer is declared once (a field of server_options.ServerOptions) and
is, from that one declaration, a `r3srv serve` flag with the field's default, what the app is built
with, and part of a fleet replica's command line."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from r3srv.cli import build_parser
from r3srv.data_parallel import replica_argv
from r3srv.errors import ConfigError
from r3srv.server.app import create_app
from r3srv.server.chat_output import ChatParsers
from r3srv.server.declare import Feature
from r3srv.server_options import ServerOptions

FIELDS = dataclasses.fields(ServerOptions)
# the supervisor's per replica (data_parallel.replica_argv): where it listens (the socket it binds
# for each replica, front/replicas.py), its name; the fleet's peers are its front's to reach, not
# each replica's
REPLICA_OWN = {"host", "port", "listen_fd", "served_model_name", "fleet_peer_urls"}


def _serve_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {a.dest: a for a in serve._actions}


def _other_value(f: dataclasses.Field):
    """A value a user might pass other than the default, of the option's kind."""
    action = _serve_actions()[f.name]
    if f.default is False:
        return True
    if action.choices:
        return next(c for c in action.choices if c != f.default)
    if action.nargs == "+":
        return [f"{f.name}-a", f"{f.name}-b"]
    if f.default is None:
        return 7 if action.type is int else f"{f.name}-value"
    if isinstance(f.default, str):
        return f"{f.default}-other"
    return f.default + (3 if isinstance(f.default, int) else 0.25)


def _argv(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *value]
        else:
            argv += [flag, str(value)]
    return argv


def test_every_option_is_a_serve_flag_with_its_fields_default():
    actions = _serve_actions()
    for f in FIELDS:
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")], f.name
        assert action.default == f.default, f.name
    assert ServerOptions.from_args(build_parser().parse_args(["serve"])) == ServerOptions()


def test_each_flag_sets_its_option_and_a_replica_gets_it():
    values = {f.name: _other_value(f) for f in FIELDS}
    parser = build_parser()
    args = parser.parse_args(["serve", *_argv(values)])
    assert dataclasses.asdict(ServerOptions.from_args(args)) == values
    argv = replica_argv(parser, args, model=None, port=9, device="cpu", weight_version="w")
    child = dataclasses.asdict(ServerOptions.from_args(parser.parse_args(argv[3:])))
    assert {k: v for k, v in child.items() if k not in REPLICA_OWN} == \
        {k: v for k, v in values.items() if k not in REPLICA_OWN}
    assert (child["host"], child["port"]) == ("127.0.0.1", 9)


def test_a_bad_value_is_refused_by_the_parser():
    for flag, value in (("--max-media-bytes", "0"), ("--timeout-body", "-1"), ("--port", "eighty")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, value])


class _Engine:
    """What create_app reads of an engine before any request."""

    class core:
        lora = None

    @staticmethod
    def stats():
        return None


def test_the_app_serves_what_its_options_say():
    options = ServerOptions(enable_weight_updates=True, enable_sleep_mode=True, max_request_body_bytes=1234,
                            allowed_media_domains=["Example.COM"], max_media_bytes=99)
    app = create_app(_Engine(), served_model_name="m", options=options)
    state = app.state.server
    assert state.options is options
    assert state.features == {Feature.WEIGHT_UPDATES, Feature.SLEEP_MODE}
    assert (state.media.allowed_domains, state.media.max_bytes) == (("example.com",), 99)
    assert app.request_max_body_size == 1234
    plain = create_app(_Engine(), served_model_name="m").state.server
    assert plain.features == frozenset() and plain.options == ServerOptions()


def test_the_chat_parsers_the_options_name_are_checked():
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ChatParsers.from_options(ServerOptions(tool_call_parser="no-such-parser"))
    parsers = ChatParsers.from_options(ServerOptions(tool_call_parser="hermes", enable_auto_tool_choice=True))
    assert parsers.tools_served

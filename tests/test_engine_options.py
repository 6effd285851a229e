"""Every engine option is declared once (a field of EngineConfig or ParallelConfig) and is, from
that one declaration, a `r3srv serve` flag and a keyword of LLM, AsyncLLM and
LLMEngine.from_kwargs, with the one default."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from r3srv import LLM, engine_options
from r3srv.cli import build_parser
from r3srv.config import EngineConfig, ParallelConfig, engine_config
from r3srv.data_parallel import replica_argv
from r3srv.engine.async_llm import AsyncLLM
from r3srv.engine.llm_engine import LLMEngine
from r3srv.errors import ConfigError

OPTIONS = list(engine_options.options())
# The serve flags of the engine options as users pass them today (vllm serve's spellings):
# renaming one breaks their launch scripts, so this list is the contract, not derived.
FLAGS = (
    "--device", "--dtype", "--enable-return-routed-experts", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--max-num-seqs", "--max-model-len", "--block-size", "--num-kv-blocks", "--kv-cache-memory-fraction",
    "--max-num-batched-tokens", "--max-logprobs", "--seed", "--async-scheduling", "--weight-version", "--cuda-graphs",
    "--enforce-eager", "--pipeline-parallel-size", "-pp", "--decode-context-parallel-size", "-dcp",
    "--prefill-context-parallel-size", "-pcp", "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
    "--enable-expert-parallel", "--master-addr", "--master-port", "--nnodes", "--node-rank",
)


def _serve_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {a.dest: a for a in serve._actions}


def _field_defaults() -> dict:
    fields = [*dataclasses.fields(EngineConfig), *dataclasses.fields(ParallelConfig)]
    return {f.name: f.default for f in fields if f.name != "parallel"}


def test_every_config_field_is_an_option():
    assert [o.name for o in OPTIONS] == list(_field_defaults())


def test_every_option_is_a_serve_flag_with_its_default():
    actions = _serve_actions()
    for opt in OPTIONS:
        action = actions[opt.name]
        assert action.default == opt.serve_default, opt.name
        assert (action.option_strings == []) == opt.positional, opt.name
        if not opt.positional:
            assert action.option_strings[0] == "--" + opt.name.replace("_", "-")
    parsed = engine_options.from_args(build_parser().parse_args(["serve"]))
    assert parsed == {opt.name: opt.serve_default for opt in OPTIONS}
    # serve starts elsewhere than the library only where a field says so (with its reason there)
    differs = {opt.name for opt in OPTIONS if opt.serve_default != opt.default}
    assert differs == {"device", "enable_return_routed_experts"}


def test_the_serve_flags_keep_their_names():
    usage = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in FLAGS:
        assert f" {flag} " in usage.replace("\n", " ").replace(",", " ").replace("]", " ").replace("[", " "), flag


@pytest.mark.parametrize("front", [LLM.__init__, AsyncLLM.__init__, LLMEngine.from_kwargs])
def test_every_option_is_a_keyword_with_the_fields_default(front):
    params = inspect.signature(front).parameters
    keywords = {name: p.default for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    defaults = _field_defaults()
    assert params["model"].default is None and defaults.pop("model") is None
    assert keywords == defaults


def _other_value(opt: engine_options.Option):
    """A value of the option's type other than its serve default (what a user might pass)."""
    if opt.type is bool:
        return not opt.serve_default
    if opt.choices:
        return next(c for c in opt.choices if c != opt.serve_default)
    if opt.type is str:
        return f"{opt.serve_default}-other"
    return (opt.serve_default or 0) + (3 if opt.type is int else 0.25)


def _flags_for(values: dict) -> list[str]:
    argv = []
    for opt in OPTIONS:
        value = values[opt.name]
        if opt.positional:
            argv.append(value)
        elif opt.type is bool:
            argv.append(opt.flag if value else "--no-" + opt.flag.removeprefix("--"))
        else:
            argv += [opt.flag, str(value)]
    return argv


def test_each_flag_sets_its_option():
    values = {opt.name: _other_value(opt) for opt in OPTIONS}
    values["model"] = "/some/checkpoint"
    args = build_parser().parse_args(["serve", *_flags_for(values)])
    assert engine_options.from_args(args) == values


def test_a_replica_gets_every_option_but_its_own_place():
    """data_parallel.replica_argv rebuilds a replica's command from the parser: every engine
    option given to the fleet reaches the replica, less what the supervisor sets per replica."""
    values = {opt.name: _other_value(opt) for opt in OPTIONS}
    values["model"] = "/fleet/model"
    parser = build_parser()
    args = parser.parse_args(["serve", *_flags_for(values)])
    argv = replica_argv(parser, args, model="/replica/model", port=9, device="cpu", peers=[], weight_version="w")
    child = engine_options.from_args(parser.parse_args(argv[3:]))
    own = {"model": "/replica/model", "device": "cpu", "weight_version": "w", "data_parallel_size": 1}
    assert child == {**values, **own}


def test_keywords_make_the_config_and_an_unknown_one_is_named():
    assert engine_config(**_field_defaults()) == EngineConfig()
    config = engine_config(None, max_num_seqs=3, tensor_parallel_size=1, master_addr="10.0.0.1")
    assert (config.max_num_seqs, config.parallel.master_addr) == (3, "10.0.0.1")
    with pytest.raises(ConfigError, match="unknown engine options max_num_seq, tp"):
        LLM(max_num_seq=3, tp=2)  # raised before any model loads


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().max_num_seqs = 3  # type: ignore[misc]

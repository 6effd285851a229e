"""Each tool-call and reasoning parser on its model's own output format: generated calls
rendered by the family's chat template (tests/data/chat_templates), parsed back whole and
streamed in random pieces."""

from __future__ import annotations

import pytest

from r3srv.tool_calls import output_parser
from tool_call_cases import CASES, arguments_of, chunks, rendered_output, streamed

SEEDS = range(12)


def _rendered(name, seed):
    case = CASES[name]
    return (case, *rendered_output(case, seed))


def _parser(case, expected, **kw):
    return output_parser(tool_parser=case.tool_parser, reasoning_parser=case.reasoning_parser, parse_tools=True,
                         tools=expected["tools"], **kw)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_template_rendered_calls_parse_back(name, seed):
    case, text, expected = _rendered(name, seed)
    parsed = _parser(case, expected).parse(text)
    assert [c.name for c in parsed.tool_calls] == [c["name"] for c in expected["calls"]], text
    assert [arguments_of(c.arguments) for c in parsed.tool_calls] == [c["arguments"] for c in expected["calls"]], text
    assert all(c.done for c in parsed.tool_calls)
    assert parsed.content == expected["content"], text
    if expected["reasoning"] is not None:
        assert (parsed.reasoning or "").strip() == expected["reasoning"], text


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_deltas_add_up_to_the_parse(name, seed):
    case, text, expected = _rendered(name, seed)
    whole = _parser(case, expected).parse(text)
    parts = streamed(_parser(case, expected), chunks(text, seed))
    assert parts["reasoning"] == whole.reasoning
    assert parts["content"] == whole.content
    assert [(c["name"], c["arguments"]) for c in parts["calls"]] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert len({c["id"] for c in parts["calls"]}) == len(parts["calls"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_choice_none_leaves_the_calls_in_the_text(name):
    case = CASES[name]
    text, expected = rendered_output(case, 0)
    parser = output_parser(tool_parser=case.tool_parser, reasoning_parser=case.reasoning_parser, parse_tools=False)
    if parser is None:
        return  # no reasoning parser either: the route sends the text as it is
    parsed = parser.parse(text)
    assert parsed.tool_calls == []


def test_parallel_tool_calls_false_keeps_the_first():
    case = CASES["hermes"]
    seed = next(s for s in range(50) if len(rendered_output(case, s)[1]["calls"]) > 1)
    text, expected = rendered_output(case, seed)
    parsed = _parser(case, expected, parallel_tool_calls=False).parse(text)
    assert [c.name for c in parsed.tool_calls] == [expected["calls"][0]["name"]]


def test_include_reasoning_false_drops_it():
    case = CASES["hermes"]
    text, expected = rendered_output(case, 1)
    assert _parser(case, expected, include_reasoning=False).parse(text).reasoning is None
    assert _parser(case, expected).parse(text).reasoning


@pytest.mark.parametrize("kwargs, message", [
    ({"enable_auto_tool_choice": True}, "requires --tool-call-parser"),
    ({"tool_parser": "nope", "enable_auto_tool_choice": True}, "--tool-call-parser 'nope'"),
    ({"reasoning_parser": "nope"}, "--reasoning-parser 'nope'"),
])
def test_bad_parser_flags_are_config_errors(kwargs, message):
    from r3srv.errors import ConfigError
    from r3srv.server.chat_output import ChatParsers

    with pytest.raises(ConfigError, match=message):
        ChatParsers(**kwargs)
    assert ChatParsers(tool_parser="hermes", enable_auto_tool_choice=True).tools_served
    assert not ChatParsers(tool_parser="hermes").tools_served  # vLLM reads no calls without auto tool choice

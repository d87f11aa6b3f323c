"""Issue 46 item 2: a chat answer's reasoning, content and tool calls are read by one object,
:class:`kiln.serving.output_parser.OutputParser`, whole (the JSON answer) or streamed (SSE); both
readings of the same text agree. The real Hermes and Qwen3 parsers, no model."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.reasoning import Qwen3ReasoningParser
from kiln.serving.output_parser import OutputParser
from kiln.serving.tool_parsers import HermesParser

ANSWER = ('<think>\nweigh the options\n</think>\n\nLet me look that up. '
          '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>')


def _streamed(parser: OutputParser, text: str, step: int) -> tuple[str, str, dict[int, list[str]], bool]:
    """``text`` fed ``step`` characters at a time: the reasoning, the content, each call's name and arguments."""
    stream = parser.stream()
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    thought, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        t, c, deltas = stream.feed(piece, i == len(pieces) - 1)
        thought, content = thought + t, content + c
        for d in deltas:
            if d.id is not None:
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return thought, content, calls, stream.called


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_whole_and_streamed_answers_agree(step):
    parser = OutputParser(HermesParser(), Qwen3ReasoningParser())
    message, reason = parser.message(ANSWER, "stop")
    thought, content, calls, called = _streamed(parser, ANSWER, step)
    assert reason == "tool_calls" and called
    assert message["reasoning_content"] == thought == "weigh the options"
    assert message["content"] == content.strip() == "Let me look that up."
    [call] = message["tool_calls"]
    assert calls == {0: [call["function"]["name"], call["function"]["arguments"]]}
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}


def test_a_forced_call_has_no_content_and_a_cut_call_keeps_its_arguments():
    parser = OutputParser(HermesParser(), None, forced=True)
    cut = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Os'
    message, reason = parser.message(cut, "length")
    assert message["content"] is None and reason == "length"
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "lookup" and call["function"]["arguments"].startswith('{"city"')
    _, content, calls, _ = _streamed(parser, cut, 4)
    assert content == "" and calls == {0: ["lookup", call["function"]["arguments"]]}


def test_the_prompt_that_left_the_span_open_makes_the_answer_start_as_reasoning():
    text = "still thinking\n</think>\n\nDone."
    opened = OutputParser(None, Qwen3ReasoningParser(), opened=True)
    closed = OutputParser(None, Qwen3ReasoningParser())
    assert opened.message(text, "stop")[0] == {"role": "assistant", "content": "Done.",
                                                "reasoning_content": "still thinking"}
    assert closed.message(text, "stop")[0]["reasoning_content"] is None
    assert not OutputParser(None, None).parses and opened.parses

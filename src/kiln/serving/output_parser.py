"""What a chat answer's text becomes: reasoning, content and tool calls, read by one object.

:class:`OutputParser` holds the request's tool-call parser (when tools are on), the server's
reasoning parser (when its chat template has one), whether ``tool_choice`` forces calls and
whether the rendered prompt left the reasoning span open. It turns a whole answer into the
OpenAI ``message`` (:meth:`OutputParser.message`) and follows a streamed choice
(:meth:`OutputParser.stream`): reasoning is split off first, then the content is read for
calls. The parsers ``serving.tool_call_parser`` and ``serving.reasoning_parser`` select are
built once per served model (:func:`tool_parser`, :func:`reasoning_parser`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from kiln.runtime.reasoning import ReasoningParser, ReasoningStream, prompt_opens_span, reasoning_parser_for
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.state import KilnState
from kiln.serving.tool_parsers import CallDelta, StreamState, ToolParser, tool_parser_for

# -- the parsers the server's settings select -------------------------------------------------


def tool_parser(state: KilnState) -> ToolParser:
    """The tool-call parser ``serving.tool_call_parser`` selects (``auto``: by the chat template's family)."""
    parser = state.extras.get("tool_parser")
    if parser is None:
        parser = state.extras["tool_parser"] = tool_parser_for(state.settings.serving.tool_call_parser,
                                                               state.engine.chat_template, state.engine.tokenizer)
    return cast(ToolParser, parser)


def reasoning_parser(state: KilnState) -> ReasoningParser | None:
    """The reasoning parser ``serving.reasoning_parser`` selects (``auto``: by the chat template's family)."""
    if "reasoning_parser" not in state.extras:
        state.extras["reasoning_parser"] = reasoning_parser_for(state.settings.serving.reasoning_parser,
                                                                state.engine.chat_template)
    return cast("ReasoningParser | None", state.extras["reasoning_parser"])


# -- the parser ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputParser:
    """How one chat request's answers are read: ``tools`` (``None`` when tools are off), ``reasoning``
    (``None`` when the template has no reasoning span), ``forced`` (the grammar writes only calls: the
    text between them is layout, never content), ``opened`` (the prompt left the reasoning span open)."""

    tools: ToolParser | None
    reasoning: ReasoningParser | None
    forced: bool = False
    opened: bool = False

    @classmethod
    def for_chat(cls, state: KilnState, req: ChatCompletionRequest, prompt: list[int]) -> OutputParser:
        """The parser of the answers to ``req``, whose rendered prompt is ``prompt``."""
        reasoning = reasoning_parser(state)
        opened = reasoning is not None and prompt_opens_span(reasoning, state.engine, prompt)
        return cls(tool_parser(state) if req.tools_on() else None, reasoning, req.forces_call(), opened)

    @property
    def parses(self) -> bool:
        """Whether the text is read at all (else it is all content)."""
        return self.tools is not None or self.reasoning is not None

    def message(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """A whole answer's ``ChatMessage`` and finish reason (``tool_calls`` when it called a tool and stopped)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        content: str | None = text
        if self.reasoning is not None:
            thought, content = self.reasoning.split(text, self.opened)
            message = {"role": "assistant", "content": content, "reasoning_content": thought}
        if self.tools is not None and self.forced:  # the grammar wrote only calls: a cut one keeps what it wrote
            _, calls = self.tools.parse_as_streamed(content or "")
            message = {**message, "content": None, "tool_calls": _wire_calls(calls) or None}
            reason = "tool_calls" if reason == "stop" else reason
        elif self.tools is not None:
            rest, calls = self.tools.parse(content or "")
            if calls:
                message = {**message, "content": rest, "tool_calls": _wire_calls(calls)}
                reason = "tool_calls" if reason == "stop" else reason
        return message, reason

    def stream(self) -> OutputStream:
        """One streamed choice's incremental reader."""
        return OutputStream(self)


def _wire_calls(calls: list[Any]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class OutputStream:
    """One choice's incremental parse: :meth:`feed` each text delta (``final`` with the choice's last
    one); it returns the reasoning and content released so far and the call pieces completed."""

    def __init__(self, parser: OutputParser):
        self._split: ReasoningStream | None = (parser.reasoning.stream(parser.opened)
                                               if parser.reasoning is not None else None)
        self._calls: StreamState | None = parser.tools.stream() if parser.tools is not None else None
        self._forced = parser.forced

    def feed(self, text: str, final: bool) -> tuple[str, str, list[CallDelta]]:
        thought = ""
        if self._split is not None:
            thought, text = _fed(self._split, text, final)
        deltas: list[CallDelta] = []
        if self._calls is not None:
            text, deltas = _fed(self._calls, text, final)
            if self._forced:
                text = ""
        return thought, text, deltas

    @property
    def called(self) -> bool:
        """Whether the choice began a tool call."""
        return self._calls is not None and bool(self._calls.calls)


def _fed(stream: Any, text: str, final: bool) -> tuple[Any, Any]:
    """``stream.feed(text)``, and with ``final`` what ``stream.finish()`` releases after it, part by part."""
    first, second = stream.feed(text)
    if final:
        more_first, more_second = stream.finish()
        first, second = first + more_first, second + more_second
    return first, second

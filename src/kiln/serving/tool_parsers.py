"""Tool-call parsers: a model's raw text -> OpenAI ``tool_calls``, chosen by name per template family.

As vLLM's ``--tool-call-parser``: each parser knows how one family of chat templates
asks the model to write a call, turns finished text into ``(content, calls)``, follows a
stream incrementally (content passes through as it comes; a call is sent once its block
is complete), and writes the grammar that forces a call when ``tool_choice`` is
``required`` or names a function (:mod:`kiln.runtime.constrained` enforces it).

``hermes`` (Hermes, Qwen2.5/Qwen3 templates): each call is a
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block. A block whose body is not
such JSON stays in the content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


class StreamState:
    """One choice's incremental parse: :meth:`feed` each text delta, :meth:`finish` at the end."""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def stream(self) -> StreamState:
        raise NotImplementedError

    def forcing_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance dialect) whose every sentence is one call (or, with ``parallel``,
        several) of one of ``tools`` (``{"name", "parameters"}``) with arguments valid for its schema."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    @staticmethod
    def call_from_body(body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            call = self.call_from_body(m.group(1).strip())
            if call is None:
                continue  # not a call: the block stays in the content
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        content = "".join(kept)
        if calls:
            content = content.strip()
        return (content or None), calls

    def stream(self) -> StreamState:
        return _HermesStream(self)

    def forcing_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        options = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                     "arguments": t.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
        schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON: no room to ramble in whitespace
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f'call: "{self.OPEN}\\n" body "\\n{self.CLOSE}"\n'
                f"body: %json {json.dumps(schema)}\n")


class _HermesStream(StreamState):
    def __init__(self, parser: HermesParser):
        self._p = parser
        self._buf = ""
        self._in_call = False
        self._called = False

    def _content(self, text: str) -> str:
        # whitespace between or after calls is layout, not content
        return "" if self._called and not text.strip() else text

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self._p.OPEN)
                if i < 0:
                    hold = _partial_suffix(self._buf, self._p.OPEN)
                    out.append(self._content(self._buf[: len(self._buf) - hold]))
                    self._buf = self._buf[len(self._buf) - hold:]
                    break
                out.append(self._content(self._buf[:i]))
                self._buf = self._buf[i + len(self._p.OPEN):]
                self._in_call = True
            j = self._buf.find(self._p.CLOSE)
            if j < 0:
                break
            body, self._buf = self._buf[:j], self._buf[j + len(self._p.CLOSE):]
            self._in_call = False
            call = self._p.call_from_body(body.strip())
            if call is None:
                out.append(self._p.OPEN + body + self._p.CLOSE)
            else:
                calls.append(call)
                self._called = True
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self._buf = self._buf, ""
        if self._in_call:  # a block the model did not close (e.g. the end token came first)
            self._in_call = False
            call = self._p.call_from_body(rest.strip())
            if call is not None:
                self._called = True
                return "", [call]
            return self._p.OPEN + rest, []
        return self._content(rest), []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (held back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesParser.name: HermesParser}
DEFAULT_TOOL_PARSER = HermesParser.name


def get_tool_parser(name: str = DEFAULT_TOOL_PARSER) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None

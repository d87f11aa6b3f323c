"""Tool-call parsers: a model's raw text -> OpenAI ``tool_calls``, chosen by name per template family.

As vLLM's ``--tool-call-parser``, ``serving.tool_call_parser`` picks one by name (``auto``:
by the chat template's family, :data:`TEMPLATE_FAMILIES`); each parser knows how one family of chat templates
asks the model to write a call, turns finished text into ``(content, calls)``, follows a
stream incrementally (content passes through as it comes; a call's name and id go out as
soon as they are written, then its arguments in fragments as they are generated, as
OpenAI streams ``delta.tool_calls``), and writes the grammar that forces a call when ``tool_choice`` is
``required`` or names a function (:mod:`kiln.runtime.constrained` enforces it). A parser is bound to the
served tokenizer (:class:`~kiln.serving.tags.TagSpelling`): where a tag such as Qwen3's ``<tool_call>``
is one added token, the forcing grammar names that token, so the model writes it as the template does.

``hermes`` (Hermes, Qwen2.5/Qwen3 templates): each call is a
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block. A block whose body is not
such JSON stays in the content, as vLLM leaves it. ``arguments`` is the arguments object's
JSON text exactly as the model wrote it, whole or streamed (the fragments concatenate to
it); a body that does not start ``{"name": "...", "arguments": {`` is sent whole when its
block closes. Streaming cannot take back what was sent: a block whose arguments began to
stream but that does not end as valid JSON stays a call with the text sent so far (with
``required`` or a named ``tool_choice`` the grammar rules that out).

``deepseek_v3`` (DeepSeek V3 and R1 templates): see :class:`DeepSeekV3Parser`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from kiln.serving.tags import TagSpelling, partial_suffix


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


@dataclass(frozen=True)
class CallDelta:
    """One piece of a streamed call: its first piece carries ``id`` and ``name``; the ``arguments``
    fragments of all its pieces concatenate to the call's arguments."""

    index: int  # the call's position among this choice's calls
    arguments: str
    id: str | None = None
    name: str | None = None


class StreamState:
    """One choice's incremental parse: :meth:`feed` each text delta, :meth:`finish` at the end.
    Both return the content to pass on and the call pieces completed so far; ``calls`` counts
    the calls begun."""

    calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError


class ToolParser:
    name = ""

    def __init__(self, tokenizer: Any | None = None):
        self.tags = TagSpelling(tokenizer)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def stream(self) -> StreamState:
        raise NotImplementedError

    def parse_as_streamed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """``text`` through :meth:`stream` at once: the content and the calls a stream of it sends, so a
        call cut short (``max_tokens``) keeps the arguments written so far, as streamed."""
        st = self.stream()
        content, deltas = st.feed(text)
        tail, more = st.finish()
        calls: dict[int, list[str]] = {}
        for d in deltas + more:
            if d.id is not None:
                calls[d.index] = [d.id, d.name or "", ""]
            calls[d.index][2] += d.arguments
        return content + tail, [ParsedCall(name, args, cid) for cid, name, args in calls.values()]

    def forcing_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance dialect) whose every sentence is one call (or, with ``parallel``,
        several) of one of ``tools`` (``{"name", "parameters"}``) with arguments valid for its schema."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    # a body's start up to its arguments object: what a stream waits for before sending the call's name
    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')

    @classmethod
    def call_from_body(cls, body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return ParsedCall(obj["name"], args)
        head = cls.HEAD.match(body)
        if head is not None:  # the arguments as written, so a stream's fragments add up to the same text
            scan = _JsonValueScan()
            end = scan.feed(body, head.end())
            raw = body[head.end():end]
            if scan.done and json.loads(raw) == args and json.loads(head.group(1)) == obj["name"]:
                return ParsedCall(obj["name"], raw)
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))

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
        # Each tool's arguments are a JSON document of their own (``%json``), so the local references its
        # schema makes (``#/$defs/...``, ``#``: what pydantic emits) resolve against its own root, exactly as
        # they do in ``response_format``. Compact JSON: no room to ramble in whitespace.
        rules, bodies = [], []
        for i, t in enumerate(tools):
            params = t.get("parameters") or {"type": "object"}
            params = {**params, "x-guidance": {"whitespace_flexible": False}}
            head = json.dumps('{"name":' + json.dumps(t["name"], ensure_ascii=False) + ',"arguments":',
                              ensure_ascii=False)
            rules.append(f'body{i}: {head} args{i} "}}"\nargs{i}: %json {json.dumps(params)}\n')
            bodies.append(f"body{i}")
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f'call: {self.tags.lark(self.OPEN)} "\\n" body "\\n" {self.tags.lark(self.CLOSE)}\n'
                f"body: {' | '.join(bodies)}\n" + "".join(rules))


class _JsonValueScan:
    """Finds where one JSON object or array ends, fed text a piece at a time (strings and escapes aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.done = False

    def feed(self, text: str, start: int = 0) -> int:
        """Scan ``text[start:]``; the index just past the value's end once :attr:`done`, else ``len(text)``."""
        for k in range(start, len(text)):
            ch = text[k]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return k + 1
        return len(text)


class _HermesStream(StreamState):
    def __init__(self, parser: HermesParser):
        self._p = parser
        self._buf = ""  # text not yet placed (a possible tag held back)
        self._in_call = False
        self._called = False
        self._body = ""  # the open block's text so far
        self._id: str | None = None  # the open block's call id, once its name went out
        self._args_at = 0  # where its arguments start in _body
        self._sent = 0  # how far into _body its arguments went out
        self._scan: _JsonValueScan | None = None

    def _content(self, text: str) -> str:
        # whitespace between or after calls is layout, not content
        return "" if self._called and not text.strip() else text

    def _progress(self, out: list[CallDelta]) -> None:
        """The open block grew: send its name once it is written, then its arguments so far."""
        if self._id is None:
            head = self._p.HEAD.match(self._body)
            if head is None:
                return
            self._id = ParsedCall("", "").id
            self._args_at = self._sent = head.end()
            self._scan = _JsonValueScan()
            out.append(CallDelta(self.calls, "", self._id, json.loads(head.group(1))))
            self.calls += 1
            self._called = True
        if self._scan is not None and not self._scan.done:
            end = self._scan.feed(self._body, self._sent)
            if end > self._sent:
                out.append(CallDelta(self.calls - 1, self._body[self._sent:end]))
                self._sent = end

    def _close(self, closed: bool, text: list[str], out: list[CallDelta]) -> None:
        """The open block ended (``closed``: by its tag, else by the end of the answer)."""
        self._progress(out)
        body, self._body, self._in_call = self._body, "", False
        call = self._p.call_from_body(body.strip())
        if self._id is not None:  # already streaming: send what the arguments still lack
            sent = body[self._args_at:self._sent]
            if call is not None and call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                out.append(CallDelta(self.calls - 1, call.arguments[len(sent):]))
            self._id = self._scan = None
        elif call is not None:
            out.append(CallDelta(self.calls, call.arguments, call.id, call.name))
            self.calls += 1
            self._called = True
        else:
            text.append(self._p.OPEN + body + (self._p.CLOSE if closed else ""))

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buf += text
        out: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self._p.OPEN)
                if i < 0:
                    hold = partial_suffix(self._buf, self._p.OPEN)
                    out.append(self._content(self._buf[: len(self._buf) - hold]))
                    self._buf = self._buf[len(self._buf) - hold:]
                    break
                out.append(self._content(self._buf[:i]))
                self._buf = self._buf[i + len(self._p.OPEN):]
                self._in_call = True
            j = self._buf.find(self._p.CLOSE)
            if j < 0:
                hold = partial_suffix(self._buf, self._p.CLOSE)
                self._body += self._buf[: len(self._buf) - hold]
                self._buf = self._buf[len(self._buf) - hold:]
                self._progress(deltas)
                break
            self._body += self._buf[:j]
            self._buf = self._buf[j + len(self._p.CLOSE):]
            self._close(True, out, deltas)
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        out: list[str] = []
        deltas: list[CallDelta] = []
        rest, self._buf = self._buf, ""
        if self._in_call:  # a block the model did not close (e.g. the end token came first)
            self._body += rest
            self._close(False, out, deltas)
            return "".join(out), deltas
        return self._content(rest), deltas


class DeepSeekV3Parser(ToolParser):
    """DeepSeek V3/R1 templates: calls in one ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` section, each
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the arguments in a fenced ``json`` block and
    ``<｜tool▁call▁end｜>``, calls apart by a newline (the tags are single added tokens in DeepSeek's tokenizer).
    The content is the text before the section; a section with no well-formed call stays content whole. A
    stream sends each call whole once its end tag arrives."""

    name = "deepseek_v3"
    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>([^\n<]+)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
                       re.DOTALL)

    @classmethod
    def calls_in(cls, section: str) -> list[tuple[int, ParsedCall]]:
        """The well-formed calls in ``section`` (the text after the opening tag), each with where it ends."""
        out = []
        for m in cls._CALL.finditer(section):
            try:
                args = json.loads(m.group(3))
            except ValueError:
                continue
            if m.group(1) == "function" and isinstance(args, dict):
                out.append((m.end(), ParsedCall(m.group(2).strip(), m.group(3))))
        return out

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        i = text.find(self.OPEN)
        calls = [c for _, c in self.calls_in(text[i + len(self.OPEN):])] if i >= 0 else []
        if not calls:
            return (text or None), []
        return (text[:i].strip() or None), calls

    def stream(self) -> StreamState:
        return _DeepSeekStream(self)

    def forcing_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        t = self.tags.lark
        rules = []
        for k, tool in enumerate(tools):
            schema = dict(tool.get("parameters") or {"type": "object"})
            schema["x-guidance"] = {"whitespace_flexible": False}
            rules.append(f'call{k}: {t(self.CALL)} "function" {t(self.SEP)} {json.dumps(tool["name"] + chr(10), ensure_ascii=False)} '
                         f'"```json\\n" args{k} "\\n```" {t(self.CALL_END)}\n'
                         f"args{k}: %json {json.dumps(schema)}\n")
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: {t(self.OPEN)} call{repeat} {t(self.CLOSE)}\n"
                f"call: {' | '.join(f'call{k}' for k in range(len(tools)))}\n" + "".join(rules))


class _SectionStream(StreamState):
    """A stream for formats whose calls follow an opening tag (``_p.OPEN``) and go out whole as each closes: the
    text before the tag is content, a possible tag is held back; :meth:`_calls` reads the section so far."""

    def __init__(self, parser: Any):
        self._p = parser
        self._buf = ""  # before the section: text held back (a possible opening tag)
        self._section: str | None = None  # the section's text so far, once opened

    def _calls(self, section: str) -> list[ParsedCall]:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._section is None:
            self._buf += text
            i = self._buf.find(self._p.OPEN)
            if i < 0:
                hold = partial_suffix(self._buf, self._p.OPEN)
                out, self._buf = self._buf[:len(self._buf) - hold], self._buf[len(self._buf) - hold:]
                return out, []
            out, self._section, self._buf = self._buf[:i], self._buf[i + len(self._p.OPEN):], ""
            return out, self._new_calls()
        self._section += text
        return "", self._new_calls()

    def _new_calls(self) -> list[CallDelta]:
        found = self._calls(self._section or "")
        out = [CallDelta(k, c.arguments, c.id, c.name) for k, c in enumerate(found) if k >= self.calls]
        self.calls = max(self.calls, len(found))
        return out

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._section is None:
            rest, self._buf = self._buf, ""
            return rest, []
        if not self.calls:  # no well-formed call: the section was content after all
            return self._p.OPEN + self._section, []
        return "", []


class _DeepSeekStream(_SectionStream):
    def _calls(self, section: str) -> list[ParsedCall]:
        return [c for _, c in self._p.calls_in(section)]


class Llama3JsonParser(ToolParser):
    """Llama 3.x templates (JSON-based tool calling): the answer is one or more JSON objects
    ``{"name": ..., "parameters": {...}}`` (``arguments`` also read), apart by ``;``, optionally after
    ``<|python_tag|>``. An answer that does not start with a call is all content; one that starts like a call but
    does not parse as calls stays content whole. ``arguments`` is the parameters object's text as written (whole
    or streamed, the fragments concatenate to it)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)')
    _SEP = re.compile(r"\s*;?\s*")

    def after_sep(self, body: str, pos: int) -> int:
        """Where the separator (possibly empty) that starts at ``pos`` ends."""
        sep = self._SEP.match(body, pos)
        return sep.end() if sep is not None else pos

    def _body(self, text: str) -> str | None:
        """The text after an optional tag when the answer starts like a call, else ``None``."""
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        return body if body.startswith("{") else None

    def calls_in(self, body: str) -> tuple[list[ParsedCall], int]:
        """The calls at the start of ``body`` and where the last whole one (and its separator) ends."""
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            head = self.HEAD.match(body, pos)
            if head is None:
                break
            scan = _JsonValueScan()
            end = scan.feed(body, head.end())
            close = re.compile(r"\s*\}").match(body, end) if scan.done else None
            if close is None:
                break
            try:
                json.loads(body[head.end():end])
            except ValueError:
                break
            calls.append(ParsedCall(json.loads(head.group(1)), body[head.end():end]))
            pos = self.after_sep(body, close.end())
        return calls, pos

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = self._body(text)
        if body is None:
            return (text or None), []
        calls, end = self.calls_in(body)
        if not calls or body[end:].strip():
            return (text or None), []
        return None, calls

    def stream(self) -> StreamState:
        return _LlamaStream(self)

    def forcing_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        rules = []
        for k, tool in enumerate(tools):
            schema = {**(tool.get("parameters") or {"type": "object"}), "x-guidance": {"whitespace_flexible": False}}
            head = json.dumps('{"name":' + json.dumps(tool["name"], ensure_ascii=False) + ',"parameters":',
                              ensure_ascii=False)
            rules.append(f'call{k}: {head} args{k} "}}"\nargs{k}: %json {json.dumps(schema)}\n')
        repeat = ' ("; " call)*' if parallel else ""
        return (f"start: call{repeat}\ncall: {' | '.join(f'call{k}' for k in range(len(tools)))}\n"
                + "".join(rules))


class _LlamaStream(StreamState):
    """Decides at the answer's first text whether it is calls; then sends each call's name once written and its
    parameters in fragments, as :class:`_HermesStream` does."""

    _CLOSE = re.compile(r"\s*\}")

    def __init__(self, parser: Llama3JsonParser):
        self._p = parser
        self._text = ""  # the whole answer so far
        self._mode: str | None = None  # "content" or "calls" once known
        self._done = 0  # where the calls sent whole end in the body
        self._sent = 0  # how far into the body the open call's arguments went out
        self._scan: _JsonValueScan | None = None

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._text += text
        if self._mode is None:
            head = self._text.lstrip()
            tag = self._p.TAG
            if not head or (tag.startswith(head) and head != tag):
                return "", []  # whitespace, or the tag still arriving
            self._mode = "calls" if self._p._body(self._text) is not None or head == tag else "content"
            if self._mode == "content":
                return self._text, []
        if self._mode == "content":
            return text, []
        return "", self._progress()

    def _progress(self) -> list[CallDelta]:
        body = self._p._body(self._text)
        if body is None:
            return []
        out: list[CallDelta] = []
        while True:
            if self._scan is None:
                head = self._p.HEAD.match(body, self._p.after_sep(body, self._done))
                if head is None:
                    return out
                out.append(CallDelta(self.calls, "", ParsedCall("", "").id, json.loads(head.group(1))))
                self.calls += 1
                self._sent, self._scan = head.end(), _JsonValueScan()
            if not self._scan.done:
                end = self._scan.feed(body, self._sent)
                if end > self._sent:
                    out.append(CallDelta(self.calls - 1, body[self._sent:end]))
                    self._sent = end
                if not self._scan.done:
                    return out
            close = self._CLOSE.match(body, self._sent)
            if close is None:
                return out
            self._scan, self._done = None, close.end()

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._mode == "calls" and not self.calls:  # it looked like a call but never was one
            return self._text, []
        if self._mode is None:
            return self._text, []
        return "", []


class MistralParser(ToolParser):
    """Mistral templates: ``[TOOL_CALLS]`` then either a JSON array of ``{"name", "arguments"}`` objects (tokenizers
    before v11) or ``NAME[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v11 and later). The content is
    the text before the first ``[TOOL_CALLS]``; a section with no well-formed call stays content whole. A stream
    sends each call whole once it is complete. The forcing grammar writes the form ``args_form`` names."""

    name = "mistral"
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tokenizer: Any | None = None, args_form: bool = False):
        super().__init__(tokenizer)
        self.args_form = args_form

    def calls_in(self, section: str) -> tuple[list[ParsedCall], bool]:
        """The complete calls in ``section`` (the text after the first tag) and whether all of it was calls."""
        calls: list[ParsedCall] = []
        if section.lstrip().startswith("["):
            try:
                items, end = json.JSONDecoder().raw_decode(section.lstrip())
            except ValueError:
                return _complete_objects(section.lstrip()[1:]), False
            ok = isinstance(items, list) and all(_named_call(x) for x in items)
            return ([ParsedCall(x["name"], json.dumps(x.get("arguments", {}), ensure_ascii=False)) for x in items]
                    if ok else []), ok and not section.lstrip()[end:].strip()
        for part in section.split(self.OPEN):
            name, sep, rest = part.partition(self.ARGS)
            scan = _JsonValueScan()
            end = scan.feed(rest.lstrip())
            if not sep or not scan.done or not name.strip():
                return calls, False
            args = rest.lstrip()[:end]
            try:
                json.loads(args)
            except ValueError:
                return calls, False
            calls.append(ParsedCall(name.strip(), args))
        return calls, True

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        i = text.find(self.OPEN)
        calls = self.calls_in(text[i + len(self.OPEN):])[0] if i >= 0 else []
        if not calls:
            return (text or None), []
        return (text[:i].strip() or None), calls

    def stream(self) -> StreamState:
        return _MistralStream(self)

    def forcing_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        t = self.tags.lark
        rules = []
        for k, tool in enumerate(tools):
            schema = {**(tool.get("parameters") or {"type": "object"}), "x-guidance": {"whitespace_flexible": False}}
            name = json.dumps(tool["name"], ensure_ascii=False)
            if self.args_form:
                rules.append(f"call{k}: {t(self.OPEN)} {name} {t(self.ARGS)} args{k}\n")
            else:
                head = json.dumps('{"name":' + json.dumps(tool["name"], ensure_ascii=False) + ',"arguments":',
                                  ensure_ascii=False)
                rules.append(f'call{k}: {head} args{k} "}}"\n')
            rules.append(f"args{k}: %json {json.dumps(schema)}\n")
        if self.args_form:
            calls = "call call*" if parallel else "call"
        else:
            more = ' ("," call)*' if parallel else ""
            calls = f'{t(self.OPEN)} "[" call{more} "]"'
        return (f"start: {calls}\ncall: {' | '.join(f'call{k}' for k in range(len(tools)))}\n" + "".join(rules))


def _named_call(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("name"), str) and isinstance(x.get("arguments", {}), dict)


def _complete_objects(text: str) -> list[ParsedCall]:
    """The whole ``{"name", "arguments"}`` objects at the start of an unfinished JSON array's text."""
    out: list[ParsedCall] = []
    pos, dec = 0, json.JSONDecoder()
    while True:
        pos = len(text) - len(text[pos:].lstrip(" \n,"))
        try:
            obj, pos = dec.raw_decode(text, pos)
        except ValueError:
            return out
        if not _named_call(obj):
            return out
        out.append(ParsedCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))


class _MistralStream(_SectionStream):
    def _calls(self, section: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = self._p.calls_in(section)[0]  # a call is whole once its JSON closes
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, DeepSeekV3Parser, Llama3JsonParser,
                                                                  MistralParser)}
DEFAULT_TOOL_PARSER = HermesParser.name
AUTO = "auto"
SETTING = "serving.tool_call_parser"
# template families for ``auto``: markers the chat template writes (all of them) -> the parser that reads it,
# first match wins; a template with none of them (or no tools section) gets DEFAULT_TOOL_PARSER
TEMPLATE_FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<tool_call>",), HermesParser.name),
    ((DeepSeekV3Parser.OPEN,), DeepSeekV3Parser.name),
    ((MistralParser.OPEN,), MistralParser.name),
    ((Llama3JsonParser.TAG,), Llama3JsonParser.name),  # Llama 3.1 / 3.3: built-in tools after <|python_tag|>
    (('"parameters"', "<|start_header_id|>"), Llama3JsonParser.name),  # Llama 3.2: JSON calls only
)


def get_tool_parser(name: str = DEFAULT_TOOL_PARSER, tokenizer: Any | None = None) -> ToolParser:
    try:
        return TOOL_PARSERS[name](tokenizer)
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None


def check_tool_parser_setting(name: str) -> None:
    """Start-up check of ``serving.tool_call_parser``: ConfigError naming the key and the known parsers."""
    if name != AUTO and name not in TOOL_PARSERS:
        from kiln.config import ConfigError

        raise ConfigError(f"{SETTING} = {name!r} is not a known tool-call parser; use one of "
                          f"{[AUTO, *sorted(TOOL_PARSERS)]}")


def tool_parser_for(setting: str, chat_template: str | None, tokenizer: Any | None = None) -> ToolParser:
    """The parser ``serving.tool_call_parser`` names, or with ``auto`` the one for the template's family,
    bound to ``tokenizer`` (how it spells the family's tags)."""
    check_tool_parser_setting(setting)
    if setting != AUTO:
        return get_tool_parser(setting, tokenizer)
    for markers, name in TEMPLATE_FAMILIES:
        if chat_template and all(m in chat_template for m in markers):
            if name == MistralParser.name:
                return MistralParser(tokenizer, args_form=MistralParser.ARGS in chat_template)
            return get_tool_parser(name, tokenizer)
    return get_tool_parser(DEFAULT_TOOL_PARSER, tokenizer)

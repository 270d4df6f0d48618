"""Finding tool calls in a model's text, whole or as it streams.

Each parser reads the text generated so far and returns the content that is
safe to show and the calls seen, each ``(name, arguments text so far,
complete)``. Streaming sends what grew since the last look
(``ToolCallStream``); a finished response reads the text once
(``finished_calls``). Both report the same thing, since a stream cannot take
back what it sent: the leading calls of the request's functions, each with
its arguments as far as they got (finish_reason says whether the text was cut
off); a call of any other function, and the text from it on, is content; no
such call at all, and the whole text is content. Formats:

  hermes       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
               (Hermes, Qwen2.5), content may come before the calls.
  llama3_json  ``{"name": ..., "parameters": {...}}``, several separated by
               ``;`` (Llama 3.1/3.2's JSON tool calling); the text is either
               calls or content.
And the grammar-held outputs of tool_choice (gateway/tools.py): a named
function's arguments as the whole text, or ``required``'s JSON array.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gateway.partial_json import as_object, scan_call, value_end, without_partial_tag

PARSERS = ("hermes", "llama3_json")


@dataclass
class Seen:
    """What a parser found so far: content to show and calls."""

    content: str = ""
    calls: list[tuple[str, str, bool]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # where each call's text begins


class Hermes:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def seen(self, text: str) -> Seen:
        at = text.find(self.OPEN)
        if at < 0:
            return Seen(without_partial_tag(text, self.OPEN))
        out = Seen(text[:at])
        while at >= 0:
            call = scan_call(text, at + len(self.OPEN))
            if call is None:
                break
            out.calls.append(call[:3])
            out.starts.append(at)
            if call[3] is None:
                break
            at = text.find(self.OPEN, call[3])
        return out

    @staticmethod
    def render_call(name: str, arguments: dict | str) -> str:
        return f"\n<tool_call>\n{json.dumps({'name': name, 'arguments': as_object(arguments)})}" \
               "\n</tool_call>"

    @staticmethod
    def render_result(content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    @staticmethod
    def system_prompt(tools: list[dict]) -> str:
        return ("You may call one or more functions to assist with the user query. The "
                "functions you may call are given in <tools></tools>:\n<tools>\n"
                + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\nFor each call, write a "
                'JSON object with the function name and arguments inside <tool_call></tool_call>'
                ' tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-object>}\n'
                "</tool_call>")


class Llama3Json:
    def seen(self, text: str) -> Seen:
        body = text.lstrip().removeprefix("<|python_tag|>").lstrip()
        if not body:
            return Seen()
        if not body.startswith("{"):
            return Seen(text)
        out, pos, skipped = Seen(), 0, len(text) - len(body)
        while True:
            call = scan_call(body, pos)
            if call is None:
                return out
            out.calls.append(call[:3])
            out.starts.append(skipped + pos)
            if call[3] is None:
                return out
            rest = body[call[3]:].lstrip()
            if not rest.startswith(";"):
                return out
            pos = len(body) - len(rest) + 1

    @staticmethod
    def render_call(name: str, arguments: dict | str) -> str:
        return json.dumps({"name": name, "parameters": as_object(arguments)})

    @staticmethod
    def render_result(content: str) -> str:
        return content

    @staticmethod
    def system_prompt(tools: list[dict]) -> str:
        return ("Given the following functions, respond with a JSON for a function call with "
                'its proper arguments, in the format {"name": function name, "parameters": '
                "dictionary of argument name and its value}. Do not use variables.\n\n"
                + "\n\n".join(json.dumps(t) for t in tools))


class Named:
    """tool_choice naming a function: the whole (grammar-held) text is its arguments."""

    grammar_held = True  # the text is calls and nothing else

    def __init__(self, name: str) -> None:
        self.name = name

    def seen(self, text: str) -> Seen:
        return Seen(calls=[(self.name, text, value_end(text, 0) is not None)], starts=[0])


class Required:
    """tool_choice "required": a (grammar-held) JSON array of calls."""

    grammar_held = True

    def seen(self, text: str) -> Seen:
        out = Seen()
        pos = text.find("[") + 1
        while pos > 0:
            call = scan_call(text, pos)
            if call is None:
                break
            out.calls.append(call[:3])
            out.starts.append(pos)
            if call[3] is None:
                break
            rest = text[call[3]:].lstrip()
            pos = len(text) - len(rest) + 1 if rest.startswith(",") else 0
        return out


def make_parser(name: str):
    if name == "hermes":
        return Hermes()
    if name == "llama3_json":
        return Llama3Json()
    raise ValueError(f"tool call parser must be one of {PARSERS}, got {name!r}")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reported(seen: Seen, names: frozenset[str] | None) -> tuple[list, int | None]:
    """The calls a response reports: the leading ones of functions in
    ``names`` (None: any). And where the text of the first other call
    begins, from which on the text is content (None: there is none)."""
    for i, (name, _, _) in enumerate(seen.calls):
        if names is not None and name not in names:
            return seen.calls[:i], seen.starts[i]
    return seen.calls, None


def content_of(parser, text: str, seen: Seen, calls: list, rest: int | None) -> str:
    """The content that goes with the reported ``calls``: all of the text
    where there are none; else what came before them, and the text from the
    first call of an unknown function on. A grammar-held text has none."""
    if getattr(parser, "grammar_held", False):
        return ""
    if not calls:
        return text
    return seen.content if rest is None else seen.content + text[rest:]


def finished_calls(parser, text: str, names: frozenset[str] | None = None,
                   ) -> tuple[str | None, list[dict], bool]:
    """(content, tool_calls in OpenAI's shape, whether they are all whole and
    valid) of a finished text: what ``ToolCallStream`` sends for it, collected."""
    seen = parser.seen(text)
    calls, rest = reported(seen, names)
    content = content_of(parser, text, seen, calls, rest)
    if calls:
        content = content.strip()
    return content or None, [{"id": new_call_id(), "type": "function",
                              "function": {"name": name, "arguments": _shown(args, complete)}}
                             for name, args, complete in calls], all_valid(calls)


def _shown(arguments: str, complete: bool) -> str:
    """A call's arguments as sent: a whole object without the space after it."""
    return arguments.rstrip() if complete else arguments


def all_valid(calls: list[tuple[str, str, bool]]) -> bool:
    """There are calls, and each is complete with arguments that parse: the
    model is done and waits for their results (finish_reason "tool_calls")."""
    for _, args, complete in calls:
        if not complete:
            return False
        try:
            json.loads(args)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to read
            return False
    return bool(calls)


class ToolCallStream:
    """Deltas of one streamed choice: ``feed`` the whole text so far, get the
    content that grew and ``tool_calls`` delta entries (a call's id, type and
    name once, then its arguments piece by piece)."""

    def __init__(self, parser, names: frozenset[str] | None = None) -> None:
        """``names``: the request's functions (None: any); a call of another
        is not streamed: it and the text after it go out as content at the end."""
        self.parser = parser
        self.names = names
        self.content_sent = 0
        self.args_sent: list[int] = []
        self.ids: list[str] = []
        self.complete = False  # at the end: every streamed call is whole and valid

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        seen = self.parser.seen(text)
        calls, rest = reported(seen, self.names)
        content = seen.content
        if final:
            self.complete = all_valid(calls)
            content = content_of(self.parser, text, seen, calls, rest)
        delta = content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(content))
        entries = []
        for i, (name, args, complete) in enumerate(calls):
            args = _shown(args, complete)
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                entries.append({"index": i, "id": self.ids[i], "type": "function",
                                "function": {"name": name, "arguments": ""}})
            piece = args[self.args_sent[i]:]
            if piece:
                self.args_sent[i] = len(args)
                entries.append({"index": i, "function": {"arguments": piece}})
        return delta, entries

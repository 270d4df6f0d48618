"""Reading tool-call JSON that may still be arriving: where a call object's
name and arguments are, and whether they are complete yet. Plain string
scanning (no parser that needs the whole document), so a streamed call's
arguments can go out piece by piece."""

from __future__ import annotations

import json
import re

_STRING = r'"((?:[^"\\]|\\.)*)"'
_ARGS_KEY = r'"(?:arguments|parameters)"\s*:\s*'
# {"name": "<name>", "arguments" or "parameters": <value...>
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*' + _STRING + r'\s*,\s*' + _ARGS_KEY)
# The other way round: {"arguments": <value>, "name": "<name>"}
_ARGS_FIRST = re.compile(r'\s*\{\s*' + _ARGS_KEY)
_NAME_LAST = re.compile(r'\s*,\s*"name"\s*:\s*' + _STRING + r'\s*\}')


def scan_call(text: str, pos: int) -> tuple[str, str, bool, int | None] | None:
    """The call object starting at ``pos`` (after whitespace): (name, its
    arguments text so far, whether they are complete, the index after the
    object or None while it is open). None until the arguments have begun,
    and for arguments that are not an object. A call with its arguments
    before its name is read once it is whole (its name comes last, and a
    stream names a call before its arguments)."""
    m = _HEAD.match(text, pos)
    if m is None:
        return _arguments_first(text, pos)
    name = _unquote(m.group(1))
    if name is None or text[m.end():m.end() + 1] != "{":
        return None
    end = value_end(text, m.end())
    if end is None:
        return name, text[m.end():], False, None
    close = text.find("}", end)
    return name, text[m.end():end], True, (close + 1 if close >= 0 else None)


def _arguments_first(text: str, pos: int) -> tuple[str, str, bool, int] | None:
    m = _ARGS_FIRST.match(text, pos)
    if m is None or text[m.end():m.end() + 1] != "{":
        return None
    end = value_end(text, m.end())
    tail = None if end is None else _NAME_LAST.match(text, end)
    name = None if tail is None else _unquote(tail.group(1))
    if name is None:
        return None
    return name, text[m.end():end], True, tail.end()


def _unquote(body: str) -> str | None:
    """A JSON string's value from the text between its quotes; None if invalid."""
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None


def value_end(text: str, pos: int) -> int | None:
    """The index just after the JSON object or array starting at ``pos``
    (after whitespace), or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not ch.isspace():
            return None  # not an object: never complete as arguments
    return None


def without_partial_tag(text: str, tag: str) -> str:
    """``text`` less a tail that may be the start of ``tag`` (held back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def as_object(arguments: dict | str) -> dict | str:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to read
            return arguments
    return arguments
